"""torchvision's VGG-16 (vgg16(num_classes=10), 134M parameters, no
weights) on Fashion-MNIST padded to 32x32 over three channels, plain DDP
with SGD, momentum and weight decay, the one line
(examples/frameworks/vgg16_fashion.py). 2 ranks, 2 images a rank, 4
steps: each step moves 537 MB of gradients, and each rank holds the model,
its gradients, DDP's buckets, the momentum and the hook's residual and
velocity (about 5.5 GB a rank, measured at 4 images)."""

import math
import re

from fwutil import launch, tail


def test_vgg16_trains_through_the_hook_with_sparse_steps(tmp_path):
    # Steps 0-1 are the dense warm-up, 2-3 the start of the sparse probe.
    p, ranks = launch("vgg16_fashion.py", ["--oktopk", "--steps", "4", "--batch-size", "2"], tmp_path / "stats")
    assert p.returncode == 0, tail(p)
    assert sorted(ranks) == [0, 1], tail(p)
    for rank in ranks.values():
        assert rank["ddp_hooks"] == [["oktopk.hook.oktopk_hook"]], rank
        (state,) = rank["states"]
        assert state["bytes_sent"] > 0 and state["choice"]["steps"]["sparse"] == 2, state
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)", p.stdout, re.M)]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), tail(p)
    assert "134,301,514 parameters" in p.stdout, tail(p)
    assert "momentum correction stopped" not in p.stderr, tail(p)  # plain SGD: the correction stays on
