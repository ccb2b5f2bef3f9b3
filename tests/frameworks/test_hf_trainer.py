"""Hugging Face Transformers' Trainer pre-training BertForMaskedLM (BERT's
architecture at a reduced size, no weights downloaded) on the fortunes
text, 2 CPU ranks (examples/frameworks/hf_trainer.py): the hook put on by
the launcher with no line in the script, and by OkTopkCallback with one;
Trainer's gradient accumulation, bf16 autocast, clipping at
max_grad_norm=1.0, and its checkpoint and resume."""

import shutil

import torch
from fwutil import launch, tail
from safetensors.torch import load_file

HOOK = "oktopk.hook.oktopk_hook"


def test_the_launcher_puts_the_hook_on_trainers_ddp_and_it_sends_sparse(tmp_path):
    # SGD with momentum (Trainer's optim="sgd"): after the 2-step dense
    # warm-up the hook probes the sparse path, through the library, whose
    # bytes the state counts. Trainer clips at max_grad_norm=1.0 by
    # default, after backward (clip_grad_norm_: one factor on every value):
    # the momentum correction follows the clip and stays on.
    p, ranks = launch("hf_trainer.py", ["--out", tmp_path / "run", "--optim", "sgd", "--optim-args", "momentum=0.9",
                                        "--lr", "0.05", "--steps", "6", "--save-steps", "100"],
                      tmp_path / "stats", launcher="oktopk")
    assert p.returncode == 0, tail(p)
    assert sorted(ranks) == [0, 1], tail(p)
    for rank in ranks.values():
        assert rank["ddp_hooks"] == [[HOOK]], rank
        (registered,) = rank["autohook_registered"]  # the launcher's (module, state)
        assert registered["module"] == "BertForMaskedLM", registered
        assert registered["bytes_sent"] > 0, registered  # sparse steps went through the library
        (state,) = rank["states"]  # the only state in the process: the launcher's
        assert state["choice"]["steps"]["sparse"] > 0, state
        assert state["momentum_status"] == "on", state
    assert "oktopk: oktopk_hook is on for DistributedDataParallel(BertForMaskedLM)" in p.stderr, tail(p)
    assert "momentum correction stopped" not in p.stderr, tail(p)


def test_the_callback_registers_the_hook_and_a_resumed_trainer_continues_bitwise(tmp_path):
    # Trainer's defaults (AdamW, clipping at 1.0) with bf16 autocast and 2
    # micro-batches a step; a checkpoint at step 4 of 6. The hook keeps
    # AdamW's gradients dense: the 2 warm-up steps native, then 4 on the
    # 4-bit path with error feedback (dense_compression's default), its
    # probe, whose residuals the checkpoint carries. Within those 6 steps every step's path is fixed
    # by its number: the first choice that measured time can make (a
    # clear win, at the probe's end) would fall at step 6, and a choice
    # made apart in the whole and the resumed run could differ. The
    # resumed run matches only if the callback gave each rank its saved
    # state back (a fresh state would run the warm-up's float32 steps
    # again).
    common = ["--oktopk", "--bf16", "--grad-accum", "2", "--steps", "6", "--save-steps", "4"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    p, ranks = launch("hf_trainer.py", ["--out", whole, *common], tmp_path / "whole-stats")
    assert p.returncode == 0, tail(p)
    for rank in ranks.values():
        assert rank["ddp_hooks"] == [[HOOK]], rank
        (state,) = rank["states"]
        assert state["choice"]["kept_dense_for"] == "AdamW", state
        assert state["choice"]["steps"]["quantized"] > 0, state
    assert "AdamW steps these parameters: the hook keeps the process group's dense allreduce" in p.stderr, tail(p)
    assert (whole / "checkpoint-4" / "oktopk_state_1.pt").exists()

    shutil.copytree(whole / "checkpoint-4", resumed / "checkpoint-4")  # the run stopped after step 4
    p, ranks = launch("hf_trainer.py", ["--out", resumed, "--resume", *common], tmp_path / "resumed-stats")
    assert p.returncode == 0, tail(p)
    assert "is missing: the hook's residuals start afresh" not in p.stderr, tail(p)
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert sorted(a) == sorted(b)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ
