"""The zero-line launcher (``python -m oktopk.run``) on the framework
examples run without their one line (no ``--oktopk``): Lightning's
``strategy="ddp"``, Accelerate's ``prepare`` and torchvision's VGG-16
under plain DDP. Each rank's DistributedDataParallel carries oktopk's
hook, put on by the launcher, and its state counts the library's bytes
(read from the state, not from a log line). Trainer's case is in
test_hf_trainer.py."""

import pytest
from fwutil import launch, tail

HOOK = "oktopk.hook.oktopk_hook"

CASES = {
    # example, its arguments without the one line, the module DDP wraps
    "lightning": ("lightning_train.py", ["--batches", "3", "--epochs", "1"], "FashionCNN"),
    "accelerate": ("accelerate_train.py", ["--steps", "4", "--save-every", "100"], "ByteLM"),
    # 3 steps of 1 image a rank: the 2-step warm-up, then one sparse step
    "vgg16": ("vgg16_fashion.py", ["--steps", "3", "--batch-size", "1"], "VGG"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_launcher_puts_the_hook_on_an_unchanged_script(case, tmp_path):
    example, args, module = CASES[case]
    if case != "vgg16":
        args = ["--out", tmp_path / "out", *args]
    p, ranks = launch(example, args, tmp_path / "stats", launcher="oktopk")
    assert p.returncode == 0, tail(p)
    assert sorted(ranks) == [0, 1], tail(p)
    for rank in ranks.values():
        assert rank["ddp_hooks"] == [[HOOK]], rank
        (registered,) = rank["autohook_registered"]  # the launcher's (module, state)
        assert registered["module"] == module, registered
        assert registered["bytes_sent"] > 0, registered  # sparse steps went through the library
    assert f"oktopk: oktopk_hook is on for DistributedDataParallel({module})" in p.stderr, tail(p)
