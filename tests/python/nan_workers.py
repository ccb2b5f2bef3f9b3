"""Rank bodies for test_nan_one_group.py: a NaN in one DDP bucket's
gradient on one rank, the optimizer step skipped as GradScaler skips it,
and what the step leaves behind in the hook's state."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from oktopk import OkTopkState, oktopk_hook
from workers import batch, deeper_model, residuals_by_parameter, setup, write


def _snapshot(state, model):
    """What the step must leave as it was: every library state (residual,
    thresholds, boundaries, call count: the checkpoint's bytes), every
    residual by parameter, and the momentum correction's velocities, B and
    "waited" masks (copies: the correction updates its buffers in place)."""
    sd = state.state_dict()
    corr = state._momentum

    def copies(table):
        return {i: t.detach().clone() for i, t in table.items() if t is not None}

    # In the warm-up no group has a library state yet: no residuals.
    residuals = residuals_by_parameter(state, model) if set(sd["layout"]) <= set(sd["tensors"]) else {}
    return {"tensors": dict(sd["tensors"]), "residuals": residuals,
            "velocity": copies(corr.velocity), "applied": copies(corr.applied), "zero": copies(corr.mask.zero),
            "residual_groups": sorted(sd["residual_groups"])}


def _equal(a, b):
    """Where two snapshots differ (names), bitwise."""
    diff = []
    if a["tensors"] != b["tensors"]:
        diff += [f"library state of group {g}" for g in sorted(set(a["tensors"]) | set(b["tensors"]))
                 if a["tensors"].get(g) != b["tensors"].get(g)]
    for what in ("residuals", "velocity", "applied", "zero"):
        keys = set(a[what]) | set(b[what])
        diff += [f"{what} {k}" for k in sorted(keys, key=str)
                 if k not in a[what] or k not in b[what] or not torch.equal(a[what][k], b[what][k])]
    if a["residual_groups"] != b["residual_groups"]:
        diff.append("residual groups")
    return diff


def nan_in_one_bucket(rank, world, port, out, steps, bad_step, device_path, masking):
    """Two runs from the same seed, SGD with momentum through the hook
    (algorithm "oktopk", density 0.1, warm-up 2, the correction on): in the
    first, rank 1's gradient of the first layer's weight (one bucket of
    several) gets a NaN at ``bad_step`` and no rank steps the optimizer
    there; the second never takes that step's batch. Writes the first run's
    differences across the bad step, how many library calls that step made
    and skipped, and both runs' final parameters."""
    setup(rank, world, port)
    result = {}
    for name in ("nan", "without"):
        torch.manual_seed(0)
        net = deeper_model()
        model = DDP(net, bucket_cap_mb=0.001)  # several buckets
        state = OkTopkState(algorithm="oktopk", density=0.1, warmup_iters=2, device_path=device_path, momentum_masking=masking)
        model.register_comm_hook(state, oktopk_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(steps):
            if name == "without" and step == bad_step:
                continue  # the batch never taken
            x, y = batch(rank, step)
            opt.zero_grad()
            bad = name == "nan" and step == bad_step
            if bad:
                before = _snapshot(state, model)
                calls = dict(state._reducer.algorithm_counts)
                if rank == 1:
                    handle = net[0].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), float("nan")))
            F.cross_entropy(model(x), y).backward()
            if bad and rank == 1:
                handle.remove()
            finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            if finite:
                opt.step()  # as GradScaler: a step with NaN or Inf in a gradient is skipped
            if bad:
                result["finite_at_bad_step"] = finite
                result["calls_at_bad_step"] = sum(state._reducer.algorithm_counts.values()) - sum(calls.values())
                result["groups"] = len(state._layout.groups)
                after = _snapshot(state, model)
                result["changed"] = _equal(before, after)
                result["velocities"] = len(before["velocity"])
                result["residual_entries"] = sum(int((r != 0).sum()) for r in before["residuals"].values())
                result["skipped_finite_after"] = None
            elif name == "nan" and step > bad_step and result.get("skipped_finite_after") is None:
                result["skipped_finite_after"] = finite
        result[f"params_{name}"] = [p.detach().clone() for p in model.parameters()]
        result[f"sparse_steps_{name}"] = state.iter - state.warmup_iters
        state.close()
    write(out, rank, result)
    dist.destroy_process_group()
