"""A run of the measured choice (oktopk.choice) resumed from a checkpoint
takes the paths of the uninterrupted run: the checkpoint carries the time
of the step under way, the Adam-family optimizer seen, and whether the
communicator that folds the residuals was alive (the fault campaign's
warmup-timing, warmup-adam and switch-fold findings, results/chaos_torch.md;
tests/python/test_chaos_torch.py runs their reproductions on real ranks),
and the link model "auto" chose by (auto-remeasure)."""

import pytest

import workers
from oktopk import OkTopkState
from oktopk.choice import BF16, NATIVE, PROBE_STEPS, QUANTIZED, SPARSE, StepChoice
from test_ddp import run


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_steps(choice, clock, first, last, ms):
    """begin_step for steps first..last-1 on one rank (agree is the
    identity), each taking ms(path) milliseconds; the paths."""
    choice.agree = lambda values: values
    paths = []
    for s in range(first, last):
        paths.append(choice.begin_step(s, untimed=s == first and first > 0))
        clock.now += ms(paths[-1]) / 1e3
    return paths


def slow_link(path):
    return 10.0 if path == SPARSE else 30.0  # sparse a third of native: a clear win


def in_last_warm_up_step(seconds):
    """A choice (on a clock of its own) timing the warm-up's last step, and
    ``seconds`` into it."""
    choice, clock = StepChoice(recheck_every=200), Clock()
    choice.clock = clock
    choice.time_warmup_step()
    clock.now += seconds
    return choice, clock


def test_a_checkpoint_saved_at_the_end_of_the_warm_up_carries_its_last_steps_time():
    # The whole run: the warm-up's last step takes 30 ms from its first
    # bucket to the next step's (20 ms until the checkpoint, 10 after), so
    # the sparse probe's 10 ms is a clear win at s = 4: no native probe.
    whole, clock = in_last_warm_up_step(0.020)
    saved = whole.state_dict()
    clock.now += 0.010
    want = run_steps(whole, clock, 0, 12, slow_link)
    assert want == [SPARSE] * 12 and whole.ms[NATIVE] == pytest.approx(30.0)

    # Resumed from that checkpoint in another process (another clock):
    # the 20 ms so far, and the 10 ms from the load to its first bucket.
    resumed, clock = StepChoice(), Clock()
    clock.now = 100.0
    resumed.load_state_dict(saved)
    resumed.clock = clock
    resumed.resume_timing()
    clock.now += 0.010
    assert run_steps(resumed, clock, 0, 12, slow_link) == want
    assert resumed.ms[NATIVE] == pytest.approx(30.0) and resumed.summary()["reason"] == whole.summary()["reason"]


def test_a_checkpoint_with_no_step_under_way_loads_and_probes_native():
    # Saved before any timed step: the step is not timed, and the resumed
    # run probes native after the sparse probe.
    whole, clock = in_last_warm_up_step(0.020)
    saved = whole.state_dict()
    saved["unfinished"] = None
    resumed, clock = StepChoice(), Clock()
    resumed.load_state_dict(saved)
    resumed.clock = clock
    resumed.resume_timing()
    paths = run_steps(resumed, clock, 0, 2 * PROBE_STEPS, slow_link)
    assert paths == [SPARSE] * PROBE_STEPS + [NATIVE] * PROBE_STEPS


def test_the_agreements_wait_is_left_out_of_the_step_under_way():
    choice, clock = in_last_warm_up_step(0.030)
    clock.now += 5.0  # waiting for a slow rank at the agreement on the settings
    choice.leave_out(5.0)
    run_steps(choice, clock, 0, PROBE_STEPS + 1, slow_link)
    assert choice.chosen == SPARSE and choice.ms[NATIVE] == pytest.approx(30.0)


@pytest.mark.parametrize("algorithm", [None, "oktopk"])
def test_the_adam_family_optimizer_seen_is_carried_by_the_checkpoint_of_the_measured_choice(algorithm):
    saving = OkTopkState(algorithm=algorithm)
    saving._optimizers.seen = "AdamW"  # as its optimizer's step hook notes it
    saved = saving.state_dict()
    assert saved["optimizer_seen"] == "AdamW"
    resumed = OkTopkState(algorithm=algorithm)
    resumed.load_state_dict(saved)
    if algorithm is not None:
        # A named algorithm only warns of it: a resumed process warns again.
        assert resumed._optimizers.seen is None
        return
    assert resumed._optimizers.seen == "AdamW"
    # The ranks agree on it at the first step after the warm-up, before
    # the resumed process's optimizer has stepped: the 4-bit path (the
    # default dense_compression) takes sparse's place, as in the run that
    # saved it.
    choice = resumed._choice
    choice.agree = lambda values: values
    assert choice.begin_step(0) == QUANTIZED and choice.kept_dense_for == "AdamW"
    for state in (saving, resumed):
        state.close()


def test_a_checkpoint_measuring_another_dense_compression_is_refused_by_name():
    # A run under Adam saved while its choice measured bf16 (the default
    # dense_compression before the 4-bit path): today's default cannot
    # continue that choice, and the error names the setting that can.
    saving = OkTopkState(dense_compression="bf16")
    saving._optimizers.seen = "AdamW"
    saving._choice.agree = lambda values: values
    assert saving._choice.begin_step(0) == BF16
    saved = saving.state_dict()
    resumed = OkTopkState()
    with pytest.raises(ValueError, match=r"measures the bf16 path.*pass dense_compression='bf16' to resume it"):
        resumed.load_state_dict(saved)
    again = OkTopkState(dense_compression="bf16")
    again.load_state_dict(saved)
    assert again._choice.candidate == BF16
    for state in (saving, resumed, again):
        state.close()


def test_the_checkpoint_carries_the_path_of_the_step_just_run_and_whether_the_communicator_was_alive():
    saving = OkTopkState()
    saving._path = NATIVE
    saved = saving.state_dict()
    assert saved["path"] == NATIVE and saved["communicator"] is False
    resumed = OkTopkState()
    resumed.load_state_dict(saved)
    assert resumed._communicator_at_load is None  # no communicator was alive: none is made for the first step
    for state in (saving, resumed):
        state.close()



def test_checkpoints_saved_between_the_same_two_steps_are_equal():
    # The time so far is read at the first save after a step's first
    # bucket: a later save before the next step holds the same, and so does
    # a save right after the load of it (the fault campaign compares them).
    choice, clock = in_last_warm_up_step(0.020)
    first = choice.state_dict()
    clock.now += 0.005
    assert choice.state_dict() == first and first["unfinished"] == [-1, pytest.approx(0.020)]
    resumed, clock = StepChoice(), Clock()
    resumed.load_state_dict(first)
    resumed.clock = clock
    resumed.resume_timing()
    clock.now += 0.005
    assert resumed.state_dict() == first
    choice.agree = lambda values: values
    choice.begin_step(0)
    assert choice.state_dict()["unfinished"][0] == 0


def test_a_resumed_auto_run_chooses_by_the_saved_link_not_a_new_measurement(tmp_path):
    # "auto" chooses each call's algorithm from the link it measured at its
    # first call; a new measurement differs a little and, where two
    # algorithms are close, chooses another: the resumed run would not be
    # the whole run. The checkpoint carries the link, and the resumed
    # communicator chooses by it.
    results = run(workers.link_resume, 2, str(tmp_path))
    for r, res in results.items():
        full, resumed, saved = res["full"]["steps"], res["resumed"]["steps"], res["saved"]
        assert saved is not None and saved == full[3], (r, saved, full)
        assert all(full[s] == saved for s in range(2, 6)), (r, full)
        assert resumed[4] == saved and resumed[5] == saved, (r, resumed, saved)
        assert res["resumed"]["params"] == res["full"]["params"], f"rank {r}: the resumed run's parameters differ"
    assert results[0]["saved"] == results[1]["saved"], "the ranks saved different links"
