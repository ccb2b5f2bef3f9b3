"""Rank bodies for test_momentum.py: DDP over gloo with the hook's momentum
correction (oktopk.momentum) under torch.optim.SGD with momentum."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from oktopk import OkTopkState, oktopk_hook
from workers import batch, deeper_model, residuals_by_parameter, setup, write


def _sgd(model, nesterov, dampening, weight_decay):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov, dampening=dampening, weight_decay=weight_decay)


def _step_both(rank, step, *runs):
    """One training step of each (model, optimizer) on the same batch."""
    x, y = batch(rank, step)
    for m, o in runs:
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()


def native_steps_are_plain_ddp(rank, world, port, out, nesterov, weight_decay, steps):
    """The corrected hook through a dense warm-up of ``steps`` native steps
    (nothing held in any residual) beside plain DDP under the same SGD with
    momentum: whether the parameters and momentum buffers are the same bits
    after every step, and how many buckets the correction worked on."""
    setup(rank, world, port)
    a, b = DDP(deeper_model()), DDP(deeper_model())
    state = OkTopkState(algorithm="oktopk", density=0.05, warmup_iters=steps)
    a.register_comm_hook(state, oktopk_hook)
    b.register_comm_hook(None, allreduce_hook)
    oa, ob = _sgd(a, nesterov, 0.0, weight_decay), _sgd(b, nesterov, 0.0, weight_decay)
    corr, worked = state._momentum, []
    before = corr.before

    def counting(params, members, tensor):
        worked.append(state.iter)
        return before(params, members, tensor)

    corr.before = counting
    same = []
    for step in range(steps):
        _step_both(rank, step, (a, oa), (b, ob))
        same.append(all(torch.equal(pa, pb) and torch.equal(oa.state[pa]["momentum_buffer"], ob.state[pb]["momentum_buffer"])
                        for pa, pb in zip(a.parameters(), b.parameters())))
    write(out, rank, {"same": same, "worked_at": sorted(set(worked)), "active": corr.active})
    state.close()
    dist.destroy_process_group()


def density_one(rank, world, port, out, nesterov, dampening, weight_decay, steps):
    """The corrected hook at density 1 beside plain DDP, the same SGD: the
    parameters and the optimizers' momentum buffers after every step."""
    setup(rank, world, port)
    a, b = DDP(deeper_model()), DDP(deeper_model())
    state = OkTopkState(algorithm="oktopk", density=1.0, warmup_iters=2)
    a.register_comm_hook(state, oktopk_hook)
    b.register_comm_hook(None, allreduce_hook)
    oa, ob = _sgd(a, nesterov, dampening, weight_decay), _sgd(b, nesterov, dampening, weight_decay)
    worst_param = worst_buffer = 0.0
    for step in range(steps):
        _step_both(rank, step, (a, oa), (b, ob))
        for pa, pb in zip(a.parameters(), b.parameters()):
            scale = pb.detach().abs().max().item() + 1e-30
            worst_param = max(worst_param, (pa.detach() - pb.detach()).abs().max().item() / scale)
            ba, bb = oa.state[pa]["momentum_buffer"], ob.state[pb]["momentum_buffer"]
            worst_buffer = max(worst_buffer, (ba - bb).abs().max().item() / (bb.abs().max().item() + 1e-30))
    # B kept as a view of the optimizer's own buffer (sharing its memory), or as a copy of the correction's.
    index = state._layout.param_index
    views = sum(state._momentum.applied[index[id(p)]].data_ptr() == oa.state[p]["momentum_buffer"].data_ptr()
                for p in a.parameters())
    write(out, rank, {"worst_param": worst_param, "worst_buffer": worst_buffer, "corrected": len(state._momentum.velocity),
                      "params": len(list(a.parameters())), "sparse_iters": state.iter - state.warmup_iters,
                      "b_views": views})
    state.close()
    dist.destroy_process_group()


def clipped(rank, world, port, out, how, nesterov, dampening, weight_decay, steps, masking="auto"):
    """The corrected hook at density 1 beside plain DDP, the same SGD, each
    clipping after backward as a framework does (``how``: "norm",
    clip_grad_norm_ to 0.05, which bites at every step; "value",
    clip_grad_value_). The parameters and momentum buffers' worst distance
    from plain DDP's, how many steps the clip bit, and whether the
    correction stopped."""
    setup(rank, world, port)
    a, b = DDP(deeper_model()), DDP(deeper_model())
    state = OkTopkState(algorithm="oktopk", density=1.0, warmup_iters=2, momentum_masking=masking)
    a.register_comm_hook(state, oktopk_hook)
    b.register_comm_hook(None, allreduce_hook)
    oa, ob = _sgd(a, nesterov, dampening, weight_decay), _sgd(b, nesterov, dampening, weight_decay)
    worst_param = worst_buffer = 0.0
    bit = 0
    for step in range(steps):
        x, y = batch(rank, step)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            if how == "norm":
                bit += float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)) > 0.05 and m is b
            else:
                torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3)
            o.step()
        for pa, pb in zip(a.parameters(), b.parameters()):
            worst_param = max(worst_param, (pa.detach() - pb.detach()).abs().max().item() / (pb.detach().abs().max().item() + 1e-30))
            ba, bb = oa.state[pa]["momentum_buffer"], ob.state[pb]["momentum_buffer"]
            worst_buffer = max(worst_buffer, (ba - bb).abs().max().item() / (bb.abs().max().item() + 1e-30))
    write(out, rank, {"worst_param": worst_param, "worst_buffer": worst_buffer, "bit": bit, "stopped": state._momentum.stopped,
                      "status": state.momentum_status,
                      "corrected": len(state._momentum.velocity), "params": [p.detach().clone() for p in a.parameters()]})
    state.close()
    dist.destroy_process_group()


def recording(state):
    """Wrap the state's correction so that every corrected slot's input to
    the reduction (the velocity's step) and result (the average S) are
    summed per canonical parameter index, in float64."""
    corr = state._momentum
    given, averaged = {}, {}
    before, after = corr.before, corr.after

    def record(into, tensor, work):
        for i, a, b, *_ in work:
            into[i] = into.get(i, 0) + tensor[a:b].double()

    def before_(params, members, tensor):
        work = before(params, members, tensor)
        if work:
            record(given, tensor, work)
        return work

    def after_(work, result):
        record(averaged, result, work)
        return after(work, result)

    corr.before, corr.after = before_, after_
    return given, averaged


def mass(rank, world, port, out, steps, nesterov):
    """At density 0.05: what the ranks put into the reduction (their
    velocities' steps) summed, against P x the averages plus the
    residuals left: nothing a velocity gave may vanish."""
    setup(rank, world, port)
    model = DDP(deeper_model())
    state = OkTopkState(algorithm="oktopk", density=0.05, warmup_iters=2)
    model.register_comm_hook(state, oktopk_hook)
    opt = _sgd(model, nesterov, 0.0, 0.0)
    given, averaged = recording(state)
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    residual = residuals_by_parameter(state, model.module)
    index = {n: state._layout.param_index[id(p)] for n, p in model.module.named_parameters()}
    write(out, rank, {"given": {n: given[i] for n, i in index.items()}, "averaged": {n: averaged[i] for n, i in index.items()},
                      "residual": {n: residual[n].reshape(-1).double() for n in index},
                      "params": [p.detach().clone() for p in model.parameters()]})
    state.close()
    dist.destroy_process_group()


def non_finite(rank, world, port, out, bad_rank, bad_step, steps, scaler):
    """Rank bad_rank puts a NaN into one gradient entry at step bad_step;
    the script skips the optimizer step when a gradient is not finite (with
    ``scaler``: GradScaler does, and its unscale_ changes the gradient the
    hook handed over, which stops the correction). The correction's
    velocities and B before and after that step, on every rank."""
    setup(rank, world, port)
    model = DDP(deeper_model())
    state = OkTopkState(algorithm="oktopk", density=0.05, warmup_iters=2)
    model.register_comm_hook(state, oktopk_hook)
    opt = _sgd(model, False, 0.0, 0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
    current = {"step": -1}

    def inject(grad):
        if rank == bad_rank and current["step"] == bad_step:
            grad = grad.clone()
            grad.view(-1)[3] = float("nan")
        return grad

    model.module[0].weight.register_hook(inject)

    def snapshot():
        corr = state._momentum
        return ({i: v.clone() for i, v in corr.velocity.items()}, {i: a.clone() for i, a in corr.applied.items() if a is not None},
                [p.detach().clone() for p in model.parameters()], {n: r.clone() for n, r in residuals_by_parameter(state, model.module).items()})

    kept, finite_after = None, []
    for step in range(steps):
        current["step"] = step
        if step == bad_step:
            before = snapshot()
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if all(torch.isfinite(p.grad).all().item() for p in model.parameters()):
                opt.step()
        if step == bad_step:
            after = snapshot()
            kept = {
                "velocity": before[0].keys() == after[0].keys() and all(torch.equal(before[0][i], after[0][i]) for i in before[0]),
                "applied": before[1].keys() == after[1].keys() and all(torch.equal(before[1][i], after[1][i]) for i in before[1]),
                "params": all(torch.equal(a, b) for a, b in zip(before[2], after[2])),
                "residual": all(torch.equal(before[3][n], after[3][n]) for n in before[3]),
                "velocities": len(before[0]),
            }
        finite_after.append(all(torch.isfinite(p).all().item() for p in model.parameters()))
    write(out, rank, {"kept": kept, "finite": finite_after, "params": [p.detach().clone() for p in model.parameters()],
                      "stopped": state._momentum.stopped})
    state.close()
    dist.destroy_process_group()


def density_one_across_switches(rank, world, port, out, weight_decay, steps=44):
    """The default hook (the measured choice, recheck_every 8) at density 1
    beside plain DDP, the same SGD with momentum, its clock injected so that
    sparse steps are the faster until step 14, the slower until step 30,
    then the faster again: sparse steps, then native ones with nothing held
    (the correction idle, following the optimizer's buffer), then sparse
    again. Per step: the path and whether the correction was idle; per
    idle step, whether every velocity was the optimizer's buffer; the worst
    relative difference of the parameters and momentum buffers from
    plain DDP's over the run."""
    from workers import InjectedClock

    setup(rank, world, port)
    a, b = DDP(deeper_model()), DDP(deeper_model())
    state = OkTopkState(density=1.0, warmup_iters=2, sparse_after=0, recheck_every=8)
    clock = InjectedClock()
    state._choice.clock = clock
    a.register_comm_hook(state, oktopk_hook)
    b.register_comm_hook(None, allreduce_hook)
    oa, ob = _sgd(a, False, 0.0, weight_decay), _sgd(b, False, 0.0, weight_decay)
    paths, idle, following, path = [], [], [], "native"
    worst_param = worst_buffer = 0.0
    for step in range(steps):
        fast_sparse = step < 14 or step >= 30
        clock.now += {"native": 0.040, "sparse": 0.010 if fast_sparse else 0.100}.get(path, 0.040)
        _step_both(rank, step, (a, oa), (b, ob))
        path = state._path if step >= state.warmup_iters else "native"
        paths.append(path)
        c = state._momentum
        idle.append(bool(c.idle) if c is not None and c.active else None)
        if idle[-1]:
            # An idle step leaves every velocity a view of the optimizer's
            # buffer, which the next corrected step restarts from.
            index = state._layout.param_index
            following.append(all(c.velocity[index[id(p)]].data_ptr() == oa.state[p]["momentum_buffer"].data_ptr()
                                 for p in a.parameters()))
        for pa, pb in zip(a.parameters(), b.parameters()):
            scale = pb.detach().abs().max().item() + 1e-30
            worst_param = max(worst_param, (pa.detach() - pb.detach()).abs().max().item() / scale)
            ba, bb = oa.state[pa]["momentum_buffer"], ob.state[pb]["momentum_buffer"]
            worst_buffer = max(worst_buffer, (ba - bb).abs().max().item() / (bb.abs().max().item() + 1e-30))
    write(out, rank, {"paths": paths, "idle": idle, "following": following, "worst_param": worst_param, "worst_buffer": worst_buffer,
                      "params": [p.detach().clone() for p in a.parameters()]})
    state.close()
    dist.destroy_process_group()
