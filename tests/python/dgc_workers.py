"""Rank bodies for test_momentum_dgc.py: DGC's momentum factor masking and
local gradient clipping inside the hook's momentum correction
(OkTopkState's momentum_masking and local_clip_norm), on DDP over gloo."""

import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from oktopk import OkTopkState, oktopk_hook
from workers import batch, deeper_model, residuals_by_parameter, setup, train_resumable, write

M = 0.9


def _sgd(model, momentum=M):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)


def _step(model, opt, rank, step, clip=None):
    x, y = batch(rank, step)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    if clip is not None:  # a framework's clip after backward (Trainer's max_grad_norm)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def off_is_default(rank, world, port, out, steps):
    """Three hooked models from the same seed: the default state, masking
    and clipping passed off explicitly, and a clip norm no gradient reaches
    (its norm is computed, nothing scaled). Their parameters after every
    step, which must be the same bits."""
    setup(rank, world, port)
    kinds = ({}, {"momentum_masking": "auto", "local_clip_norm": None}, {"local_clip_norm": 1e30})
    runs = []
    for kwargs in kinds:
        model = DDP(deeper_model())
        state = OkTopkState(algorithm="oktopk", density=0.05, warmup_iters=2, **kwargs)
        model.register_comm_hook(state, oktopk_hook)
        runs.append((model, _sgd(model), state))
    same = []
    for step in range(steps):
        for model, opt, _ in runs:
            _step(model, opt, rank, step)
        ref = [p.detach() for p in runs[0][0].parameters()]
        same.append([all(torch.equal(a, b.detach()) for a, b in zip(ref, model.parameters())) for model, _, _ in runs[1:]])
    write(out, rank, {"same": same, "sparse_iters": runs[0][2].iter - 2, "corrected": len(runs[0][2]._momentum.velocity)})
    for _, _, state in runs:
        state.close()
    dist.destroy_process_group()


def masking(rank, world, port, out, steps, clip, device_path, rule=True, post_clip=None):
    """Masking (``rule``: True, "waited", or either over its first n steps
    with a sparse call, (rule, n)) on at density 0.05; ``post_clip``: a
    clip after backward, as the frameworks clip. Each step:
    the velocity step each corrected parameter put into the reduction (x),
    the residuals before and after, and the velocities after. An entry left
    this rank when its residual after is not residual before + x (what the
    library would have kept had it sent nothing); it had waited when its
    residual before was not 0. With SGD (d = 0, no Nesterov) the new
    velocity is x, so after masking it must be 0 where the rule masks
    (True: every entry that left; "waited": those that left after waiting)
    and x elsewhere. Under ``post_clip`` the velocity is the clipped one's:
    only the masked entries are checked, which must be exactly 0."""
    setup(rank, world, port)
    model = DDP(deeper_model())
    state = OkTopkState(algorithm="oktopk", density=0.05, warmup_iters=2, momentum_masking=rule, local_clip_norm=clip,
                        device_path=device_path)
    model.register_comm_hook(state, oktopk_hook)
    opt = _sgd(model)
    corr = state._momentum
    given = {}
    before = corr.before

    def before_(params, members, tensor):
        work = before(params, members, tensor)
        for i, a, b, *_ in work or ():
            given[i] = tensor[a:b].clone()
        return work

    corr.before = before_
    checks = []
    residual = None
    for step in range(steps):
        given.clear()
        _step(model, opt, rank, step, post_clip)
        names = {state._layout.param_index[id(p)]: n for n, p in model.module.named_parameters()}
        if step < state.warmup_iters:
            # A dense step once the correction runs (the second warm-up
            # step) sends every entry: every velocity is zero.
            # ("waited": nothing waited, no velocity is masked.)
            checks.append({"step": step, "dense": True, "velocities": len(corr.velocity),
                           "all_zero": all(not v.any() for v in corr.velocity.values()),
                           "wrong": sum(int((corr.velocity[i] != x).sum()) for i, x in given.items())})
            continue
        after = residuals_by_parameter(state, model.module)
        sent = masked = wrong = kept_nonzero = 0
        rule_now = rule if not isinstance(rule, tuple) else rule[0] if step - state.warmup_iters < rule[1] else False
        for i, x in given.items():
            r0 = torch.zeros_like(x) if residual is None else residual[names[i]].reshape(-1)
            r1 = after[names[i]].reshape(-1)
            left = (r0 + x) != r1
            mask = left & (r0 != 0) if rule_now == "waited" else left if rule_now else torch.zeros_like(left)
            want = torch.where(mask, torch.zeros_like(x), x)
            v = corr.velocity[i]
            wrong += int((v[mask] != 0).sum()) if post_clip is not None else int((v != want).sum())
            sent += int(left.sum())
            masked += int(mask.sum())
            kept_nonzero += int((v != 0).sum())
        checks.append({"step": step, "dense": False, "given": len(given), "sent": sent, "masked": masked, "wrong": wrong,
                       "kept_nonzero": kept_nonzero, "rule": rule_now})
        residual = after
    write(out, rank, {"checks": checks, "params": [p.detach().clone() for p in model.parameters()], "stopped": corr.stopped,
                      "device_groups": len(state._device_groups)})
    state.close()
    dist.destroy_process_group()


def clipping(rank, world, port, out, steps, clip):
    """Clipping on at density 0.05. Each corrected parameter's gradient as
    the bucket held it (raw) and as it entered the velocity (the velocity
    step x less m x the old velocity, SGD with d = 0): the worst ratio of
    the clipped norm to clip / sqrt(P), the worst distance from raw scaled
    by clip_grad_norm_'s rule, and how often the clip bit."""
    setup(rank, world, port)
    model = DDP(deeper_model())
    state = OkTopkState(algorithm="oktopk", density=0.05, warmup_iters=2, local_clip_norm=clip)
    model.register_comm_hook(state, oktopk_hook)
    opt = _sgd(model)
    corr = state._momentum
    limit = clip / math.sqrt(world)
    worst = {"ratio": 0.0, "error": 0.0, "bit": 0, "seen": 0}
    before = corr.before

    def before_(params, members, tensor):
        raw = {i: tensor[a:b].clone() for i, a, b in members}
        old = {i: None if v is None else v.clone() for i, v in ((i, corr.velocity.get(i)) for i, _, _ in members)}
        first = {i: corr.applied.get(i) is None for i, _, _ in members}
        work = before(params, members, tensor)
        for i, a, b, *_ in work or ():
            x = tensor[a:b]
            clipped = x.clone() if old[i] is None or first[i] else x - M * old[i]
            norm = float(torch.linalg.vector_norm(raw[i]))
            want = raw[i] * (limit / (norm + 1e-6)) if norm > limit else raw[i]
            worst["ratio"] = max(worst["ratio"], float(torch.linalg.vector_norm(clipped)) / limit)
            worst["error"] = max(worst["error"], float((clipped - want).abs().max()) / (float(want.abs().max()) + 1e-30))
            worst["bit"] += norm > limit
            worst["seen"] += 1
        return work

    corr.before = before_
    for step in range(steps):
        _step(model, opt, rank, step)
    write(out, rank, {"worst": worst, "params": [p.detach().clone() for p in model.parameters()], "stopped": corr.stopped})
    state.close()
    dist.destroy_process_group()


def masked_density_one(rank, world, port, out, steps):
    """At density 1 every entry is sent each step, so masking zeroes every
    velocity: beside plain DDP whose SGD momentum buffer is zeroed after
    each step from the second (the correction starts at the optimizer's
    first step, so the second step still carries the first one's
    momentum), the parameters must match to float32 rounding."""
    setup(rank, world, port)
    a, b = DDP(deeper_model()), DDP(deeper_model())
    state = OkTopkState(algorithm="oktopk", density=1.0, warmup_iters=2, momentum_masking=True)
    a.register_comm_hook(state, oktopk_hook)
    b.register_comm_hook(None, allreduce_hook)
    oa, ob = _sgd(a), _sgd(b)
    worst = 0.0
    for step in range(steps):
        _step(a, oa, rank, step)
        _step(b, ob, rank, step)
        if step >= 1:
            for p in b.parameters():
                ob.state[p]["momentum_buffer"].zero_()
        for pa, pb in zip(a.parameters(), b.parameters()):
            worst = max(worst, (pa.detach() - pb.detach()).abs().max().item() / (pb.detach().abs().max().item() + 1e-30))
    write(out, rank, {"worst": worst, "corrected": len(state._momentum.velocity), "params": len(list(a.parameters())),
                      "sparse_iters": state.iter - state.warmup_iters})
    state.close()
    dist.destroy_process_group()


def waited_density_one(rank, world, port, out, steps):
    """At density 1 every entry is sent at every call, so none ever waits:
    "waited" masking masks nothing. Beside the default correction (no
    masking) from the same seed, the parameters after every step must be
    the same bits: dense SGD with momentum."""
    setup(rank, world, port)
    a, b = DDP(deeper_model()), DDP(deeper_model())
    sa = OkTopkState(algorithm="oktopk", density=1.0, warmup_iters=2, momentum_masking="waited")
    sb = OkTopkState(algorithm="oktopk", density=1.0, warmup_iters=2)
    a.register_comm_hook(sa, oktopk_hook)
    b.register_comm_hook(sb, oktopk_hook)
    oa, ob = _sgd(a), _sgd(b)
    same = []
    for step in range(steps):
        _step(a, oa, rank, step)
        _step(b, ob, rank, step)
        same.append(all(torch.equal(pa.detach(), pb.detach()) for pa, pb in zip(a.parameters(), b.parameters())))
    write(out, rank, {"same": same, "corrected": len(sa._momentum.velocity), "velocity_nonzero": sum(int(v.count_nonzero()) for v in sa._momentum.velocity.values()),
                      "sparse_iters": sa.iter - sa.warmup_iters})
    sa.close()
    sb.close()
    dist.destroy_process_group()


def waited_resume(rank, world, port, out, ckpt, rule="waited"):
    """"waited" masking (or ``rule``) at density 0.1 over 10 steps, saving
    after step 6, and the same run resumed from that checkpoint: the resumed
    run must know which entries were waiting when it was saved, and how
    many steps a masking of n steps has left. Records each step's
    velocities' count of nonzero entries."""
    setup(rank, world, port)
    path = os.path.join(ckpt, f"rank{rank}-waited.pt")

    def record(state):
        return sum(int(v.count_nonzero()) for v in state._momentum.velocity.values())

    def state():
        return OkTopkState(algorithm="oktopk", density=0.1, warmup_iters=2, momentum_masking=rule)

    full = train_resumable(rank, path, 0, 10, state(), record, save=6)
    resumed = train_resumable(rank, path, 6, 10, state(), record)
    write(out, rank, {"full": full, "resumed": resumed})
    dist.destroy_process_group()
