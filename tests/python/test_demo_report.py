"""make demo's report (bench/demo_report.py) from bench/ddp_e2e.py's lines:
the ``choice,`` line is read by path name, so every number lands in its own
path's slot whichever paths the line has, and the reason keeps its commas.
No torch here: the lines are recorded ones."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from demo_report import choice_sentence, parse_choice, read_demo_out, report  # noqa: E402
from tta_report import HEADER  # noqa: E402

# As ddp_e2e.py prints it today: choice,METHOD,PATH,CANDIDATE, then P:MS and
# P:STEPS for each path of oktopk.choice's summary()["steps"], then the reason.
RECORDED = ("choice,oktopk,sparse,sparse,native:1472.7,sparse:779.5,bf16:None,quantized:None,"
            "native:4,sparse:94,bf16:0,quantized:0,"
            "sparse 779.5 ms/step saves 47% of native's 1472.7 (margin 10%), more text, with commas")
RECORDED_REASON = "sparse 779.5 ms/step saves 47% of native's 1472.7 (margin 10%), more text, with commas"
RECORDED_SENTENCE = ("The hook timed a step at 1472.7 ms on native and 779.5 ms on sparse, and chose sparse: "
                     f"{RECORDED_REASON}. Steps after the dense warm-up: 4 native (gloo's allreduce), 94 sparse.")


def test_parse_choice_puts_every_field_in_its_named_slot():
    assert parse_choice(RECORDED + "\n") == {
        "method": "oktopk",
        "path": "sparse",
        "candidate": "sparse",
        "ms_per_step": {"native": 1472.7, "sparse": 779.5, "bf16": None, "quantized": None},
        "steps": {"native": 4, "sparse": 94, "bf16": 0, "quantized": 0},
        "reason": RECORDED_REASON,
    }


def test_parse_choice_reads_a_line_with_native_and_sparse_only():
    older = f"choice,oktopk,native,sparse,native:101.25,sparse:130.0,native:96,sparse:4,{RECORDED_REASON}"
    assert parse_choice(older) == {
        "method": "oktopk",
        "path": "native",
        "candidate": "sparse",
        "ms_per_step": {"native": 101.25, "sparse": 130.0},
        "steps": {"native": 96, "sparse": 4},
        "reason": RECORDED_REASON,
    }


@pytest.mark.parametrize("line, sentence", [
    (RECORDED, RECORDED_SENTENCE),
    # An Adam-family optimizer: bf16 in sparse's place; a full float repr
    # shown to one decimal.
    ("choice,oktopk,bf16,bf16,native:1210.3,sparse:None,bf16:679.6992899999168,quantized:None,"
     "native:4,sparse:0,bf16:94,quantized:0,bf16 679.7 ms/step saves 44% of native's 1210.3 (margin 10%)",
     "The hook timed a step at 1210.3 ms on native and 679.7 ms on bf16, and chose bf16: bf16 679.7 ms/step saves "
     "44% of native's 1210.3 (margin 10%). Steps after the dense warm-up: 4 native (gloo's allreduce), 94 bf16."),
    # No compressed dense path under Adam: native only, nothing timed; the
    # reason's "parameters: native" is text, not a path's field.
    ("choice,oktopk,native,None,native:None,sparse:None,bf16:None,quantized:None,"
     "native:98,sparse:0,bf16:0,quantized:0,Adam steps the parameters: native on every step (oktopk.optimizers)",
     "The hook chose native: Adam steps the parameters: native on every step (oktopk.optimizers). "
     "Steps after the dense warm-up: 98 native (gloo's allreduce)."),
    # A run too short for a decision.
    ("choice,oktopk,None,sparse,native:None,sparse:None,bf16:None,quantized:None,"
     "native:0,sparse:3,bf16:0,quantized:0,exploring: no decision yet",
     "The hook had made no decision yet: exploring: no decision yet. Steps after the dense warm-up: 3 sparse."),
])
def test_choice_sentence(line, sentence):
    assert choice_sentence(parse_choice(line)) == sentence


@pytest.mark.parametrize("line", [
    "row,oktopk,sparse",  # not a choice line
    "choice,oktopk,sparse,sparse,native:1.0,sparse:2.0,native:4,a reason",  # sparse's steps missing
    "choice,oktopk,sparse,sparse,native:1.0,sparse:2.0,sparse:94,native:4,a reason",  # steps out of order
    "choice,oktopk,sparse,sparse,native:fast,sparse:2.0,native:4,sparse:94,a reason",  # ms not a number
])
def test_parse_choice_rejects_a_line_in_another_format(line):
    with pytest.raises(ValueError):
        parse_choice(line)


def test_report_from_a_recorded_demo_out(tmp_path):
    def row(method, ms_per_step):
        values = dict.fromkeys(HEADER.split(","), "0")
        values.update(method=method, final_step="100", run_bytes="250000000", final_accuracy="95.50",
                      ms_per_step=ms_per_step)
        return "row," + ",".join(values.values())

    demo_out = tmp_path / "demo.out"
    demo_out.write_text("\n".join([
        "curve,ddp,5,7.4,91.00,0.3", "curve,ddp,10,14.7,96.00,0.2",
        "curve,oktopk,5,3.9,90.50,0.3", "curve,oktopk,10,7.8,95.50,0.2",
        row("ddp", "1472.7"), RECORDED, row("oktopk", "779.5"),
    ]) + "\n")
    rows, curve, choice = read_demo_out(demo_out)
    assert sorted(rows) == ["ddp", "oktopk"] and len(curve) == 4 and choice == parse_choice(RECORDED)
    lines = report(rows, curve, choice, "netns", "1gbit", "95").splitlines()
    assert f"{'ms per step':28}{1472.7:>22.1f}{779.5:>26.1f}" in lines
    assert lines[-2:] == [RECORDED_SENTENCE, f"On 1gbit links the hook's steps are {1472.7 / 779.5:.1f}x as fast as "
                                             "plain DDP's."]


def _row(method, ms_per_step, final_step, steps, accuracy):
    values = dict.fromkeys(HEADER.split(","), "0")
    values.update(method=method, final_step=str(final_step), steps=str(steps), run_bytes="250000000",
                  final_accuracy=accuracy, ms_per_step=ms_per_step)
    return dict(zip(HEADER.split(","), values.values()))


def test_report_says_how_much_sooner_the_hook_reached_the_target():
    curve = ["ddp,20,24.0,93.00,0.3", "ddp,40,48.0,95.28,0.2", "oktopk,40,8.0,94.00,0.3", "oktopk,60,12.0,95.56,0.2"]
    rows = {"ddp": _row("ddp", "1200.0", 40, 100, "95.28"), "oktopk": _row("oktopk", "200.0", 60, 100, "95.56")}
    lines = report(rows, curve, None, "netns", "200mbit", "95").splitlines()
    assert "(a run ends at its first evaluation at or above 95%, or after 100 steps)" in lines
    assert ("The hook reached 95% accuracy 4.0x sooner than plain DDP: 12.0 s of training against 48.0 s "
            "(60 steps against 40).") in lines
    assert f"{'time to 90% accuracy':28}{'24.0 s (step 20)':>22}{'8.0 s (step 40)':>26}" in lines


def test_report_says_when_the_hook_is_later_or_never_there():
    curve = ["ddp,40,48.0,95.28,0.2", "oktopk,60,60.0,95.56,0.2"]
    rows = {"ddp": _row("ddp", "1200.0", 100, 100, "97.0"), "oktopk": _row("oktopk", "1000.0", 100, 100, "96.0")}
    lines = report(rows, curve, None, "netns", "1gbit", "95").splitlines()
    assert not any(line.startswith("(a run ends") for line in lines)  # neither run stopped early
    assert "The hook reached 95% accuracy 1.2x later than plain DDP: 60.0 s of training against 48.0 s (60 steps against 40)." in lines
    lines = report(rows, curve[:1], None, "netns", "1gbit", "95").splitlines()
    assert "The hook did not reach 95% in 100 steps; plain DDP did in 48.0 s." in lines
