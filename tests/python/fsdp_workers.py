"""Rank functions for the FSDP2 (HSDP) and pipeline tests, started by
torch.multiprocessing in fresh (spawned) processes on a 2 x 2 mesh of 4 CPU
ranks over gloo. Each writes what the test checks to a file."""

import contextlib
import importlib
import io
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from workers import setup, write  # noqa: F401 - also sets sys.path for oktopk

import oktopk.fsdp  # noqa: E402
from oktopk import OkTopkState, oktopk_hook  # noqa: E402


class Stack(nn.Module):
    """Three linear layers, each its own FSDP2 module, and a root that holds
    a parameter of its own."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(24, 48), nn.Linear(48, 48), nn.Linear(48, 6)])
        self.scale = nn.Parameter(torch.ones(6))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x * self.scale


def batch(rank, step):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(16, 24, generator=g), torch.randint(0, 6, (16,), generator=g)


def mesh_2x2():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def sharded_stack(mesh, sparse):
    """Stack sharded with FSDP2: over the whole 2-D mesh (native HSDP) when
    dense, over the shard dimension only when oktopk takes the replicas."""
    torch.manual_seed(0)
    model = Stack()
    on = mesh["shard"] if sparse else mesh
    for layer in model.layers:
        fully_shard(layer, mesh=on)
    fully_shard(model, mesh=on)
    return model


def local_shards(model):
    """This rank's shard of every parameter, by name."""
    return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}


def step(model, opt, rank, s):
    x, y = batch(rank, s)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def density_one(rank, world, port, out, steps, momentum=None):
    """Native HSDP, and oktopk at density 1 (k = n) over the replicas: each
    rank's parameter shards after ``steps`` SGD steps. ``momentum``: SGD's
    (momentum, nesterov, dampening, weight_decay), the hook's momentum
    correction on; also each rank's momentum buffers, and how many
    parameters the correction took."""
    setup(rank, world, port)
    mesh = mesh_2x2()
    result = {}
    m, nesterov, dampening, weight_decay = momentum or (0.0, False, 0.0, 0.0)
    for mode in ("native", "sparse"):
        model = sharded_stack(mesh, mode == "sparse")
        state = None
        corrected_shards = []
        if mode == "sparse":
            state = OkTopkState(process_group=mesh.get_group("replicate"), density=1.0, algorithm="oktopk")
            oktopk.fsdp.register(model, state)
            before = state._momentum.before

            def counting(*args):
                work = before(*args)
                corrected_shards.append(work is not None)
                return work

            state._momentum.before = counting
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=m, nesterov=nesterov, dampening=dampening,
                              weight_decay=weight_decay)
        for s in range(steps):
            step(model, opt, rank, s)
        result[mode] = {k: v.numpy() for k, v in local_shards(model).items()}
        if m:
            result[mode, "buffers"] = {name: opt.state[p]["momentum_buffer"].to_local().clone().numpy()
                                       for name, p in model.named_parameters()}
        if state is not None:
            result["sparse_calls"] = dict(state.algorithm_counts)
            result["params"] = len(list(model.parameters()))
            result["corrected"] = len(state._momentum.velocity) if state._momentum is not None else 0
            result["corrected_shards"] = sum(corrected_shards)
            state.close()
    write(out, rank, result)
    dist.destroy_process_group()


def native_steps_hand_through(rank, world, port, out, steps, nesterov, weight_decay):
    """Native HSDP, and the corrected hook through a native warm-up of
    ``steps`` steps (nothing held in any residual), under the same SGD
    with momentum 0.9: whether the parameter shards and momentum buffers
    are the same bits after every step, and how many shards the correction
    worked on."""
    setup(rank, world, port)
    mesh = mesh_2x2()
    runs = {}
    worked = []
    for mode in ("native", "hook"):
        model = sharded_stack(mesh, mode == "hook")
        state = None
        if mode == "hook":
            state = OkTopkState(process_group=mesh.get_group("replicate"), density=0.05, algorithm="oktopk", warmup_iters=steps)
            oktopk.fsdp.register(model, state)
            before = state._momentum.before

            def counting(*args):
                worked.append(state.iter)
                return before(*args)

            state._momentum.before = counting
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=weight_decay)
        after = []
        for s in range(steps):
            step(model, opt, rank, s)
            after.append(({k: v.clone() for k, v in local_shards(model).items()},
                          {name: opt.state[p]["momentum_buffer"].to_local().clone() for name, p in model.named_parameters()}))
        runs[mode] = after
        if state is not None:
            active = state._momentum.active
            state.close()
    same = [all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
            for a, b in zip(runs["native"], runs["hook"])]
    write(out, rank, {"same": same, "worked_at": sorted(set(worked)), "active": active})
    dist.destroy_process_group()


def mass(rank, world, port, out, algorithm, steps, device_path=None):
    """oktopk over the replicas at density 5%: per FSDP2 module and step
    after the warm-up, the shard given to the hook and the one it returned;
    the final residuals; the final parameter shards. With algorithm None
    (the measured choice) the step clock is injected so that the run takes
    both paths: native, then sparse, then native again after a recheck."""
    setup(rank, world, port)
    mesh = mesh_2x2()
    model = sharded_stack(mesh, True)
    state = OkTopkState(process_group=mesh.get_group("replicate"), density=0.05, algorithm=algorithm, recheck_every=8, device_path=device_path)
    if algorithm is None:
        from workers import InjectedClock

        clock = InjectedClock()
        state._choice.clock = clock
    registration = oktopk.fsdp.register(model, state)
    given, returned = {}, {}
    for number, (module, group) in enumerate(registration.modules):
        hook = group._all_reduce_hook

        def recording(shard, hook=hook, number=number):
            before = shard.detach().clone()
            hook(shard)
            if state.iter - 1 >= state.warmup_iters:  # the step under way (its first shard advanced iter)
                given.setdefault(number, []).append(before)
                returned.setdefault(number, []).append(shard.detach().clone())

        module.set_all_reduce_hook(recording)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    paths = []
    for s in range(steps):
        step(model, opt, rank, s)
        if algorithm is None:
            paths.append(state._path)
            # Sparse steps cost 5 ms, native ones 20 ms, until step 14; then
            # sparse turns slow (30 ms) and a recheck goes back to native.
            clock.now += 0.005 if state._path == "sparse" and s < 14 else 0.030 if state._path == "sparse" else 0.020
    sd = state.state_dict()
    residuals = {}
    for number in range(len(registration.modules)):
        group_id = oktopk.fsdp.group_id(number)
        blob = sd["tensors"].get(group_id)
        if blob is None:
            residuals[number] = None
            continue
        n = int.from_bytes(blob[8:16], "little")
        residuals[number] = torch.frombuffer(bytearray(blob[len(blob) - 4 * n :]), dtype=torch.float32).clone().numpy()
    write(out, rank, {
        "given": {k: torch.stack(v).sum(0).double().numpy() for k, v in given.items()},
        "returned": {k: torch.stack(v).sum(0).double().numpy() for k, v in returned.items()},
        "residual": residuals,
        "shards": {k: v.numpy() for k, v in local_shards(model).items()},
        "paths": paths,
        "choice": state.choice,
        "counts": dict(state.algorithm_counts),
    })
    state.close()
    dist.destroy_process_group()


def checkpoint(rank, world, port, out, ckpt, steps, cut):
    """oktopk (density 5%) over the replicas with SGD momentum: the final
    shards of ``steps`` steps straight, and of ``cut`` steps, a
    torch.distributed.checkpoint save of the model, optimizer and oktopk
    state, and a fresh model, optimizer and state that load it and run the
    rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    setup(rank, world, port)
    mesh = mesh_2x2()

    def fresh():
        model = sharded_stack(mesh, True)
        state = OkTopkState(process_group=mesh.get_group("replicate"), density=0.05, algorithm="oktopk")
        oktopk.fsdp.register(model, state)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), state

    model, opt, state = fresh()
    for s in range(steps):
        step(model, opt, rank, s)
    straight = local_shards(model)
    state.close()

    model, opt, state = fresh()
    for s in range(cut):
        step(model, opt, rank, s)
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd, "oktopk": oktopk.fsdp.checkpoint_state(state)}, checkpoint_id=ckpt)
    state.close()

    model, opt, state = fresh()
    model_sd, opt_sd = get_state_dict(model, opt)
    saved = {"model": model_sd, "optim": opt_sd, "oktopk": oktopk.fsdp.checkpoint_state(state)}
    dcp.load(saved, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
    resumed_iter = state.iter
    for s in range(cut, steps):
        step(model, opt, rank, s)
    write(out, rank, {
        "straight": {k: v.numpy() for k, v in straight.items()},
        "resumed": {k: v.numpy() for k, v in local_shards(model).items()},
        "resumed_iter": resumed_iter,
    })
    state.close()
    dist.destroy_process_group()


def two_communicators(rank, world, port, out, steps):
    """Two DDP models in each process, one per group: A over the ranks
    {0, 1} and {2, 3}, B over {0, 2} and {1, 3}, each with its own
    OkTopkState and so its own communicator, stepped in turn. At density 1
    each must equal its group's plain allreduce; at 10% each group's members
    must agree bitwise."""
    setup(rank, world, port)
    groups_a = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups_b = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group_a, group_b = groups_a[rank // 2], groups_b[rank % 2]
    result = {}
    for density in (1.0, 0.1):
        models = {}
        for name, group in (("a", group_a), ("b", group_b)):
            for mode in ("plain", "oktopk"):
                torch.manual_seed(1 if name == "a" else 2)
                m = DDP(nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 6)), process_group=group)
                state = None
                if mode == "oktopk":
                    state = OkTopkState(process_group=group, density=density, algorithm="oktopk")
                    m.register_comm_hook(state, oktopk_hook)
                models[name, mode] = (m, torch.optim.SGD(m.parameters(), lr=0.1), state)
        for s in range(steps):
            for key in (("a", "oktopk"), ("b", "oktopk"), ("a", "plain"), ("b", "plain")):
                m, opt, _ = models[key]
                x, y = batch(rank, s)
                opt.zero_grad()
                F.cross_entropy(m(x), y).backward()
                opt.step()
        for key, (m, _, state) in models.items():
            result[density, *key] = {n: p.detach().numpy().copy() for n, p in m.module.named_parameters()}
            if state is not None:
                result[density, *key, "calls"] = dict(state.algorithm_counts)
                state.close()
    write(out, rank, result)
    dist.destroy_process_group()


def refusals(rank, world, port, out):
    """What register refuses, and the message of each refusal."""
    setup(rank, world, port)
    mesh = mesh_2x2()
    messages = {}
    native = sharded_stack(mesh, False)
    for name, model, group in (
        ("native_hsdp", native, mesh.get_group("replicate")),
        ("world_group", sharded_stack(mesh, True), None),
        ("not_sharded", Stack(), mesh.get_group("replicate")),
    ):
        try:
            oktopk.fsdp.register(model, OkTopkState(process_group=group))
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    model = sharded_stack(mesh, True)
    oktopk.fsdp.register(model, OkTopkState(process_group=mesh.get_group("replicate")))
    try:
        oktopk.fsdp.register(model, OkTopkState(process_group=mesh.get_group("replicate")))
        messages["twice"] = None
    except ValueError as e:
        messages["twice"] = str(e)
    write(out, rank, messages)
    dist.destroy_process_group()


def tensor_parallel(rank, world, port, out, steps):
    """A tensor-parallel MLP (column- then row-wise over a "tp" dimension of
    2) replicated over 2 replicas with FSDP2 (shard dimension of 1): FSDP2's
    own all-reduce, and oktopk at density 1 over the replicas. Each rank's
    local parameter shards after ``steps`` SGD steps; and what DDP says when
    asked to wrap the tensor-parallel model."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    setup(rank, world, port)
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 6))
        return parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})

    result = {}
    for mode in ("native", "sparse"):
        model = build()
        fully_shard(model, mesh=mesh["shard"] if mode == "sparse" else mesh["replicate", "shard"])
        state = None
        if mode == "sparse":
            state = OkTopkState(process_group=mesh.get_group("replicate"), density=1.0, algorithm="oktopk")
            oktopk.fsdp.register(model, state)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for s in range(steps):
            step(model, opt, rank // 2, s)  # the two tensor-parallel ranks of a replica see the same batch
        result[mode] = {k: v.numpy() for k, v in local_shards(model).items()}
        if state is not None:
            result["sparse_calls"] = dict(state.algorithm_counts)
            state.close()
    try:
        DDP(build(), process_group=mesh.get_group("replicate"))
        result["ddp"] = None
    except Exception as e:  # noqa: BLE001 - what torch says is the finding
        result["ddp"] = f"{type(e).__name__}: {e}"
    write(out, rank, result)
    dist.destroy_process_group()


def adaptive(rank, world, port, out, steps):
    """oktopk over the replicas with adaptive density (ξ measured every 2
    steps): each step's density and τ′, and the final shards."""
    setup(rank, world, port)
    mesh = mesh_2x2()
    model = sharded_stack(mesh, True)
    state = OkTopkState(process_group=mesh.get_group("replicate"), density=0.02, algorithm="oktopk", adaptive=(0.01, 0.5),
                        measure_xi_every=2)
    oktopk.fsdp.register(model, state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    densities = []
    for s in range(steps):
        step(model, opt, rank, s)
        densities.append((state.last_density, state.last_tau_prime))
    write(out, rank, {"densities": densities, "xi": state.last_xi, "shards": {k: v.numpy() for k, v in local_shards(model).items()}})
    state.close()
    dist.destroy_process_group()


def adam_default(rank, world, port, out, steps, dense_compression):
    """The default state (with ``dense_compression``) on FSDP2 replicas
    stepped by Adam, its clock injected so that a compressed step costs
    40 ms and a native one 30: the
    path of every step, each replicate allreduce's shard before and after
    it (to check it against the other replica's), the choice and the
    library calls after ``steps`` steps, and the shards, next to native HSDP
    under Adam."""
    import oktopk.paths
    from workers import InjectedClock

    setup(rank, world, port)
    mesh = mesh_2x2()
    result = {"reduced": []}
    for path in ("native", "bf16", "quantized"):
        way = oktopk.paths.PATHS[path]  # the engine's shard reductions (reduce_shard), by path

        def recorded(engine, group_id, shard, step, reduce=way.reduce_shard, path=path):
            before = shard.clone()
            reduce(engine, group_id, shard, step)
            result["reduced"].append((path, before.numpy(), shard.clone().numpy()))

        way.reduce_shard = recorded
    for mode in ("native", "sparse"):
        model = sharded_stack(mesh, mode == "sparse")
        state = None
        if mode == "sparse":
            state = OkTopkState(process_group=mesh.get_group("replicate"), density=0.05, recheck_every=8, dense_compression=dense_compression)
            state._choice.clock = clock = InjectedClock()
            oktopk.fsdp.register(model, state)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        paths = []
        for s in range(steps):
            if state is not None:
                clock.now += 0.040 if state._path == dense_compression and s > state.warmup_iters else 0.030  # the step before
            step(model, opt, rank, s)
            if state is not None:
                paths.append(state._path if s >= state.warmup_iters else "warm-up")
        result[mode] = {k: v.numpy() for k, v in local_shards(model).items()}
        if state is not None:
            result["choice"], result["calls"], result["paths"] = state.choice, dict(state.algorithm_counts), paths
            state.close()
    write(out, rank, result)
    dist.destroy_process_group()


def demo_hsdp(rank, world, port, out, steps):
    """oktopk.optim.DeMo across the replicas of FSDP2 shards, then the same
    arithmetic on plain tensors: DeMo over copies of this rank's starting
    shards, fed the shard gradients the sharded run saw, over the same
    replicate group. What each rank needs to check that a sharded step is
    DeMo's step of its local shards."""
    import oktopk.optim

    setup(rank, world, port)
    mesh = mesh_2x2()
    replicas = mesh.get_group("replicate")
    model = sharded_stack(mesh, True)
    start = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
    refusals = {}
    try:
        oktopk.optim.DeMo(model.parameters(), lr=0.01)
    except ValueError as e:
        refusals["no_group"] = str(e)
    opt = oktopk.optim.DeMo(model.parameters(), lr=0.01, weight_decay=0.1, topk=8, process_group=replicas)
    grads = []
    for s in range(steps):
        x, y = batch(rank, s)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads.append({name: p.grad.to_local().detach().clone() for name, p in model.named_parameters()})
        opt.step()
    sharded = local_shards(model)
    sent = opt.bytes_sent
    opt.close()
    plain = {name: nn.Parameter(t.clone()) for name, t in start.items()}
    ref = oktopk.optim.DeMo(list(plain.values()), lr=0.01, weight_decay=0.1, topk=8, process_group=replicas)
    for s in range(steps):
        for name, p in plain.items():
            p.grad = grads[s][name].clone()
        ref.step()
    ref.close()
    write(out, rank, {"sharded": {k: v.numpy() for k, v in sharded.items()},
                      "plain": {k: p.detach().numpy().copy() for k, p in plain.items()},
                      "start": {k: v.numpy() for k, v in start.items()},
                      "grad0": {k: v.numpy() for k, v in grads[0].items()},
                      "bytes": sent, "refusals": refusals})
    dist.destroy_process_group()


def nan_one_module(rank, world, port, out, steps, bad_step, optimizer, poisoned_ranks=(0, 1)):
    """A NaN in one FSDP2 module's gradient shard on ``poisoned_ranks`` (0
    and 1: one rank of each replicate group; 0 alone: one replicate group
    only, since a replicate group sees only its own shards) at
    ``bad_step``, put there just before the module's hook, the other
    modules' shards finite: the sparse path under SGD (algorithm "oktopk"), the quantized
    path under AdamW (the measured choice, its clock injected so that
    quantized is a clear win). A step whose gradient is not finite on some
    rank is skipped on every rank, as AMP's scaler skips it. Per step: its
    path, whether it was finite, and the state's checkpoint of residuals
    (library tensors, quantized groups) after it; and the final shards."""
    from workers import InjectedClock

    setup(rank, world, port)
    mesh = mesh_2x2()
    model = sharded_stack(mesh, True)
    group = mesh.get_group("replicate")
    if optimizer in ("SGD", "SGD momentum"):  # the latter with the momentum correction's velocities
        state = OkTopkState(process_group=group, density=0.05, algorithm="oktopk")
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9 if optimizer == "SGD momentum" else 0.0)
    else:
        state = OkTopkState(process_group=group, density=0.05, dense_compression="quantized", recheck_every=8)
        state._choice.clock = clock = InjectedClock()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    registration = oktopk.fsdp.register(model, state)
    current = {"step": -1}
    hook = registration.modules[0][1]._all_reduce_hook

    def poisoned(shard):
        if rank in poisoned_ranks and current["step"] == bad_step:
            shard.view(-1)[0] = float("nan")
        hook(shard)

    registration.modules[0][0].set_all_reduce_hook(poisoned)
    steps_out = []
    for s in range(steps):
        current["step"] = s
        if optimizer == "AdamW":
            clock.now += 0.010 if state._path == "quantized" and s > state.warmup_iters else 0.030  # the step before
        x, y = batch(rank, s)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        bad = torch.tensor([0.0 if all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters()) else 1.0])
        dist.all_reduce(bad)  # as AMP's scaler: skipped on every rank when any rank's gradient is not finite
        if bad.item() == 0:
            opt.step()
        saved = state.state_dict()
        steps_out.append({"path": state._path if s >= state.warmup_iters else "warm-up", "finite": bad.item() == 0,
                          "tensors": saved["tensors"], "residual_groups": saved["residual_groups"],
                          "velocities": {i: (e["velocity"].numpy().tobytes(), e["applied"].numpy().tobytes())
                                         for i, e in saved["momentum"].items() if e["velocity"] is not None},
                          "quantized": {k: (v["residual"].numpy().tobytes(), v["owner_residual"].numpy().tobytes())
                                        for k, v in saved["quantized"].items()}})
    write(out, rank, {"steps": steps_out, "modules": len(registration.modules),
                      "shards": {k: v.numpy() for k, v in local_shards(model).items()}})
    state.close()
    dist.destroy_process_group()


def compressed_warmup(rank, world, port, out, steps):
    """Native HSDP, and oktopk at density 1 over the replicas with
    ``warmup_iters=5, warmup_compression="quantized"``, under SGD at learning
    rate 0 (both see the same gradients every step): each step's reduced
    gradient shards, and the modules holding a quantized residual after
    it."""
    setup(rank, world, port)
    mesh = mesh_2x2()
    result = {}
    for mode in ("native", "sparse"):
        model = sharded_stack(mesh, mode == "sparse")
        state = None
        if mode == "sparse":
            state = OkTopkState(process_group=mesh.get_group("replicate"), density=1.0, algorithm="oktopk", warmup_iters=5,
                                warmup_compression="quantized", momentum_correction=False)
            oktopk.fsdp.register(model, state)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        grads, held = [], []
        for s in range(steps):
            x, y = batch(rank, s)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads.append(torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()]).clone())
            held.append(None if state is None else len(state._quantized))
            opt.step()
        result[mode] = {"grads": grads, "held": held}
        if state is not None:
            state.close()
    write(out, rank, result)
    dist.destroy_process_group()


def example(rank, world, port, out, name, argv):
    """examples/pytorch/NAME.py's own ``main(argv)`` in this rank, started
    as torchrun starts a rank (its environment variables), and what it
    printed. Forked from the test server, which imported torch once: two
    torchrun jobs of 4 ranks cost ten fresh interpreters (about 2.5 s of
    CPU each) for the same run."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        importlib.import_module(name).main(list(argv))
    write(out, rank, printed.getvalue())
