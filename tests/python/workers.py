"""Rank functions for the DDP tests, started by torch.multiprocessing in
fresh (spawned) processes. Each writes what the test checks to a file."""

import os
import pickle
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
for p in (os.path.join(ROOT, "plugins", "pytorch"), os.path.join(ROOT, "examples", "pytorch")):
    if p not in sys.path:
        sys.path.insert(0, p)

from oktopk import OkTopkError, OkTopkState, oktopk_hook  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402


def setup(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def write(out, rank, value):
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(value, f)


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)


def density_one(rank, world, port, out, device="cpu", dtype="float32"):
    """Grads through oktopk at density 1 against allreduce_hook's, per step.
    On "cuda" both ranks share GPU 0 (gloo moves CUDA tensors), so the hook's
    staging through pinned host memory is what is exercised."""
    setup(rank, world, port)
    dtype = getattr(torch, dtype)
    a = DDP(small_model().to(device, dtype), device_ids=[0] if device == "cuda" else None)
    b = DDP(small_model().to(device, dtype), device_ids=[0] if device == "cuda" else None)
    state = OkTopkState(density=1.0, warmup_iters=1)
    a.register_comm_hook(state, oktopk_hook)
    b.register_comm_hook(None, allreduce_hook)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    worst = 0.0
    for step in range(6):
        x, y = batch(rank, step)
        x, y = x.to(device, dtype), y.to(device)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert pa.grad.device == pb.grad.device and pa.grad.dtype == dtype
            worst = max(worst, (pa.grad.float() - pb.grad.float()).abs().max().item() / (pb.grad.float().abs().max().item() + 1e-30))
        oa.step()
        ob.step()
    write(out, rank, {"worst_relative_diff": worst, "sparse_iters": state.iter - state.warmup_iters})
    state.close()
    dist.destroy_process_group()


def train_cnn(rank, world, port, out, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import cnn  # makes its own process group from the environment, as under torchrun

    write(out, rank, cnn.main(args))


def every_algorithm(rank, world, port, out, algorithms):
    setup(rank, world, port)
    done = []
    for alg in algorithms:
        m = DDP(small_model())
        state = OkTopkState(density=0.1, algorithm=alg, warmup_iters=1)
        m.register_comm_hook(state, oktopk_hook)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(3):
            x, y = batch(rank, step)
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        params = b"".join(p.detach().numpy().tobytes() for p in m.parameters())
        done.append((alg, params, state.bytes_sent))
        state.close()
    write(out, rank, done)
    dist.destroy_process_group()


def dead_peer(rank, world, port, out, timeout):
    setup(rank, world, port)
    m = DDP(small_model())
    state = OkTopkState(density=0.1, warmup_iters=1, timeout=timeout)
    m.register_comm_hook(state, oktopk_hook)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(100):
        if step == 3:
            # Rank 1's last sends of step 2 may still be queued when its
            # step returns; the barrier lets them arrive before it dies, so
            # rank 0 fails in step 3, not 2.
            dist.barrier()
            if rank == 1:
                os._exit(3)  # dies mid-training, as a crashed or killed rank would
        x, y = batch(rank, step)
        o.zero_grad()
        start = time.monotonic()
        try:
            F.cross_entropy(m(x), y).backward()
        except Exception as e:  # noqa: BLE001 - what DDP re-raises is checked by the test
            write(out, rank, {"step": step, "seconds": time.monotonic() - start, "error": repr(e)})
            os._exit(0)
        o.step()
    write(out, rank, {"step": None})


def deeper_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def checkpoint(rank, world, port, out, phase, ckpt, multi_bucket=False):
    """phase 'full': train 8 steps, saving everything after step 4.
    phase 'resume': load that checkpoint in new processes, train steps 5–8.
    multi_bucket: a deeper model in tiny buckets, so DDP's rebuilt layout
    (the one saved) has several buckets while its initial layout, which the
    resumed run's first step uses, has one."""
    setup(rank, world, port)
    m = DDP(deeper_model(), bucket_cap_mb=0.001) if multi_bucket else DDP(small_model())
    state = OkTopkState(density=0.05, warmup_iters=1, tau=2, tau_prime=3)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    first = 0
    path = os.path.join(ckpt, f"rank{rank}.pt")
    if phase == "resume":
        saved = torch.load(path, weights_only=False)
        m.module.load_state_dict(saved["model"])
        o.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["oktopk"])
        first = saved["step"]
    m.register_comm_hook(state, oktopk_hook)
    for step in range(first, 8):
        x, y = batch(rank, step)
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
        if phase == "full" and step + 1 == 4:
            torch.save({"model": m.module.state_dict(), "optimizer": o.state_dict(), "oktopk": state.state_dict(), "step": 4}, path)
    write(out, rank, {"params": b"".join(p.detach().numpy().tobytes() for p in m.parameters()), "groups": len(state._groups)})
    state.close()
    dist.destroy_process_group()


def fork_child(rank, world, port, out):
    setup(rank, world, port)
    from oktopk import Communicator

    comm = Communicator()
    t = torch.ones(4)
    comm.allreduce_(t)
    pid = os.fork()
    if pid == 0:
        try:
            comm.allreduce_(torch.ones(4))
            os._exit(1)  # must not get here
        except OkTopkError as e:
            os._exit(0 if "fork" in str(e) else 2)
    _, status = os.waitpid(pid, 0)
    write(out, rank, {"child_exit": os.waitstatus_to_exitcode(status), "parent_result": t.tolist()})
    comm.destroy()
    dist.destroy_process_group()


def non_finite_step(rank, world, port, out, bad_rank, bad_step, steps):
    """AMP-style training under torch.amp.GradScaler; rank bad_rank puts a
    NaN into one entry of one gradient at step bad_step."""
    setup(rank, world, port)
    m = DDP(small_model())
    state = OkTopkState(density=0.1, algorithm="oktopk", warmup_iters=1)
    m.register_comm_hook(state, oktopk_hook)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    current = {"step": -1}

    def inject(grad):
        if rank == bad_rank and current["step"] == bad_step:
            grad = grad.clone()
            grad.view(-1)[7] = float("nan")
        return grad

    m.module[0].weight.register_hook(inject)
    non_finite, params_changed, scales = [], [], []
    for step in range(steps):
        current["step"] = step
        x, y = batch(rank, step)
        o.zero_grad()
        scaler.scale(F.cross_entropy(m(x), y)).backward()
        non_finite.append(not all(torch.isfinite(p.grad).all().item() for p in m.parameters()))
        before = [p.detach().clone() for p in m.parameters()]
        scaler.step(o)
        scaler.update()
        params_changed.append(any(not torch.equal(a, p) for a, p in zip(before, m.parameters())))
        scales.append(scaler.get_scale())
    write(out, rank, {
        "non_finite": non_finite,
        "params_changed": params_changed,
        "scales": scales,
        "params": b"".join(p.detach().numpy().tobytes() for p in m.parameters()),
        "finite": all(torch.isfinite(p).all().item() for p in m.parameters()),
        "sparse_iters": state.iter - state.warmup_iters,
    })
    state.close()
    dist.destroy_process_group()


def dead_in_setup(rank, world, port, out, timeout):
    """Rank 1 dies just before the first sparse step, where the communicator
    is set up through the store (warm-up of 2: DDP's bucket rebuild, which
    talks to every rank, is over by then)."""
    setup(rank, world, port)
    m = DDP(small_model())
    state = OkTopkState(density=0.1, warmup_iters=2, timeout=timeout)
    m.register_comm_hook(state, oktopk_hook)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(4):
        if step == 2:
            dist.barrier()  # step 1's last messages arrive before rank 1 dies
            if rank == 1:
                os._exit(3)
        x, y = batch(rank, step)
        o.zero_grad()
        start = time.monotonic()
        try:
            F.cross_entropy(m(x), y).backward()
        except Exception as e:  # noqa: BLE001 - what DDP re-raises is checked by the test
            write(out, rank, {"step": step, "seconds": time.monotonic() - start, "error": repr(e)})
            os._exit(0)
        o.step()
    write(out, rank, {"step": None})


def unsupported_dtype(rank, world, port, out):
    """A float64 model: the first backward (a dense warm-up step) must
    already refuse it."""
    setup(rank, world, port)
    m = DDP(small_model().double())
    m.register_comm_hook(OkTopkState(density=0.1), oktopk_hook)
    x, y = batch(rank, 0)
    try:
        F.cross_entropy(m(x.double()), y).backward()
        error = None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    write(out, rank, {"error": error})
    dist.destroy_process_group()


class _FixedGradient(torch.autograd.Function):
    """Gives w the gradient g, the same tensor every step: backward then
    allocates nothing of w's size (a fresh gradient tensor every step would
    make the C allocator's RSS jump by its size, hiding what the hook and
    the library hold)."""

    @staticmethod
    def forward(ctx, w, g):
        ctx.g = g
        return w.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.g, None


class _ReversedStack(nn.Module):
    """A large flat parameter with a fixed gradient, and square layers
    applied in the reverse of their registration order: DDP's first bucket
    layout follows registration (reversed), its rebuilt one the order
    gradients become ready, so after the rebuild the layers' bucket holds
    its parameters out of the order the hook keeps residuals in, and the
    hook gathers them through its staging memory."""

    def __init__(self, flat, width, depth):
        super().__init__()
        torch.manual_seed(0)
        self.flat = nn.Parameter(torch.zeros(flat))
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x, flat_grad):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x, _FixedGradient.apply(self.flat, flat_grad)


def _rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def rss_steady(rank, world, port, out, warm, steps):
    """RSS before the first sparse step (the dense warm-up steps load
    nothing of liboktopk), the largest over the second half of `warm`
    sparse steps, and the largest over the `steps` after; and the hook's
    staging buffers at both points."""
    setup(rank, world, port)
    flat, width, depth = 1 << 22, 256, 3  # 4.4 M parameters, 17 MB of float32 gradients
    # Every rank builds the same parameters: no broadcast of them at start.
    m = DDP(_ReversedStack(flat, width, depth), bucket_cap_mb=4, init_sync=False)
    # Two dense steps: DDP rebuilds its buckets in the second, so its new
    # bucket memory is there before the first sparse step.
    state = OkTopkState(density=0.01, warmup_iters=2, tau=4, tau_prime=2)
    m.register_comm_hook(state, oktopk_hook)
    o = torch.optim.SGD(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, width, generator=g), torch.randn(8, width, generator=g)
    flat_grad = torch.randn(flat, generator=g)

    def step():
        o.zero_grad(set_to_none=False)  # gradients stay allocated between steps
        out, zero = m(x, flat_grad)
        (F.mse_loss(out, y) + zero).backward()
        o.step()

    step()  # dense warm-up
    step()
    before = _rss_kib()
    # The warm-up's second half sets the level: the library's collector has
    # run through its cycles by then, and its heap tops out at the same
    # level every cycle.
    base = 0
    for i in range(warm):
        step()
        if i >= warm // 2:
            base = max(base, _rss_kib())
    state._worker.submit(lambda: None).result()
    staging = {k: v.data_ptr() for k, v in state._staging.items()}
    peak = base
    for _ in range(steps):
        step()
        peak = max(peak, _rss_kib())
    state._worker.submit(lambda: None).result()
    params = sum(p.numel() for p in m.parameters())
    write(out, rank, {"before_kib": before, "base_kib": base, "peak_kib": peak, "gradient_kib": params * 4 // 1024,
                      "staging_before": staging, "staging_after": {k: v.data_ptr() for k, v in state._staging.items()}})
    state.close()
    dist.destroy_process_group()
