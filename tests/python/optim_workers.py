"""Rank functions for oktopk.optim's tests (spawned by test_ddp.run)."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import oktopk.optim
from oktopk import OkTopkError
from workers import batch, setup, write


def model(seed=0):
    # Shapes with blocks of several sizes: 48 x 20 (blocks 48 x 20), a
    # vector of 48 (one block of 48), 5 x 48 (5 x 48), 5.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 48), nn.ReLU(), nn.Linear(48, 5))


def flat_grad(opt):
    return torch.cat([p.grad.reshape(-1) * g["lr"] for g in opt.param_groups for p in g["params"]])


def demo_steps(rank, world, port, out, steps, topk, nan_at, value_dtype="float32"):
    """DeMo on a DDP module: per step, what each rank needs to check the
    exchange (the accumulated momentum before, the momentum after, the
    parameters before and after)."""
    setup(rank, world, port)
    m = DDP(model())
    opt = oktopk.optim.DeMo(m, lr=0.01, weight_decay=0.1, topk=topk, value_dtype=value_dtype)
    record = []
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        if step == nan_at and rank == world - 1:
            m.module[0].weight.grad[3, 4] = float("nan")
        local = F.cross_entropy(m.module(x), y)
        local_grad = torch.autograd.grad(local, m.module[0].weight)[0]
        before = [p.detach().clone() for p in m.parameters()]
        momentum = opt.momentum.clone()
        acc = opt.transform.apply(flat_grad(opt)).add_(momentum, alpha=opt.momentum_decay)  # as step() forms it
        opt.step()
        record.append({
            "grad_is_local": torch.equal(m.module[0].weight.grad, local_grad) if step != nan_at else None,
            "acc": acc.numpy().copy(),
            "momentum_before": momentum.numpy().copy(),
            "momentum": opt.momentum.numpy().copy(),
            "before": torch.cat([p.reshape(-1) for p in before]).numpy().copy(),
            "after": torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy().copy(),
        })
    write(out, rank, {"steps": record, "skipped": opt.skipped_steps, "bytes": opt.bytes_sent, "selected": opt.selected,
                      "n": opt.n, "blocks": opt.transform.blocks(), "lr": 0.01, "wd": 0.1})
    opt.close()


def demo_resume(rank, world, port, out, steps, cut, ckpt):
    """The same run whole and resumed at ``cut`` from a checkpoint of the
    model and the optimizer: the final parameters of both."""
    setup(rank, world, port)

    def train(first, last, m, opt):
        for step in range(first, last):
            x, y = batch(rank, step)
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()

    m = DDP(model())
    opt = oktopk.optim.DeMo(m, lr=0.01, weight_decay=0.1)
    train(0, cut, m, opt)
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, f"{ckpt}.{rank}")
    train(cut, steps, m, opt)
    whole = b"".join(p.detach().numpy().tobytes() for p in m.parameters())
    opt.close()

    m2 = DDP(model(seed=5))  # other weights, until the checkpoint loads
    opt2 = oktopk.optim.DeMo(m2, lr=0.01, weight_decay=0.1)
    saved = torch.load(f"{ckpt}.{rank}", weights_only=False)
    m2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(cut, steps, m2, opt2)
    resumed = b"".join(p.detach().numpy().tobytes() for p in m2.parameters())
    tampered = dict(saved["opt"])
    tampered["oktopk"] = dict(tampered["oktopk"], topk=8)
    try:
        opt2.load_state_dict(tampered)
        refused = None
    except ValueError as e:
        refused = str(e)
    write(out, rank, {"whole": whole, "resumed": resumed, "steps": opt2.steps, "refused": refused})
    opt2.close()


def demo_mismatch(rank, world, port, out):
    """Rank 0 selects 32 coefficients per block, the others 8: the first
    step must fail on every rank, quickly, naming the difference."""
    import time

    setup(rank, world, port)
    m = DDP(model())
    opt = oktopk.optim.DeMo(m, lr=0.01, topk=32 if rank == 0 else 8, timeout=20)
    x, y = batch(rank, 0)
    F.cross_entropy(m(x), y).backward()
    params = [p.detach().clone() for p in m.parameters()]
    start = time.monotonic()
    try:
        opt.step()
        error = None
    except OkTopkError as e:
        error = str(e)
    write(out, rank, {"error": error, "seconds": time.monotonic() - start,
                      "unchanged": all(torch.equal(a, p) for a, p in zip(params, m.parameters())),
                      "momentum_zero": not bool(opt.momentum.any())})
    opt.close()


def demo_dead_peer(rank, world, port, out, timeout):
    """The last rank dies after two steps (DDP rebuilds its buckets, a
    collective of its own, in the second); the others' third step must fail
    within the timeout, leaving the momentum and parameters as they were."""
    import os
    import time

    setup(rank, world, port)
    m = DDP(model())
    opt = oktopk.optim.DeMo(m, lr=0.01, timeout=timeout)
    for step in range(3):
        if step == 2:
            dist.barrier()  # the dying rank's last sends have arrived
            if rank == world - 1:
                os._exit(0)  # no goodbye: the peer vanishes
        x, y = batch(rank, step)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        params = [p.detach().clone() for p in m.parameters()]
        momentum = opt.momentum.clone()
        start = time.monotonic()
        try:
            opt.step()
            error = None
        except Exception as e:  # noqa: BLE001 - the test checks it is OkTopkError
            error = repr(e)
    write(out, rank, {"error": error, "seconds": time.monotonic() - start,
                      "unchanged": all(torch.equal(a, p) for a, p in zip(params, m.parameters())),
                      "momentum_unchanged": torch.equal(momentum, opt.momentum), "steps": opt.steps})
    os._exit(0)  # the process group's peer is gone: no orderly teardown


def demo_held_to_its_settings(rank, world, port, out, ckpt):
    """DeMo over the default group, a frozen parameter among its own: an
    lr that differs from the start, an lr and a weight decay changed on
    one rank mid-run, a load refused on one rank (another rank's
    checkpoint, then a corrupted one). Per event: the error each rank got,
    how long the call took, and whether the optimizer and the parameters
    stayed exactly as they were."""
    import io
    import time

    setup(rank, world, port)
    m = model()
    frozen = nn.Parameter(torch.randn(6, 6), requires_grad=False)
    params = list(m.parameters()) + [frozen]
    frozen_before = frozen.detach().clone()
    opt = oktopk.optim.DeMo(params, lr=0.02 if rank == 1 else 0.01, weight_decay=0.1, topk=8, timeout=10)

    def snapshot():
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        return buf.getvalue(), [p.detach().clone() for p in params]

    def attempt(action):
        before, values = snapshot()
        start = time.monotonic()
        try:
            action()
            error = None
        except Exception as e:  # noqa: BLE001 - the test checks the type
            error = f"{type(e).__name__}: {e}"
        seconds = time.monotonic() - start
        after, values_after = snapshot()
        return {"error": error, "seconds": seconds, "state_unchanged": before == after,
                "params_unchanged": all(torch.equal(a, b) for a, b in zip(values, values_after))}

    def step(s):
        x, y = batch(rank, s)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()

    events = {"lr_from_the_start": attempt(lambda: step(0))}
    opt.param_groups[0]["lr"] = 0.01
    for s in range(4):
        step(s)
    torch.save(opt.state_dict(), f"{ckpt}.{rank}")
    dist.barrier()

    def change(name, on_rank, value):
        old = opt.param_groups[0][name]
        if rank == on_rank:
            opt.param_groups[0][name] = value
        event = attempt(lambda: step(4))
        opt.param_groups[0][name] = old
        return event

    events["lr_changed_mid_run"] = change("lr", 1, 0.05)
    events["weight_decay_changed_mid_run"] = change("weight_decay", 0, 0.2)
    own = torch.load(f"{ckpt}.{rank}", weights_only=False)
    other = torch.load(f"{ckpt}.{(rank + 1) % world}", weights_only=False)
    events["another_ranks_checkpoint"] = attempt(lambda: opt.load_state_dict(other if rank == 0 else own))
    corrupt = dict(own, oktopk=dict(own["oktopk"], steps=own["oktopk"]["steps"] + 1))
    events["corrupt_on_one_rank"] = attempt(lambda: opt.load_state_dict(corrupt if rank == world - 1 else own))
    events["after"] = attempt(lambda: step(4))
    write(out, rank, {"events": events, "frozen_unchanged": torch.equal(frozen, frozen_before),
                      "params": torch.cat([p.detach().reshape(-1) for p in params]), "steps": opt.steps})
    opt.close()


def demo_rank_stopped_before_the_first_step(rank, world, port, out, timeout):
    """The last rank never reaches its first step: the others' first step
    must end within the optimizer's timeout with OkTopkError, not wait for
    the process group's (gloo's default: 30 minutes)."""
    import time

    setup(rank, world, port)
    m = model()
    opt = oktopk.optim.DeMo(m.parameters(), lr=0.01, timeout=timeout)
    if rank == world - 1:
        time.sleep(timeout + 4)  # stopped; it ends without stepping
        return
    x, y = batch(rank, 0)
    F.cross_entropy(m(x), y).backward()
    start = time.monotonic()
    try:
        opt.step()
        error = None
    except Exception as e:  # noqa: BLE001 - the test checks the type
        error = f"{type(e).__name__}: {e}"
    write(out, rank, {"error": error, "seconds": time.monotonic() - start, "steps": opt.steps})
