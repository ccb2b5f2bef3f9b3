"""Rank programs for the Horovod tests, started by `horovodrun --gloo`:
``python workers.py <name> <outdir> [args...]``. Each rank writes what it
saw to <outdir>/rank<r>.pkl for the test to check."""

import contextlib
import hashlib
import os
import pickle
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
for sub in ("plugins/pytorch", "plugins/horovod", "examples/horovod"):
    sys.path.insert(0, os.path.join(ROOT, sub))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import oktopk_horovod  # noqa: E402


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def small_model():
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 5))


def density_one(out, steps="5", bucket_bytes=str(oktopk_horovod.optimizer.BUCKET_BYTES)):
    """With density 1.0 the sparse average must equal Horovod's dense
    average of the same gradients (another summation order: float32
    rounding only). Models start from different seeds per rank, so this also
    checks that hvd.broadcast_parameters still works with our optimizer.
    With bucket_bytes=1 every parameter is a bucket of its own, reduced in
    place in its gradient; by default all share one, gathered into the
    optimizer's staging memory."""
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(100 + hvd.rank())
    model = small_model()
    reference = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # parameters never move: the same model every step
    opt = oktopk_horovod.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=oktopk_horovod.Compression.oktopk(algorithm="oktopk", density=1.0),
                                              bucket_bytes=int(bucket_bytes))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    reference.load_state_dict(model.state_dict())
    after_broadcast = hvd.allgather_object(digest(model))
    worst, grads_digests = 0.0, []
    horovod_reductions = 0
    for step in range(int(steps)):
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())
        x, y = torch.randn(32, 20, generator=g), torch.randint(0, 5, (32,), generator=g)
        opt.zero_grad()
        with counting_horovod_reductions() as count:
            F.cross_entropy(model(x), y).backward()
            opt.synchronize()
        horovod_reductions += count[0]
        reference.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            want = hvd.allreduce(q.grad, op=hvd.Average, name=f"ref.{step}.{name}")
            scale = want.abs().max().item() or 1.0
            worst = max(worst, (p.grad - want).abs().max().item() / scale)
        grads_digests.append(hashlib.sha256(b"".join(p.grad.numpy().tobytes() for p in model.parameters())).hexdigest())
        with opt.skip_synchronize():
            opt.step()
    result = {
        "worst_relative_diff": worst,
        "after_broadcast": after_broadcast,
        "grad_digests": grads_digests,
        "bytes_sent": opt.bytes_sent,
        "horovod_reductions": horovod_reductions,
        "endpoint": opt.engine.communicator.endpoint,  # what this rank advertised, tcp://host:port
    }
    opt.close()
    return result


def auto_counts(out, steps="6"):
    """algorithm="auto" over buckets of 5 to 1,280 parameters: what the
    optimizer counted per algorithm, and the model after training."""
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = oktopk_horovod.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), bucket_bytes=4096,
        compression=oktopk_horovod.Compression.oktopk(density=0.05, algorithm="auto"))
    for step in range(int(steps)):
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())
        x, y = torch.randn(32, 20, generator=g), torch.randint(0, 5, (32,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    result = {"counts": dict(opt.algorithm_counts), "buckets": len(opt._buckets), "digest": digest(model),
              "algorithms": list(oktopk_horovod.ALGORITHMS)}
    opt.close()
    return result


@contextlib.contextmanager
def counting_horovod_reductions():
    """Counts every call into Horovod's own reductions (the entry points
    hvd.DistributedOptimizer uses) while the block runs: ``count[0]`` all of
    them, ``count["allgather"]`` the gathers called as hvd.allgather (each
    also counts its inner allgather_async)."""
    import horovod.torch.mpi_ops as mpi_ops
    import horovod.torch.optimizer as hvd_optimizer

    count = {0: 0, "allgather": 0}
    names = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather", "allgather_async", "sparse_allreduce_async"]
    saved = []
    for module in (hvd, mpi_ops, hvd_optimizer):
        for name in names:
            if hasattr(module, name):
                original = getattr(module, name)

                def counted(*a, _original=original, _name=name, _module=module, **k):
                    count[0] += 1
                    if _name == "allgather" and _module is hvd:
                        count["allgather"] += 1
                    return _original(*a, **k)

                saved.append((module, name, original))
                setattr(module, name, counted)
    try:
        yield count
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def nan_on_one_rank(out):
    """A NaN in one rank's gradient of one bucket (of several) at step 2
    makes every rank's reduced gradient non-finite at that step only; the
    steps after it are finite and the ranks stay identical. The state's
    checkpoint of residuals before and after the skipped step."""
    hvd.init()
    torch.manual_seed(3)
    model = small_model()
    opt = oktopk_horovod.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), compression=oktopk_horovod.Compression.oktopk(algorithm="oktopk", density=0.05),
                                              bucket_bytes=4096)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    finite, tensors = [], {}
    for step in range(5):
        if step in (2, 3):
            tensors[step] = opt.oktopk_state_dict()["tensors"]  # after steps 1 and 2
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())
        x, y = torch.randn(32, 20, generator=g), torch.randint(0, 5, (32,), generator=g)
        opt.zero_grad()
        handle = None
        if step == 2 and hvd.rank() == 1:
            # Into the gradient before it is accumulated (and reduced, which
            # starts during backward).
            handle = model[0].weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), float("nan")))
        F.cross_entropy(model(x), y).backward()
        if handle is not None:
            handle.remove()
        opt.synchronize()
        ok = all(torch.isfinite(p.grad).all().item() for p in model.parameters())
        finite.append(ok)
        if ok:  # skip the step as GradScaler would
            with opt.skip_synchronize():
                opt.step()
    result = {"finite": finite, "params": digest(model), "buckets": len(opt._buckets),
              "unchanged": tensors[2] == tensors[3], "held": len(tensors[2]),
              "steps_counted": opt.oktopk_state_dict()["step"]}
    opt.close()
    return result


def sparse_embedding(out):
    """nn.Embedding(sparse=True): with sparse_as_dense=True its gradient is
    reduced densely (equal on every rank and to the dense average); without
    it the step fails with a message naming the option."""
    hvd.init()
    torch.manual_seed(5)
    result = {}
    for sparse_as_dense in (True, False):
        model = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Flatten(), nn.Linear(24, 3))
        opt = oktopk_horovod.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            compression=oktopk_horovod.Compression.oktopk(algorithm="oktopk", density=1.0),
            sparse_as_dense=sparse_as_dense,
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        g = torch.Generator().manual_seed(hvd.rank())
        x, y = torch.randint(0, 50, (16, 3), generator=g), torch.randint(0, 3, (16,), generator=g)
        local = torch.autograd.grad(F.cross_entropy(model(x), y), model[0].weight)[0].to_dense()
        want = hvd.allreduce(local, op=hvd.Average, name=f"ref.embedding.{sparse_as_dense}")
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        try:
            opt.synchronize()
            got = model[0].weight.grad
            result[sparse_as_dense] = {"error": None, "max_diff": (got - want).abs().max().item(), "digest": hashlib.sha256(got.numpy().tobytes()).hexdigest()}
        except ValueError as e:
            result[sparse_as_dense] = {"error": str(e)}
        opt.close()
    return result


def state_of_another_rank_or_size(out, ckpt):
    """With 2 ranks: train 2 steps, save this rank's oktopk state, then load
    the other rank's (refused) and this rank's own (accepted). With 1 rank:
    load rank 0's state of the 2-rank run (refused)."""
    hvd.init()
    torch.manual_seed(3)
    model = small_model()
    opt = oktopk_horovod.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), compression=oktopk_horovod.Compression.oktopk(algorithm="oktopk", density=0.05))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    result = {}
    if hvd.size() == 2:
        for step in range(2):
            g = torch.Generator().manual_seed(1000 * step + hvd.rank())
            x, y = torch.randn(32, 20, generator=g), torch.randint(0, 5, (32,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        own = opt.oktopk_state_dict()
        torch.save(own, os.path.join(ckpt, f"rank{hvd.rank()}.pt"))
        hvd.allgather_object(None, name="saved")  # both files are written
        other = torch.load(os.path.join(ckpt, f"rank{1 - hvd.rank()}.pt"), weights_only=False)
        load = other
    else:
        load = torch.load(os.path.join(ckpt, "rank0.pt"), weights_only=False)
    try:
        opt.load_oktopk_state_dict(load)
        result["error"] = None
    except ValueError as e:
        result["error"] = str(e)
    if hvd.size() == 2:
        opt.load_oktopk_state_dict(own)
    opt.close()
    return result


def train_cnn(out, *args):
    import horovod_cnn

    return horovod_cnn.main(list(args))


def plain_horovod_refuses(out):
    """Our compressor handed to hvd.DistributedOptimizer must fail loudly,
    never allreduce densely."""
    hvd.init()
    model = small_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), compression=oktopk_horovod.Compression.oktopk())
    try:
        F.cross_entropy(model(torch.randn(4, 20)), torch.randint(0, 5, (4,))).backward()
        opt.step()
    except RuntimeError as e:
        return {"error": str(e)}
    return {"error": None}


def train_resumable(path, first, last, compression, record, save=None):
    """Train small_model under oktopk_horovod.DistributedOptimizer with
    compression over steps first..last-1 (from the checkpoint at path when
    first > 0, saving one there after step save-1); record(opt) is kept per
    step. Returns the records, the parameters' digest and the model's size."""
    torch.manual_seed(3)
    model = small_model()
    opt = oktopk_horovod.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named_parameters=model.named_parameters(),
                                              compression=compression)
    if first:
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        opt.load_oktopk_state_dict(saved["oktopk"])
    steps = {}
    for step in range(first, last):
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())
        x, y = torch.randn(32, 20, generator=g), torch.randint(0, 5, (32,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        steps[step] = record(opt)
        if save == step + 1:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "oktopk": opt.oktopk_state_dict()}, path)
    opt.close()
    return {"steps": steps, "params": digest(model), "n": sum(p.numel() for p in model.parameters())}


def density_schedule(out, ckpt):
    """Train 7 steps with Compression.oktopk(density=0.01,
    density_schedule=(0.5, 4), measure_xi_every=2), saving after step 3;
    then resume from that checkpoint with a compressor without a schedule.
    Records per step the density, every bucket's k and the last ξ."""
    hvd.init()
    torch.set_num_threads(1)
    path = os.path.join(ckpt, f"rank{hvd.rank()}.pt")

    def record(opt):
        return (opt.last_density, sorted(opt.last_k.values()), opt.last_xi, opt.last_xi_step)

    full = train_resumable(path, 0, 7, oktopk_horovod.Compression.oktopk(algorithm="oktopk", density=0.01, density_schedule=(0.5, 4), measure_xi_every=2), record, save=3)
    resumed = train_resumable(path, 3, 7, oktopk_horovod.Compression.oktopk(algorithm="oktopk", density=0.01), record)
    return {"full": full, "resumed": resumed}


def adaptive(out, ckpt):
    """Train 8 steps with Compression.oktopk(density=2**-7, tau_prime=8,
    adaptive=(2**-7, 2**-4, 1e-3), measure_xi_every=2), saving after step
    5; then resume from that checkpoint with a compressor without adaptive.
    Records per step the density, τ′, every bucket's k and the adaptation's
    inputs."""
    hvd.init()
    torch.set_num_threads(1)
    path = os.path.join(ckpt, f"rank{hvd.rank()}-adaptive.pt")

    def record(opt):
        c = opt.engine._reducer.adaptive
        return (opt.last_density, opt.last_tau_prime, sorted(opt.last_k.values()), c.adaptations, c.last_inputs)

    compression = oktopk_horovod.Compression.oktopk(algorithm="oktopk", density=2.0**-7, tau_prime=8, adaptive=(2.0**-7, 2.0**-4, 1e-3), measure_xi_every=2)
    full = train_resumable(path, 0, 8, compression, record, save=5)
    resumed = train_resumable(path, 5, 8, oktopk_horovod.Compression.oktopk(algorithm="oktopk", density=2.0**-7, tau_prime=8), record)
    return {"full": full, "resumed": resumed}


def choice_cost(path, step, rank):
    """The injected seconds of a step on a path, with per-rank noise of up to
    1 ms: native 20 ms; sparse 5 ms until step 20, then 16 ms on rank 0 (which
    alone would keep sparse) and 19 ms on rank 1 (which alone would not)."""
    base = 0.020 if path == "native" else (0.005 if step < 20 else (0.019 if rank == 1 else 0.016))
    return base + ((rank * 7919 + step * 104729) % 1000) / 1000 * 0.001


def choice(out, ckpt):
    """Compression.oktopk() with its defaults (recheck_every 8) over 44
    steps, its clock injected with choice_cost: per step, the path and
    whether a communicator existed; the sum
    of this rank's local gradients (a twin model without hooks computes
    them), of the averages applied, and the final residuals; then the run
    resumed from a checkpoint saved after step 29, inside a native probe."""
    import copy

    hvd.init()
    torch.set_num_threads(1)

    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    def train(first, last, save=None):
        torch.manual_seed(3)
        model = small_model()
        opt = oktopk_horovod.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                                                  compression=oktopk_horovod.Compression.oktopk(density=0.05, recheck_every=8))
        clock = Clock()
        opt.engine._choice.clock = clock
        # A fixed period between probes (no back-off), so that the
        # switches and probes land on the steps the test names.
        opt.engine._choice.max_backoff = 1
        if first:
            saved = torch.load(os.path.join(ckpt, f"rank{hvd.rank()}.pt"), weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_oktopk_state_dict(saved["oktopk"])
        local = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
        applied = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
        paths, alive, links = {}, {}, {}
        for step in range(first, last):
            g = torch.Generator().manual_seed(1000 * step + hvd.rank())
            x, y = torch.randn(32, 20, generator=g), torch.randint(0, 5, (32,), generator=g)
            twin = copy.deepcopy(model)
            F.cross_entropy(twin(x), y).backward()
            for acc, p in zip(local, twin.parameters()):
                acc += p.grad
            paths[step] = opt.engine.path
            alive[step] = opt.engine.communicator is not None
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            clock.now += choice_cost(opt.engine.path, step, hvd.rank())
            opt.step()
            links[step] = None if opt.engine.communicator is None else opt.engine.communicator.link()
            for acc, p in zip(applied, model.parameters()):
                acc += p.grad
            if save == step + 1:
                torch.save({"model": model.state_dict(), "oktopk": opt.oktopk_state_dict()}, os.path.join(ckpt, f"rank{hvd.rank()}.pt"))
        state = opt.oktopk_state_dict()
        residual = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
        index = {id(p): i for i, p in enumerate(model.parameters())}
        for bucket in opt._buckets:
            blob = state["tensors"][bucket.tensor_id]
            n = int.from_bytes(blob[8:16], "little")
            flat = torch.frombuffer(bytearray(blob[len(blob) - 4 * n :]), dtype=torch.float32)
            at = 0
            for p in bucket.params:
                residual[index[id(p)]] += flat[at : at + p.numel()].view_as(p)
                at += p.numel()
        result = {"paths": paths, "alive": alive, "links": links, "choice": opt.choice, "local": [t.numpy() for t in local], "applied": [t.numpy() for t in applied],
                  "residual": [t.numpy() for t in residual], "counts": dict(opt.algorithm_counts), "params": digest(model)}
        opt.close()
        return result

    return {"full": train(0, 44, save=30), "resumed": train(30, 44)}


def adam_family(out):
    """Compression.oktopk() under Adam, 12 steps, next to plain Horovod
    under Adam: the paths, the choice, and whether the parameters are equal;
    then a named algorithm under Adam (its warnings)."""
    import warnings

    hvd.init()
    torch.manual_seed(0)
    models = [small_model(), small_model()]
    models[1].load_state_dict(models[0].state_dict())
    ours = oktopk_horovod.DistributedOptimizer(torch.optim.Adam(models[0].parameters(), lr=1e-2), named_parameters=models[0].named_parameters(),
                                               compression=oktopk_horovod.Compression.oktopk(density=0.05))
    plain = hvd.DistributedOptimizer(torch.optim.Adam(models[1].parameters(), lr=1e-2), named_parameters=models[1].named_parameters())
    paths = []
    for step in range(12):
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())
        x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
        paths.append(ours.engine.path)
        if step == 1:  # a checkpoint before any sparse step: no bucket has a state yet
            early = ours.oktopk_state_dict()
        for m, o in zip(models, (ours, plain)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        named = small_model()
        opt = oktopk_horovod.DistributedOptimizer(torch.optim.Adam(named.parameters()), named_parameters=named.named_parameters(),
                                                  compression=oktopk_horovod.Compression.oktopk(algorithm="oktopk"))
    result = {"paths": paths, "choice": ours.choice, "sparse_calls": sum(ours.algorithm_counts.values()),
              "early_checkpoint_tensors": len(early["tensors"]),
              "equal_to_horovod": all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters())),
              "warnings": [str(w.message) for w in caught if "oktopk" in str(w.message)]}
    ours.close()
    opt.close()
    return result


def device_path(out, ckpt):
    """10 steps with float16 values on the staging path and on the device
    path forced on (CPU gradients), each saving after step 5, then the
    device path's checkpoint resumed on the staging path: the parameters'
    digests and the checkpoints' library states."""
    hvd.init()
    torch.set_num_threads(1)

    def compression(on):
        return oktopk_horovod.Compression.oktopk(algorithm="oktopk", density=0.05, tau=3, tau_prime=4, value_dtype="float16", device_path=on)

    paths = {on: os.path.join(ckpt, f"rank{hvd.rank()}-{on}.pt") for on in (False, True)}
    moved = {}

    def record(opt):
        moved["pairs"], moved["bytes"] = opt.host_device_pairs, opt.host_device_bytes

    staging = train_resumable(paths[False], 0, 10, compression(False), lambda opt: None, save=5)
    device = train_resumable(paths[True], 0, 10, compression(True), record, save=5)
    resumed = train_resumable(paths[True], 5, 10, compression(False), lambda opt: None)
    states = [torch.load(paths[on], weights_only=False)["oktopk"]["tensors"] for on in (False, True)]
    return {"digests": [staging["params"], device["params"], resumed["params"]], "same_checkpoint": states[0] == states[1] and len(states[0]) > 0,
            **moved}


def demo(out, steps="5"):
    """oktopk_horovod.DeMo on a model whose ranks start from different
    seeds (hvd.broadcast_parameters unifies them): the parameters' digest
    after every step, the bytes it sent, and how many reductions went
    through Horovod itself after the first step (which connects the ranks
    through Horovod's collectives): none, there is no gradient allreduce,
    only the settings' agreement, one 16-byte gather a step."""
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(hvd.rank())
    model = small_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = oktopk_horovod.DeMo(model.parameters(), lr=0.01, weight_decay=0.1)
    digests, before, reductions, gathers = [], digest(model), 0, 0
    for step in range(int(steps)):
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())
        x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        with counting_horovod_reductions() as count:
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if step:
            gathers += count["allgather"]
            reductions += count[0] - 2 * count["allgather"]  # a gather counts its inner allgather_async too
        digests.append(digest(model))
    result = {"digests": digests, "moved": digests[-1] != before, "bytes_sent": opt.bytes_sent, "steps": opt.steps,
              "horovod_reductions": reductions, "agreement_gathers": gathers}
    opt.close()
    return result

def momentum_density_one(out, nesterov, steps="6"):
    """Compression.oktopk(density=1.0) under SGD with momentum 0.9 (and
    weight decay), corrected (oktopk.momentum), beside hvd.DistributedOptimizer
    with the same SGD: the parameters' largest relative difference over the
    steps, whether the correction took every parameter, and the parameters
    at the end (ranks must agree)."""
    hvd.init()
    torch.set_num_threads(1)
    nesterov = nesterov == "1"
    torch.manual_seed(5)
    model, reference = small_model(), small_model()
    reference.load_state_dict(model.state_dict())

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.01)

    opt = oktopk_horovod.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                              compression=oktopk_horovod.Compression.oktopk(algorithm="oktopk", density=1.0))
    ref = hvd.DistributedOptimizer(sgd(reference), named_parameters=reference.named_parameters())
    worst = 0.0
    for step in range(int(steps)):
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())
        x, y = torch.randn(32, 20, generator=g), torch.randint(0, 5, (32,), generator=g)
        for m, o in ((model, opt), (reference, ref)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            worst = max(worst, (p - q).abs().max().item() / (q.abs().max().item() or 1.0))
    result = {"worst": worst, "corrected": len(opt.engine._momentum.velocity), "params": len(list(model.parameters())), "digest": digest(model)}
    opt.close()
    return result


def native_hands_through(out, nesterov):
    """Compression.oktopk() under SGD with momentum 0.9 and weight decay,
    its clock injected so that native wins (5 ms against 20): after the
    sparse probe, the first native step folds the residuals in, and every
    native step after it holds nothing. From the first such step on, 4
    steps beside plain hvd.DistributedOptimizer started from the same
    parameters and momentum buffers: whether both are the same bits after
    each step, and how many groups the correction worked on there."""
    import copy

    hvd.init()
    torch.set_num_threads(1)
    nesterov = nesterov == "1"

    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.01)

    torch.manual_seed(3)
    model = small_model()
    opt = oktopk_horovod.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                              compression=oktopk_horovod.Compression.oktopk(density=0.05, recheck_every=40))
    clock = Clock()
    opt.engine._choice.clock = clock
    correction = opt.engine._momentum
    worked, before = [], correction.before

    def counting(*args):
        worked.append(step)
        return before(*args)

    correction.before = counting

    def batch(step):
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())
        return torch.randn(32, 20, generator=g), torch.randint(0, 5, (32,), generator=g)

    reference = ref = None
    same, paths, step = [], [], 0
    while step < 30 and len(same) < 4:
        idle = opt.engine.path == "native" and not opt.engine._residual_groups and correction.active
        if idle and reference is None:
            reference = copy.deepcopy(model)
            ref = hvd.DistributedOptimizer(sgd(reference), named_parameters=reference.named_parameters())
            ref.load_state_dict(opt.state_dict())
            worked.clear()
        paths.append(opt.engine.path)
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        clock.now += 0.005 if opt.engine.path == "native" else 0.020
        opt.step()
        if reference is not None:
            ref.zero_grad()
            F.cross_entropy(reference(x), y).backward()
            ref.step()
            same.append(all(torch.equal(p, q) and torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
                            for p, q in zip(model.parameters(), reference.parameters())))
        step += 1
    result = {"same": same, "worked": worked, "paths": paths, "params": digest(model)}
    opt.close()
    return result


def settings_mismatch(out, name, *values):
    """``name`` set to ``values[rank]`` (Python literals) on each rank, of
    Compression.oktopk, or of DeMo's topk for name "demo_topk": the
    construction or first step that fails, how long it took, the error."""
    import ast
    import time

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(3)
    model = small_model()
    value = ast.literal_eval(values[hvd.rank()])
    start = time.monotonic()
    try:
        if name == "demo_topk":
            opt = oktopk_horovod.DeMo(model.parameters(), lr=0.01, topk=value)
            F.cross_entropy(model(torch.randn(8, 20)), torch.randint(0, 5, (8,))).backward()
            start = time.monotonic()
            opt.step()
        else:
            oktopk_horovod.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                                compression=oktopk_horovod.Compression.oktopk(**{name: value}))
        return {"error": None}
    except oktopk_horovod.OkTopkError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}


if __name__ == "__main__":
    name, outdir = sys.argv[1], sys.argv[2]
    result = globals()[name](outdir, *sys.argv[3:])
    with open(os.path.join(outdir, f"rank{hvd.rank()}.pkl"), "wb") as f:
        pickle.dump(result, f)
