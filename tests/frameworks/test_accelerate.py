"""Hugging Face Accelerate (examples/frameworks/accelerate_train.py): a
byte-level transformer on the fortunes text with SGD and momentum on 2 CPU
ranks, the hook registered on the module accelerator.prepare returned,
save_state and load_state."""

import torch
from fwutil import launch, tail
from safetensors.torch import load_file


def test_accelerate_sends_through_the_hook_and_load_state_continues_bitwise(tmp_path):
    # 6 steps, save_state at step 4, in the middle of the hook's sparse probe
    # (steps 2-5; every step's path is fixed by its number until the probe
    # ends, so a choice by measured time never splits the two runs): the
    # resumed run matches the whole one only if load_state gave every rank
    # its own residuals back (EveryRank), beside Accelerate's model,
    # optimizer and per-rank RNG states. With bf16 mixed precision and
    # accelerator.clip_grad_norm_ (at 0.5, which bites), the momentum
    # correction follows the clip and stays on.
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    common = ["--oktopk", "--steps", "6", "--clip", "0.5", "--mixed-precision", "bf16"]
    p, ranks = launch("accelerate_train.py", ["--out", whole, *common], tmp_path / "whole-stats")
    assert p.returncode == 0, tail(p)
    assert sorted(ranks) == [0, 1], tail(p)
    for rank in ranks.values():
        assert rank["ddp_hooks"] == [["oktopk.hook.oktopk_hook"]], rank
        (state,) = rank["states"]
        assert state["bytes_sent"] > 0 and state["choice"]["steps"]["sparse"] > 0, state
        assert state["momentum_status"] == "on", state
    assert "momentum correction stopped" not in p.stderr, tail(p)
    saved = torch.load(whole / "step_4" / "custom_checkpoint_0.pkl", weights_only=False)
    assert [s["rank"] for s in saved["oktopk_every_rank"]] == [0, 1]  # written by rank 0, both ranks' states

    p, ranks = launch("accelerate_train.py", ["--out", resumed, *common, "--resume", whole / "step_4"],
                      tmp_path / "resumed-stats")
    assert p.returncode == 0, tail(p)
    assert "step 5 loss" in p.stdout and "step 4 loss" not in p.stdout, tail(p)
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ


def test_the_one_line_as_it_is_takes_the_4_bit_path_for_the_early_steps_under_sgd(tmp_path):
    # The example's OkTopkState() with its defaults: under SGD the early
    # steps (sparse_after) measure the 4-bit path against native, so its
    # probe (steps 2-5) sends every value in 4 bits and no step is sparse;
    # the momentum correction stays on, idle on those steps, under the
    # clip and bf16 mixed precision.
    p, ranks = launch("accelerate_train.py", ["--out", tmp_path / "out", "--oktopk", "--steps", "6", "--clip", "0.5",
                                              "--mixed-precision", "bf16"], tmp_path / "stats",
                      env={"FW_ONE_LINE": "{}"})
    assert p.returncode == 0, tail(p)
    assert sorted(ranks) == [0, 1], tail(p)
    for rank in ranks.values():
        (state,) = rank["states"]
        assert state["quantized_bytes_sent"] > 0 and state["bytes_sent"] == 0, state
        assert state["choice"]["candidate"] == "quantized" and state["choice"]["steps"]["sparse"] == 0, state
        assert "sparse_after" not in state["repr"], state  # the default
        assert state["momentum_status"] == "on", state
    assert "momentum correction stopped" not in p.stderr, tail(p)
