"""Rank functions for the DDP tests, started by torch.multiprocessing in
fresh (spawned) processes. Each writes what the test checks to a file."""

import os
import pickle
import signal
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

from oktopk import OkTopkError, OkTopkState, Warmup, oktopk_hook  # noqa: E402
from oktopk.settings import with_checksum  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook  # noqa: E402


def setup(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def exit_when_done(rank, fn, *args):
    """Run fn(rank, *args) in a spawned rank, then end the process at once,
    without the interpreter's finalization (an exception still reaches
    torch's spawn wrapper, which prints it and exits 1). Why: torch's gloo
    worker threads release each collective's work after completing it, and
    a work issued during backward holds the thread-local Python objects
    torch stashes there; when that release comes while the interpreter
    finalizes, taking the GIL ends the thread inside a C++ destructor and
    the process aborts ("terminate called without an active exception",
    pytorch/pytorch#190489; caught here in a core dump of a rank that had
    written its results). What a test checks is in the file fn wrote."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    state = OkTopkState(algorithm="oktopk", density=1.0, warmup_iters=2)
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
        state = OkTopkState(density=0.1, algorithm=alg, warmup_iters=2)
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


def auto_counts(rank, world, port, out, steps):
    """algorithm="auto" on a model whose DDP buckets range from a few
    parameters to thousands: what each rank's state counted, and its
    parameters after training."""
    setup(rank, world, port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4), nn.ReLU(), nn.Linear(4, 1))
    m = DDP(model, bucket_cap_mb=0.02)
    state = OkTopkState(density=0.05, algorithm="auto", warmup_iters=2)
    m.register_comm_hook(state, oktopk_hook)
    o = torch.optim.SGD(m.parameters(), lr=0.05)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 1, generator=g)
        o.zero_grad()
        F.mse_loss(m(x), y).backward()
        o.step()
    params = b"".join(p.detach().numpy().tobytes() for p in m.parameters())
    write(out, rank, {"counts": dict(state.algorithm_counts), "params": params, "buckets": len(state._layout.groups)})
    state.close()
    dist.destroy_process_group()


def dead_peer(rank, world, port, out, timeout):
    setup(rank, world, port)
    m = DDP(small_model())
    state = OkTopkState(algorithm="oktopk", density=0.1, warmup_iters=2, timeout=timeout)
    m.register_comm_hook(state, oktopk_hook)
    # With momentum, so that the failing step runs under the momentum
    # correction (oktopk.momentum), which must keep its velocities whole.
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for step in range(100):
        velocities = {i: v.clone() for i, v in state._momentum.velocity.items()}
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
            kept = velocities.keys() == state._momentum.velocity.keys() and all(
                torch.equal(v, state._momentum.velocity[i]) for i, v in velocities.items())
            write(out, rank, {"step": step, "seconds": time.monotonic() - start, "error": repr(e), "corrected": len(velocities),
                              "velocities_kept": kept})
            os._exit(0)
        o.step()
    write(out, rank, {"step": None})


def stopped_peer_on_native_step(rank, world, port, out, pg_timeout, compression):
    """Rank 2 of 3 stops (sleeps, as a SIGSTOPped rank) before its step-2
    backward, a step of the warm-up: the process group's own allreduce
    (``compression`` "native": float32; "bf16": the bfloat16 path). Each
    survivor records the error DDP re-raised and how long it took."""
    import datetime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    # The short timeout is the training group's only: the setup (ranks
    # starting seconds apart on a loaded machine) waits on the default
    # group's, and the ranks leave a barrier on it together before DDP's
    # own broadcast on the short one and before every step, so that only
    # the stopped rank, not a rank the machine's load held back, outlasts
    # the short timeout (with all three ranks failing at step 0 or 1, a
    # loaded machine once did).
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=pg_timeout))
    dist.barrier()
    m = DDP(small_model(), process_group=group)
    warmup = Warmup(iters=10) if compression == "native" else Warmup(iters=10, compression=compression)
    m.register_comm_hook(OkTopkState(process_group=group, sparse_after=0, density=0.1, warmup=warmup), oktopk_hook)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(5):
        dist.barrier()
        if step == 2:
            if rank == 2:
                # Stopped until both survivors have written what they
                # raised (at most a minute): a survivor that waited for
                # this rank instead of timing out shows in its seconds.
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not all(os.path.exists(os.path.join(out, f"rank{r}.pkl")) for r in (0, 1)):
                    time.sleep(0.1)
                os._exit(0)
        x, y = batch(rank, step)
        o.zero_grad()
        start = time.monotonic()
        try:
            F.cross_entropy(m(x), y).backward()
        except Exception as e:  # noqa: BLE001 - what DDP re-raises is checked by the test
            write(out, rank, {"step": step, "seconds": time.monotonic() - start, "error": str(e)})
            os._exit(0)
        o.step()
    write(out, rank, {"step": None})


def dead_peer_between_buckets(rank, world, port, out, timeout):
    """The 4-bit path (the whole run its warm-up) on a model in several
    buckets, SGD with momentum. At step 4 rank 1 dies inside backward,
    after the buckets of the last layers were reduced and before the first
    layer's: rank 0's step fails in a later bucket, after earlier ones of
    the same step completed. Rank 0 records its state_dict() before the
    step and after the failure, and the 4-bit path's bytes at both."""
    setup(rank, world, port)
    m = DDP(deeper_model(), bucket_cap_mb=0.001)
    state = OkTopkState(sparse_after=0, density=0.1, timeout=timeout, warmup=Warmup(iters=100, compression="quantized"))
    m.register_comm_hook(state, oktopk_hook)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    def as_bytes(v):  # tensors as their bytes, the rest as it is, for a bitwise comparison
        if isinstance(v, torch.Tensor):
            return v.numpy().tobytes()
        return {k: as_bytes(x) for k, x in v.items()} if isinstance(v, dict) else v

    def saved():
        d = state.state_dict()
        return {"quantized": as_bytes(d["quantized"]), "momentum": as_bytes(d["momentum"]), "bytes": state.quantized_bytes_sent}

    for step in range(6):
        x, y = batch(rank, step)
        o.zero_grad()
        if step == 4:
            dist.barrier()
            if rank == 1:
                m.module[0].weight.register_hook(lambda grad: os._exit(3))  # the first layer's gradient comes last
            before = saved()
        try:
            F.cross_entropy(m(x), y).backward()
        except Exception as e:  # noqa: BLE001 - what DDP re-raises is checked by the test
            write(out, rank, {"step": step, "error": str(e), "before": before, "after": saved()})
            os._exit(0)
        o.step()
    write(out, rank, {"step": None})


def deeper_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def checkpoint(rank, world, port, out, phase, ckpt, multi_bucket, cuts):
    """phase 'full': train 8 steps, saving everything after each step in cuts.
    phase 'resume': for each cut, load that checkpoint into a new model,
    optimizer and OkTopkState and train the remaining steps. multi_bucket: a
    deeper model in tiny buckets, so DDP's rebuilt layout has several buckets
    while its initial layout, which the first step after a resume uses, has
    one."""
    setup(rank, world, port)

    def path(cut):
        return os.path.join(ckpt, f"rank{rank}-after{cut}.pt")

    def train(first, save):
        m = DDP(deeper_model(), bucket_cap_mb=0.001) if multi_bucket else DDP(small_model())
        state = OkTopkState(algorithm="oktopk", density=0.05, warmup_iters=2, tau=2, tau_prime=3)
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        if first:
            saved = torch.load(path(first), weights_only=False)
            m.module.load_state_dict(saved["model"])
            o.load_state_dict(saved["optimizer"])
            state.load_state_dict(saved["oktopk"])
        m.register_comm_hook(state, oktopk_hook)
        for step in range(first, 8):
            x, y = batch(rank, step)
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
            if save and step + 1 in cuts:
                torch.save({"model": m.module.state_dict(), "optimizer": o.state_dict(), "oktopk": state.state_dict()}, path(step + 1))
        result = {"params": b"".join(p.detach().numpy().tobytes() for p in m.parameters()), "groups": len(state._layout.groups),
                  "corrected": len(state._momentum.velocity)}
        state.close()
        return result

    if phase == "full":
        write(out, rank, train(0, True))
    else:
        write(out, rank, {cut: train(cut, False) for cut in cuts})
    dist.destroy_process_group()


def checkpoint_of_another_rank(rank, world, port, out, ckpt):
    """Train past the warm-up, save this rank's state, then load the other
    rank's state into a fresh OkTopkState: refused at load."""
    setup(rank, world, port)
    m = DDP(small_model())
    state = OkTopkState(algorithm="oktopk", density=0.1, warmup_iters=2)
    m.register_comm_hook(state, oktopk_hook)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(rank, step)
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
    saved = state.state_dict()
    torch.save(saved, os.path.join(ckpt, f"rank{rank}.pt"))
    dist.barrier()
    other = torch.load(os.path.join(ckpt, f"rank{1 - rank}.pt"), weights_only=False)
    fresh = OkTopkState(algorithm="oktopk", density=0.1, warmup_iters=2)
    try:
        fresh.load_state_dict(other)
        error = None
    except ValueError as e:
        error = str(e)
    fresh.load_state_dict(saved)  # its own is accepted
    write(out, rank, {"error": error, "saved": (saved.get("rank"), saved.get("world_size"))})
    state.close()
    dist.destroy_process_group()


def checkpoint_of_another_world_size(rank, world, port, out, ckpt):
    """One rank loads rank 0's state of a 2-rank run: refused at
    load_state_dict, or, when loaded before the process group exists, at
    the first sparse step, before the communicator is set up. Then a
    malformed tensor state through the library's own check."""
    saved = torch.load(os.path.join(ckpt, "rank0.pt"), weights_only=False)
    early = OkTopkState(algorithm="oktopk", density=0.1, warmup_iters=2)
    early.load_state_dict(saved)  # no process group yet: checked at the first sparse step
    setup(rank, world, port)
    try:
        OkTopkState(algorithm="oktopk", density=0.1, warmup_iters=2).load_state_dict(saved)
        at_load = None
    except ValueError as e:
        at_load = str(e)
    m = DDP(small_model())
    m.register_comm_hook(early, oktopk_hook)
    at_step = None
    for step in range(3):
        x, y = batch(rank, step)
        try:
            F.cross_entropy(m(x), y).backward()
        except Exception as e:  # noqa: BLE001 - what DDP re-raises is checked by the test
            at_step = (step, str(e), early._reducer.comm is None)
            break
    from oktopk import Communicator

    comm = Communicator()
    try:
        comm.load_tensor_state(5, b"OKTS" + bytes(60))
        malformed = None
    except OkTopkError as e:
        malformed = str(e)
    comm.destroy()
    write(out, rank, {"at_load": at_load, "at_step": at_step, "malformed": malformed})
    dist.destroy_process_group()


def env_after_load(rank, world, port, out):
    """Settings made in os.environ after oktopk is imported and the library
    loaded take effect. The spawned process first drops any it inherited,
    so that the library, when loaded, starts without them."""
    names = ("OKTOPK_CURVE", "OKTOPK_SOCKET_IFNAME", "OKTOPK_STALL_WARN")
    for name in names:
        os.environ.pop(name, None)
    setup(rank, world, port)
    import oktopk
    from oktopk import Communicator

    oktopk.library_version()  # loads liboktopk
    res = {}

    os.environ["OKTOPK_CURVE"] = "1"
    try:
        comm = Communicator()
        res["curve"] = comm.endpoint
        comm.destroy()
    except OkTopkError as e:
        res["curve"] = str(e)
    del os.environ["OKTOPK_CURVE"]
    comm = Communicator()
    res["no_curve"] = comm.endpoint
    comm.destroy()

    # The plugin leaves the choice of address to the library when
    # OKTOPK_SOCKET_IFNAME is set; the library must then see it.
    os.environ["OKTOPK_SOCKET_IFNAME"] = "oktopk-none0"
    try:
        Communicator().destroy()
        res["ifname"] = None
    except OkTopkError as e:
        res["ifname"] = str(e)
    del os.environ["OKTOPK_SOCKET_IFNAME"]

    # Two ranks of one communicator in this process; rank 1 never joins the
    # call, so rank 0 waits until its timeout, logging a stall line to
    # stderr (file descriptor 2, captured in a file) after 0.2 s.
    os.environ["OKTOPK_STALL_WARN"] = "0.2"
    import tempfile
    import threading

    exchanged, both = {}, threading.Barrier(2)

    def member(r, comms):
        def share_token(token):
            if token is not None:
                exchanged["token"] = token
            both.wait()
            return exchanged["token"]

        def gather_endpoints(endpoint):
            exchanged[r] = endpoint
            both.wait()
            return [exchanged[0], exchanged[1]]

        comms[r] = Communicator.from_exchange(r, 2, share_token, gather_endpoints, timeout=1.0)

    comms = {}
    threads = [threading.Thread(target=member, args=(r, comms)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with tempfile.TemporaryFile() as log:
        saved_stderr = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            comms[0].allreduce_(torch.ones(4))
        except OkTopkError:
            pass
        finally:
            os.dup2(saved_stderr, 2)
            os.close(saved_stderr)
        log.seek(0)
        res["stall"] = log.read().decode(errors="replace")
    for c in comms.values():
        c.destroy()
    write(out, rank, res)
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


def two_threads_one_comm(rank, world, port, out):
    """Rank 0 calls sparse_allreduce_ on one communicator from two Python
    threads at once (rank 1 is late, so the first call is still running);
    rank 1 makes its calls from one thread."""
    import threading

    setup(rank, world, port)
    from oktopk import Communicator

    comm = Communicator(density=0.1)
    inputs = [torch.arange(200, dtype=torch.float32) * (rank + 1) + 7 * c for c in range(2)]
    outputs = [t.clone() for t in inputs]
    refused = None
    if rank == 1:
        time.sleep(0.5)
        for t in outputs:
            comm.sparse_allreduce_(5, t)
    else:
        first = threading.Thread(target=comm.sparse_allreduce_, args=(5, outputs[0]))
        first.start()
        time.sleep(0.1)
        other = inputs[1].clone()
        try:
            comm.sparse_allreduce_(5, other)
        except OkTopkError as e:
            refused = (e.code, str(e), bool(torch.equal(other, inputs[1])))
        first.join()
        comm.sparse_allreduce_(5, outputs[1])  # after the first returned: fine from any thread
    write(out, rank, {"refused": refused, "outputs": [t.numpy().tobytes() for t in outputs]})
    comm.destroy()
    dist.destroy_process_group()


def dropped_count(rank, world, port, out, strangers):
    """A one-rank communicator whose port `strangers` raw connections flood
    as a NULL ZeroMQ client would (greeting, READY, then an empty frame every
    two bytes): what Communicator.dropped says before and after."""
    import socket
    import struct

    from oktopk import Communicator

    comm = Communicator.from_exchange(0, 1, lambda token: token, lambda endpoint: [endpoint])
    before = comm.dropped
    host, port_ = comm.endpoint[len("tcp://"):].split("#")[0].rsplit(":", 1)
    greeting = b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32
    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    for _ in range(strangers):
        with socket.create_connection((host, int(port_)), timeout=1) as s:
            try:
                s.sendall(greeting + bytes([4, len(body)]) + body)
                deadline = time.monotonic() + 0.2
                while time.monotonic() < deadline:
                    s.sendall(b"\0" * 65536)
            except OSError:
                pass  # the rank closed it: refused
    deadline = time.monotonic() + 2
    after = comm.dropped
    while after < before + strangers and time.monotonic() < deadline:
        time.sleep(0.01)
        after = comm.dropped
    comm.destroy()
    try:
        comm.dropped
        raised_after_destroy = False
    except OkTopkError:
        raised_after_destroy = True
    write(out, rank, {"before": before, "after": after, "raised_after_destroy": raised_after_destroy})


def non_finite_step(rank, world, port, out, bad_rank, bad_step, steps):
    """AMP-style training under torch.amp.GradScaler; rank bad_rank puts a
    NaN into one entry of one gradient at step bad_step."""
    setup(rank, world, port)
    m = DDP(small_model())
    state = OkTopkState(density=0.1, algorithm="oktopk", warmup_iters=2)
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


def dead_in_setup(rank, world, port, out, timeout, how="exit"):
    """Just before the first sparse step, where the communicator is set up
    through the store (warm-up of 2: DDP's bucket rebuild, which talks to
    every rank, is over by then), rank 1 dies (``how`` "exit"), or rank 0,
    the store's host, stops (``how`` "stop": SIGSTOP, as a frozen node;
    rank 1 kills it once it has written what it saw)."""
    setup(rank, world, port)
    m = DDP(small_model())
    state = OkTopkState(algorithm="oktopk", density=0.1, warmup_iters=2, timeout=timeout)
    m.register_comm_hook(state, oktopk_hook)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    victim = 1 if how == "exit" else 0
    pid_file = os.path.join(out, "victim.pid")
    for step in range(4):
        if step == 2:
            dist.barrier()  # step 1's last messages arrive before the victim goes
            if rank == victim and how == "exit":
                os._exit(3)
            if rank == victim:
                with open(pid_file, "w") as f:
                    f.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
        x, y = batch(rank, step)
        o.zero_grad()
        start = time.monotonic()
        try:
            F.cross_entropy(m(x), y).backward()
        except Exception as e:  # noqa: BLE001 - what DDP re-raises is checked by the test
            write(out, rank, {"step": step, "seconds": time.monotonic() - start, "error": repr(e)})
            if how == "stop":
                with open(pid_file) as f:
                    os.kill(int(f.read()), signal.SIGKILL)
            os._exit(0)
        o.step()
    write(out, rank, {"step": None})


def unsupported_dtype(rank, world, port, out):
    """A float64 model: the first backward (a dense warm-up step) must
    already refuse it."""
    setup(rank, world, port)
    m = DDP(small_model().double())
    m.register_comm_hook(OkTopkState(sparse_after=0, density=0.1), oktopk_hook)
    x, y = batch(rank, 0)
    try:
        F.cross_entropy(m(x.double()), y).backward()
        error = None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    write(out, rank, {"error": error})
    dist.destroy_process_group()


def in_place(rank, world, port, out, steps):
    """`steps` sparse steps of a sequential model in buckets of a few
    parameters each: the hook's groups, the library calls, and the staging
    memory the hook allocated."""
    setup(rank, world, port)
    m = DDP(deeper_model(), bucket_cap_mb=0.02)
    state = OkTopkState(algorithm="oktopk", density=0.1, warmup_iters=2)
    m.register_comm_hook(state, oktopk_hook)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(state.warmup_iters + steps):
        x, y = batch(rank, step)
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
    state._reducer.drain()
    write(out, rank, {"groups": len(state._layout.groups), "largest_group": max(len(g) for g in state._layout.groups.values()),
                      "calls": sum(state.algorithm_counts.values()), "staging": {k: v.numel() for k, v in state._reducer.staging.items()},
                      "params": b"".join(p.detach().numpy().tobytes() for p in m.parameters())})
    state.close()
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
    applied in the reverse of their registration order, in a bucket of
    their own."""

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
    staging buffers at both points. The groups are laid out in ascending
    parameter order, as a checkpoint of an earlier version of the hook
    holds them, so the layers' bucket, whose parameters DDP lays out in the
    order their gradients become ready, is gathered through the staging
    memory at every step."""
    setup(rank, world, port)
    flat, width, depth = 1 << 22, 256, 3  # 4.4 M parameters, 17 MB of float32 gradients
    # Every rank builds the same parameters: no broadcast of them at start.
    m = DDP(_ReversedStack(flat, width, depth), bucket_cap_mb=4, init_sync=False)
    # Two dense steps: DDP rebuilds its buckets in the second, so its new
    # bucket memory is there before the first sparse step.
    state = OkTopkState(algorithm="oktopk", density=0.01, warmup_iters=2, tau=4, tau_prime=2)  # what the bound below counts
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
    saved = state.state_dict()
    saved["layout"] = {group_id: sorted(members) for group_id, members in saved["layout"].items()}
    state.load_state_dict(with_checksum(saved))  # the edit is this test's own: sign it again
    before = _rss_kib()
    # The warm-up's second half sets the level: the library's collector has
    # run through its cycles by then, and its heap tops out at the same
    # level every cycle.
    base = 0
    for i in range(warm):
        step()
        if i >= warm // 2:
            base = max(base, _rss_kib())
    state._reducer.drain()
    staging = {k: v.data_ptr() for k, v in state._reducer.staging.items()}
    peak = base
    for _ in range(steps):
        step()
        peak = max(peak, _rss_kib())
    state._reducer.drain()
    params = sum(p.numel() for p in m.parameters())
    write(out, rank, {"before_kib": before, "base_kib": base, "peak_kib": peak, "gradient_kib": params * 4 // 1024,
                      "staging_before": staging, "staging_after": {k: v.data_ptr() for k, v in state._reducer.staging.items()}})
    state.close()
    dist.destroy_process_group()


class Branchy(nn.Module):
    """A trunk and head always used; `sometimes` used at some steps on every
    rank (globally unused at the others), `rank0` used on rank 0 only at
    even steps (used on some ranks only then, unused everywhere at odd
    steps)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(20, 32)
        self.head = nn.Linear(32, 5)
        self.sometimes = nn.Linear(32, 5)
        self.rank0 = nn.Linear(32, 5)

    def forward(self, x, use_sometimes, use_rank0):
        h = F.relu(self.trunk(x))
        out = self.head(h)
        if use_sometimes:
            out = out + 3 * self.sometimes(h)
        if use_rank0:
            out = out + self.rank0(h)
        return out


def residuals_by_parameter(state, model):
    """Each parameter's residual, from the state's checkpoint: a tensor
    state's residual is its last n float32 (format in core/state.go), laid
    out in the group's canonical parameter order."""
    sd = state.state_dict()
    index_of = {id(p): i for i, p in enumerate(model.parameters())}
    canonical = {state._layout.param_index[id(p)]: (name, p) for name, p in model.named_parameters()}
    out = {}
    for group_id, members in sd["layout"].items():
        blob = sd["tensors"][group_id]
        n = int.from_bytes(blob[8:16], "little")
        residual = torch.frombuffer(bytearray(blob[len(blob) - 4 * n :]), dtype=torch.float32)
        at = 0
        for i in members:
            name, p = canonical[i]
            assert index_of[id(p)] is not None
            out[name] = residual[at : at + p.numel()].view_as(p).clone()
            at += p.numel()
    return out


def unused_parameters(rank, world, port, out, value_dtypes, warmup, steps):
    """DDP(find_unused_parameters=True) through the hook, once per value
    dtype. Per parameter, over the sparse steps: the local gradients the hook
    was given (the bucket's slots: zeros where DDP found the parameter
    unused), the gradient DDP applied (p.grad after backward; none where no
    rank used it, since DDP then discards the hook's result), and the final
    residual."""
    setup(rank, world, port)
    results = {}
    for value_dtype in value_dtypes:
        torch.manual_seed(0)
        m = DDP(Branchy(), find_unused_parameters=True)
        state = OkTopkState(algorithm="oktopk", density=0.05, warmup_iters=warmup, value_dtype=value_dtype)
        names = {id(p): name for name, p in m.module.named_parameters()}
        local = {name: torch.zeros_like(p) for name, p in m.module.named_parameters()}
        applied = {name: torch.zeros_like(p) for name, p in m.module.named_parameters()}
        sparse = {"on": False}

        def recording_hook(st, bucket):
            if sparse["on"]:
                for p, g in zip(bucket.parameters(), bucket.gradients()):
                    local[names[id(p)]] += g.reshape(p.shape)
            return oktopk_hook(st, bucket)

        m.register_comm_hook(state, recording_hook)
        o = torch.optim.SGD(m.parameters(), lr=0.05)
        globally_unused = []
        for step in range(steps):
            sparse["on"] = step >= warmup
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
            o.zero_grad(set_to_none=True)
            F.cross_entropy(m(x, step % 3 == 0, rank == 0 and step % 2 == 0), y).backward()
            if sparse["on"]:
                for name, p in m.module.named_parameters():
                    if p.grad is not None:
                        applied[name] += p.grad
                globally_unused.append(sorted(name for name, p in m.module.named_parameters() if p.grad is None))
            o.step()
        results[value_dtype] = {
            "local": {k: v.numpy() for k, v in local.items()},
            "applied": {k: v.numpy() for k, v in applied.items()},
            "residual": {k: v.numpy() for k, v in residuals_by_parameter(state, m.module).items()},
            "globally_unused": globally_unused,
        }
        state.close()
    write(out, rank, results)
    dist.destroy_process_group()


def train_resumable(rank, path, first, last, state, record, save=None):
    """Train small_model under DDP with state's hook over steps first..last-1
    (from the checkpoint at path when first > 0, saving one there after
    step save-1); record(state) is kept per step. Returns the records, the
    parameters' bytes and the model's size."""
    m = DDP(small_model())
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    if first:
        saved = torch.load(path, weights_only=False)
        m.module.load_state_dict(saved["model"])
        o.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["oktopk"])
    m.register_comm_hook(state, oktopk_hook)
    steps = {}
    for step in range(first, last):
        x, y = batch(rank, step)
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
        steps[step] = record(state)
        if save == step + 1:
            torch.save({"model": m.module.state_dict(), "optimizer": o.state_dict(), "oktopk": state.state_dict()}, path)
    params = b"".join(p.detach().numpy().tobytes() for p in m.parameters())
    state.close()
    return {"steps": steps, "params": params, "n": sum(p.numel() for p in m.parameters())}


def link_resume(rank, world, port, out, ckpt):
    """algorithm="auto" (it measures the link at its first call) over 6
    steps, saving after step 4; the same run resumed from that checkpoint
    in a new state. Records, per step, the link model the communicator
    chooses by, and the checkpoint's "link" field."""
    setup(rank, world, port)
    path = os.path.join(ckpt, f"rank{rank}-link.pt")

    def record(state):
        comm = state._reducer.comm
        return None if comm is None else comm.link()

    def state():
        return OkTopkState(algorithm="auto", density=0.1, warmup_iters=2)

    full = train_resumable(rank, path, 0, 6, state(), record, save=4)
    saved = torch.load(path, weights_only=False)["oktopk"].get("link")
    resumed = train_resumable(rank, path, 4, 6, state(), record)
    write(out, rank, {"full": full, "resumed": resumed, "saved": saved})
    dist.destroy_process_group()


def adaptive(rank, world, port, out, ckpt):
    """Train 12 steps with adaptive=(2**-7, 2**-4, 1e-3) (so every measured
    ξ is above max_xi and the density doubles after each measurement) and ξ
    measured every other sparse step, saving after step 7; resume from that
    checkpoint in a state built without adaptive (or measure_xi_every: the
    checkpoint holds both). Records, per step, the density, τ′, every
    group's k, and the adaptation's inputs."""
    setup(rank, world, port)
    path = os.path.join(ckpt, f"rank{rank}-adaptive.pt")

    def record(state):
        if state._reducer.worker is not None:  # (none yet in the dense warm-up)
            state._reducer.drain()  # the step's adaptation, queued after its buckets, is done
        c = state._reducer.adaptive
        return (state.last_density, state.last_tau_prime, sorted(state.last_k.values()), c and c.adaptations, c and c.last_inputs)

    bounds = (2.0**-7, 2.0**-4, 1e-3)
    full = train_resumable(rank, path, 0, 12, OkTopkState(algorithm="oktopk", density=2.0**-7, warmup_iters=2, tau_prime=8, adaptive=bounds, measure_xi_every=2),
                           record, save=7)
    resumed = train_resumable(rank, path, 7, 12, OkTopkState(algorithm="oktopk", density=2.0**-7, warmup_iters=2, tau_prime=8), record)
    write(out, rank, {"full": full, "resumed": resumed})
    dist.destroy_process_group()


def density_schedule(rank, world, port, out, ckpt):
    """Train 9 steps with a density schedule and ξ measured every other
    sparse step, saving after step 5; resume from that checkpoint in a state
    built without a schedule; and train a twin model without ξ. Records, per
    step, the density, every group's k, the last ξ and its step, and the
    bytes sent so far."""
    setup(rank, world, port)
    path = os.path.join(ckpt, f"rank{rank}-schedule.pt")

    def record(state):
        return (state.last_density, sorted(state.last_k.values()), state.last_xi, state.last_xi_step, state.bytes_sent)

    full = train_resumable(rank, path, 0, 9, OkTopkState(algorithm="oktopk", density=0.01, warmup_iters=2, density_schedule=(0.5, 4), measure_xi_every=2), record, save=5)
    resumed = train_resumable(rank, path, 5, 9, OkTopkState(algorithm="oktopk", density=0.01, warmup_iters=2), record)
    no_xi = train_resumable(rank, path, 0, 9, OkTopkState(algorithm="oktopk", density=0.01, warmup_iters=2, density_schedule=(0.5, 4)), record)
    write(out, rank, {"full": full, "resumed": resumed, "no_xi": no_xi})
    dist.destroy_process_group()


def choice_cost(path, step, rank):
    """The injected seconds of a step on a path, with per-rank noise of up to
    1 ms: native 20 ms; sparse 5 ms until step 18, then 16 ms on ranks 0
    and 2 (which alone would keep sparse: it saves 20%) and 19 ms on rank 1
    (which alone would go native: 5% is less than the margin)."""
    if path == "native":
        base = 0.020
    elif step < 18:
        base = 0.005
    else:
        base = 0.019 if rank == 1 else 0.016
    return base + ((rank * 7919 + step * 104729) % 1000) / 1000 * 0.001


def load_checkpoint(ckpt, rank, step, model, optimizer, state):
    """Load what a run saved after ``step`` (model, optimizer, oktopk
    state) into a DDP model, its optimizer and a state; returns the saved
    dict."""
    saved = torch.load(os.path.join(ckpt, f"rank{rank}-{step}.pt"), weights_only=False)
    model.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    state.load_state_dict(saved["oktopk"])
    return saved


class InjectedClock:
    """A StepChoice clock the training loop advances."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def choice_run(rank, world, port, out, ckpt, value_dtype="float32", device_path=None, bucket_view=False):
    """The default hook (algorithm None, recheck_every 8) on Branchy with
    find_unused_parameters=True over 48 steps, its clock injected with
    choice_cost: per step, the path and whether a communicator existed
    (released once native is chosen, made again for the sparse probe);
    over the steps after the warm-up, the
    gradients given to the hook, those DDP applied, and the final residuals
    (as unused_parameters); the residuals right after the first native step
    that follows sparse ones (step 14); then the same run resumed from
    checkpoints saved after steps 24 and 39 (inside a sparse probe), for
    float32 values only. ``bucket_view``: DDP's gradient_as_bucket_view
    (no resumed runs then)."""
    setup(rank, world, port)

    def train(first, last, saves=()):
        torch.manual_seed(0)
        m = DDP(Branchy(), find_unused_parameters=True, gradient_as_bucket_view=bucket_view)
        o = torch.optim.SGD(m.parameters(), lr=0.05)
        state = OkTopkState(sparse_after=0, density=0.05, warmup_iters=2, recheck_every=8, value_dtype=value_dtype, device_path=device_path)
        clock = InjectedClock()
        state._choice.clock = clock
        # A fixed period between probes (no back-off), so that the
        # switches, probes and checkpoints land on the steps the tests name.
        state._choice.max_backoff = 1
        if first:
            load_checkpoint(ckpt, rank, first, m, o, state)
        names = {id(p): name for name, p in m.module.named_parameters()}
        local = {name: torch.zeros_like(p) for name, p in m.module.named_parameters()}
        applied = {name: torch.zeros_like(p) for name, p in m.module.named_parameters()}
        sparse_phase = {"on": False}

        def recording_hook(st, bucket):
            if sparse_phase["on"]:
                for p, g in zip(bucket.parameters(), bucket.gradients()):
                    local[names[id(p)]] += g.reshape(p.shape)
            return oktopk_hook(st, bucket)

        m.register_comm_hook(state, recording_hook)
        paths, alive, after_switch = {}, {}, None
        for step in range(first, last):
            # The step before this one, on its path (native in the warm-up).
            clock.now += choice_cost(state._path if step > state.warmup_iters else "native", step, rank)
            sparse_phase["on"] = step >= 2
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
            o.zero_grad(set_to_none=True)
            # Rank 0 uses every parameter at step 26 (the second native
            # probe's first step, whose fold then leaves nothing held).
            F.cross_entropy(m(x, step % 3 == 2, rank == 0 and step % 2 == 0), y).backward()
            if sparse_phase["on"]:
                for name, p in m.module.named_parameters():
                    if p.grad is not None:
                        applied[name] += p.grad
            o.step()
            paths[step] = state._path if step >= 2 else "warm-up"
            alive[step] = (state._reducer.comm is not None, len(state._layout._grad_hooks))
            if step == 14:
                after_switch = {k: v.abs().max().item() for k, v in residuals_by_parameter(state, m.module).items()}
            if step + 1 in saves:
                torch.save({"model": m.module.state_dict(), "optimizer": o.state_dict(), "oktopk": state.state_dict()},
                           os.path.join(ckpt, f"rank{rank}-{step + 1}.pt"))
        result = {
            "paths": paths,
            "alive": alive,
            "choice": state.choice,
            "local": {k: v.numpy() for k, v in local.items()},
            "applied": {k: v.numpy() for k, v in applied.items()},
            "residual": {k: v.numpy() for k, v in residuals_by_parameter(state, m.module).items()},
            "after_switch": after_switch,
            "algorithm_counts": dict(state.algorithm_counts),
            "params": b"".join(p.detach().numpy().tobytes() for p in m.parameters()),
        }
        state.close()
        return result

    results = {"full": train(0, 48, saves=(24, 39))}
    for first in (24, 39) if value_dtype == "float32" and not bucket_view else ():
        results[first] = train(first, 48)
    write(out, rank, results)
    dist.destroy_process_group()


def grad_views(rank, world, port, out, steps):
    """The default hook on small_model with its clock injected so that native
    wins (native 10 ms a step, sparse 30 ms), with grads_as_bucket_views
    True and False, zeroing the gradients to None or to zeros: per step, the
    path, the parameters after the optimizer step (bytes), and whether every
    .grad was a slice of the one bucket (one storage) after backward."""
    setup(rank, world, port)
    results = {}
    for views in (True, False):
        for set_to_none in (True, False):
            m = DDP(small_model())
            o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
            state = OkTopkState(sparse_after=0, density=0.05, warmup_iters=2, grads_as_bucket_views=views)
            clock = InjectedClock()
            state._choice.clock = clock
            m.register_comm_hook(state, oktopk_hook)
            paths, params, in_bucket = [], [], []
            for step in range(steps):
                clock.now += 0.030 if step > state.warmup_iters and state._path == "sparse" else 0.010
                x, y = batch(rank, step)
                o.zero_grad(set_to_none=set_to_none)
                F.cross_entropy(m(x), y).backward()
                in_bucket.append(len({p.grad.untyped_storage().data_ptr() for p in m.parameters()}) == 1)
                o.step()
                paths.append(state._path if step >= state.warmup_iters else "warm-up")
                params.append(b"".join(p.detach().numpy().tobytes() for p in m.parameters()))
            results[views, set_to_none] = {"paths": paths, "params": params, "in_bucket": in_bucket}
            state.close()
    write(out, rank, results)
    dist.destroy_process_group()


def adam_family(rank, world, port, out, dense_compression):
    """The default hook under AdamW (with ``dense_compression``), 24 steps,
    its clock injected so that a compressed step costs 10 ms and a native
    one 30: per step after the
    warm-up, its path and each bucket before and after the hook (to check
    every step against the ranks' own gradients), whether a communicator
    was ever made, and the choice, also through a checkpoint; beside it, a
    model with allreduce_hook (parameters compared after the warm-up); in
    the same process, a default state on a model stepped by SGD (its choice
    must not be kept dense by the other model's AdamW), and a named
    algorithm under AdamW (warnings)."""
    import warnings

    setup(rank, world, port)
    torch.manual_seed(0)
    a, b, c, named = (DDP(small_model()) for _ in range(4))
    state = OkTopkState(sparse_after=0, density=0.05, warmup_iters=2, recheck_every=8, dense_compression=dense_compression)
    state_sgd = OkTopkState(sparse_after=0, density=0.05, warmup_iters=2, recheck_every=8)
    state_named = OkTopkState(density=0.05, warmup_iters=2, algorithm="oktopk")
    clock = InjectedClock()
    state._choice.clock = clock
    buckets, now = {}, {"step": 0}

    def recording_hook(st, bucket):
        before, index, step = bucket.buffer().clone(), bucket.index(), now["step"]

        def keep(fut):
            after = fut.value()
            if step >= 2:
                buckets.setdefault(step, []).append((index, before.numpy(), after.clone().numpy()))
            return after

        return oktopk_hook(st, bucket).then(keep)

    a.register_comm_hook(state, recording_hook)
    b.register_comm_hook(None, allreduce_hook)
    c.register_comm_hook(state_sgd, oktopk_hook)
    named.register_comm_hook(state_named, oktopk_hook)
    opts = [torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2),
            torch.optim.SGD(c.parameters(), lr=0.1), torch.optim.AdamW(named.parameters(), lr=1e-2)]
    paths, comm_made, equal_after_warmup = [], False, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(24):
            clock.now += 0.010 if step > 2 and state._path == dense_compression else 0.030  # the step before this one
            now["step"] = step
            x, y = batch(rank, step)
            for m, o in zip((a, b, c, named), opts):
                o.zero_grad()
                F.cross_entropy(m(x), y).backward()
                o.step()
            paths.append(state._path if step >= 2 else "warm-up")
            comm_made = comm_made or state._reducer.comm is not None
            if step == 1:
                equal_after_warmup = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    resumed = OkTopkState(sparse_after=0, density=0.05, warmup_iters=2, recheck_every=8, dense_compression=dense_compression)
    resumed.load_state_dict(state.state_dict())
    write(out, rank, {
        "paths": paths,
        "quantized_held": len(state._quantized),
        "buckets": buckets,
        "comm_made": comm_made,
        "choice": state.choice,
        "resumed_choice": resumed.choice,
        "equal_after_warmup": equal_after_warmup,
        "grad_hooks": len(state._layout._grad_hooks),
        "sgd_kept_dense_for": state_sgd.choice["kept_dense_for"],
        "sgd_sparse_steps": state_sgd.choice["steps"]["sparse"],
        "warnings": [str(w.message) for w in caught if "oktopk" in str(w.message)],
        "named_sparse_calls": sum(state_named.algorithm_counts.values()),
    })
    for s in (state, state_sgd, state_named, resumed):
        s.close()
    dist.destroy_process_group()


def device_path(rank, world, port, out, model_dtype, value_dtype, find_unused, device="cpu"):
    """The same training through the staging path and the device path
    (forced on for CPU tensors; on "cuda" both ranks share GPU 0 over gloo),
    side by side: per step, whether the two
    models' gradients are bitwise equal (a NaN injected on rank 1 at step 7
    in both), and at the end whether their checkpoints (iteration, thresholds,
    boundaries, residuals) are byte for byte equal; the host-device bytes
    and pairs of each."""
    setup(rank, world, port)
    dtype = getattr(torch, model_dtype)
    torch.manual_seed(0)
    ids = [0] if device == "cuda" else None
    models = [DDP(Branchy().to(device, dtype), device_ids=ids, find_unused_parameters=find_unused) for _ in range(2)]
    models[1].module.load_state_dict(models[0].module.state_dict())
    states = [OkTopkState(algorithm="oktopk", density=0.05, warmup_iters=2, tau=3, tau_prime=4, value_dtype=value_dtype, device_path=on)
              for on in (False, True)]
    opts = []
    for m, st in zip(models, states):
        m.register_comm_hook(st, oktopk_hook)
        opts.append(torch.optim.SGD(m.parameters(), lr=0.05))
    equal, nan_seen = [], []
    for step in range(16):
        x, y = batch(rank, step)
        x, y = x.to(device), y.to(device)
        grads = []
        for m, o in zip(models, opts):
            o.zero_grad(set_to_none=True)
            uses = (step % 3 == 0, rank == 0 and step % 2 == 0) if find_unused else (True, True)
            loss = F.cross_entropy(m(x.to(dtype), *uses).float(), y) * (4.0 if step % 5 == 3 else 1.0)
            if step == 7 and rank == 1:
                loss = loss * float("nan")
            loss.backward()
            grads.append([p.grad for p in m.parameters()])
        equal.append(all((a is None and b is None) or (a is not None and b is not None and torch.equal(a.view(torch.int8 if a.element_size() == 1 else
                          {2: torch.int16, 4: torch.int32}[a.element_size()]), b.view({2: torch.int16, 4: torch.int32}[b.element_size()])))
                         for a, b in zip(*grads)))
        nan_seen.append(any(g is not None and bool(torch.isnan(g).any()) for g in grads[1]))
        for o, g in zip(opts, grads):
            if not any(t is not None and bool(torch.isnan(t).any()) for t in g):
                o.step()
    sds = [st.state_dict() for st in states]
    write(out, rank, {
        "equal": equal,
        "nan_seen": nan_seen,
        "same_checkpoint": sds[0]["tensors"] == sds[1]["tensors"] and len(sds[0]["tensors"]) > 0,
        "device_groups": len(states[1]._device_groups),
        "bytes": [st.host_device_bytes for st in states],
        "calls": [st.host_device_calls for st in states],
        "pairs": states[1].host_device_pairs,
    })
    for st in states:
        st.close()
    dist.destroy_process_group()


def device_path_resume(rank, world, port, out):
    """Trained 6 steps on one path, saved, resumed on the other for 6 more
    (float16 values): whether the final parameters equal those of a run on
    the staging path throughout, for each pair of paths."""
    setup(rank, world, port)

    def train(paths, cut):
        params, saved = None, None
        for on, (lo, hi) in zip(paths, ((0, cut), (cut, 12))):
            if lo == hi:
                continue
            torch.manual_seed(0)
            module = small_model()
            if params is not None:
                with torch.no_grad():
                    for p, q in zip(module.parameters(), params):
                        p.copy_(q)
            m = DDP(module)
            o = torch.optim.SGD(m.parameters(), lr=0.05)
            state = OkTopkState(algorithm="oktopk", density=0.05, warmup_iters=2, tau=3, tau_prime=4, value_dtype="float16", device_path=on)
            if saved is not None:
                state.load_state_dict(saved)
            m.register_comm_hook(state, oktopk_hook)
            for step in range(lo, hi):
                x, y = batch(rank, step)
                o.zero_grad()
                F.cross_entropy(m(x), y).backward()
                o.step()
            saved = state.state_dict()
            state.close()
            params = [p.detach().clone() for p in m.parameters()]
        return params

    base = train((False, False), 12)
    write(out, rank, {paths: all(torch.equal(a, b) for a, b in zip(base, train(paths, 6)))
                      for paths in ((False, False), (True, False), (False, True), (True, True))})
    dist.destroy_process_group()


def nccl_hook(rank, world, port, out):
    """The hook over an NCCL process group, rank r on GPU r: the default
    state (the measured choice; its communicator's rendezvous through the
    group's store, the warm-up and the native path through NCCL) and the
    device path at density 1 against allreduce_hook, 8 steps."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    a, b, c = (DDP(small_model().to(device), device_ids=[rank]) for _ in range(3))
    states = [OkTopkState(algorithm="oktopk", density=1.0, warmup_iters=2), OkTopkState(density=0.05, warmup_iters=2)]
    a.register_comm_hook(states[0], oktopk_hook)
    b.register_comm_hook(None, allreduce_hook)
    c.register_comm_hook(states[1], oktopk_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b, c)]
    worst = 0.0
    for step in range(8):
        x, y = batch(rank, step)
        x, y = x.to(device), y.to(device)
        for m, o in zip((a, b, c), opts):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
        for pa, pb in zip(a.parameters(), b.parameters()):
            worst = max(worst, (pa.grad - pb.grad).abs().max().item() / (pb.grad.abs().max().item() + 1e-30))
        for o in opts:
            o.step()
    write(out, rank, {"worst_relative_diff": worst, "device_calls": states[0].host_device_calls, "choice": states[1].choice,
                      "finite": all(bool(torch.isfinite(p).all()) for p in c.parameters())})
    for s in states:
        s.close()
    dist.destroy_process_group()


def quantized_calls(rank, world, port, out, recipe=None, tensors=False):
    """oktopk.quantized (its defaults, or ``recipe``'s settings) over
    ``world`` ranks on one group of 3 parameters
    (1000 values, not a multiple of the padding): per call, this rank's
    input and the result, then the final residuals; a call with NaN on rank
    1 (the result, and whether the residuals moved); the residuals through
    state_dict, and what the group holds for a native step. ``tensors``:
    the rounding done by the tensor operations, not the library."""
    import oktopk.quantized
    from oktopk.quantized import QuantizedGroup

    if tensors:
        oktopk.quantized._library_rounds = lambda *settings: False
    setup(rank, world, port)
    group = QuantizedGroup((7, 3, 5), (400, 100, 500), world, rank, "cpu", **(recipe or {}))
    calls, replaced_kept, saved_at_3 = [], [], None
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(1000, generator=g) * (1 + step)
        flat = x.clone()
        before = (group.residual, group.owner_residual)
        before_values = tuple(t.clone() for t in before)
        sent, completed = group.allreduce_(flat, None)
        replaced_kept.append(all(torch.equal(a, b) for a, b in zip(before, before_values))
                             and group.residual is not before[0] and group.owner_residual is not before[1])
        calls.append((x.numpy(), flat.numpy(), sent, completed))
        if step == 3:
            saved_at_3 = group.state_dict()
            values_at_3 = (group.residual.clone(), group.owner_residual.clone())
    state_dict_kept = torch.equal(saved_at_3["residual"], values_at_3[0]) and torch.equal(saved_at_3["owner_residual"], values_at_3[1])
    residual, owner = group.residual.clone(), group.owner_residual.clone()
    poisoned = torch.randn(1000)
    if rank == 1:
        poisoned[17] = float("nan")
    _, nan_completed = group.allreduce_(poisoned, None)
    unchanged = torch.equal(group.residual, residual) and torch.equal(group.owner_residual, owner)
    saved = QuantizedGroup.from_state_dict(group.state_dict())
    write(out, rank, {
        "calls": calls,
        "residual": residual.numpy(), "owner_residual": owner.numpy(), "chunk": group.chunk, "padded": group.padded,
        "nan_result": poisoned.numpy(), "nan_completed": nan_completed, "residuals_unchanged": unchanged,
        "saved_equal": torch.equal(saved.residual, group.residual) and torch.equal(saved.owner_residual, group.owner_residual),
        "held": group.held().numpy(), "replaced_kept": replaced_kept, "state_dict_kept": state_dict_kept,
    })
    dist.destroy_process_group()


def quantized_resume(rank, world, port, out, ckpt, dense_compression):
    """The default hook with ``dense_compression`` under AdamW on
    Branchy (every branch used; buckets of at most 1 kB: DDP's provisional
    layout holds in one bucket what its rebuilt one splits in two),
    20 steps, its clock injected so that quantized is a clear win: the paths
    and the final parameters of the whole run, and of the same run resumed
    from checkpoints saved after steps 7 and 16 (inside the quantized steps,
    residuals held)."""
    setup(rank, world, port)

    def train(first, last, saves=()):
        torch.manual_seed(0)
        m = DDP(Branchy(), bucket_cap_mb=0.001)
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        state = OkTopkState(sparse_after=0, density=0.05, warmup_iters=2, recheck_every=8, dense_compression=dense_compression)
        clock = InjectedClock()
        state._choice.clock = clock
        # A fixed period between probes (no back-off), so that the
        # switches, probes and checkpoints land on the steps the tests name.
        state._choice.max_backoff = 1
        if first:
            clock.now = load_checkpoint(ckpt, rank, first, m, o, state)["clock"]
        m.register_comm_hook(state, oktopk_hook)
        paths = {}
        for step in range(first, last):
            clock.now += 0.010 if step > 2 and state._path == "quantized" else 0.030  # float32 only: always native
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
            o.zero_grad(set_to_none=True)
            F.cross_entropy(m(x, True, True), y).backward()
            o.step()
            paths[step] = state._path if step >= 2 else "warm-up"
            if step + 1 in saves:
                torch.save({"model": m.module.state_dict(), "optimizer": o.state_dict(), "oktopk": state.state_dict(), "clock": clock.now},
                           os.path.join(ckpt, f"rank{rank}-{step + 1}.pt"))
        result = {"paths": paths, "held": len(state._quantized), "params": b"".join(p.detach().numpy().tobytes() for p in m.parameters())}
        state.close()
        return result

    results = {"full": train(0, 20, saves=(7, 16))}
    for first in (7, 16):
        results[first] = train(first, 20)
    write(out, rank, results)
    dist.destroy_process_group()


def settings_mismatch(rank, world, port, out, name, values, optimizer="SGD"):
    """OkTopkState with ``name`` set to ``values[rank]`` on each rank (an
    optimizer name per rank for name "optimizer_family"): the step that fails,
    how long its backward took, and the error."""
    setup(rank, world, port)
    m = DDP(small_model())
    kwargs = {"density": 0.1}
    if name != "optimizer_family":
        kwargs[name] = values[rank]
    state = OkTopkState(**kwargs)
    m.register_comm_hook(state, oktopk_hook)
    optimizer = values[rank] if name == "optimizer_family" else optimizer
    o = getattr(torch.optim, optimizer)(m.parameters(), lr=0.01)
    result = {"step": None, "error": None}
    for step in range(6):
        x, y = batch(rank, step)
        o.zero_grad()
        start = time.monotonic()
        try:
            F.cross_entropy(m(x), y).backward()
        except Exception as e:  # noqa: BLE001 - what DDP re-raises is checked by the test
            result = {"step": step, "seconds": time.monotonic() - start, "error": f"{type(e).__name__}: {e}"}
            break
        o.step()
    write(out, rank, result)
    os._exit(0)  # the ranks' collectives stopped at different points: no orderly teardown


def nan_at_switch(rank, world, port, out, optimizer, dense_compression, device_path, nan_step):
    """The default hook, its clock injected so that the path of every step
    is known: under SGD sparse is probed at steps 2-5 and native at 6-9
    (step 6 folds the sparse residuals); under AdamW with
    dense_compression="quantized", quantized is chosen and the native probe
    at step 22 folds the quantized residuals. Rank 1's gradient holds a NaN
    at ``nan_step`` (a switch step), and a step whose gradient is not
    finite is skipped, as AMP's scaler skips it. Per step: the path, and
    the state's checkpoint of residuals (library tensors, quantized groups)
    after it."""
    setup(rank, world, port)
    torch.manual_seed(0)
    m = DDP(Branchy(), bucket_cap_mb=0.001)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2) if optimizer == "AdamW" else torch.optim.SGD(m.parameters(), lr=0.05)
    state = OkTopkState(sparse_after=0, density=0.05, warmup_iters=2, recheck_every=8, dense_compression=dense_compression, device_path=device_path,
                        momentum_correction=False)
    clock = InjectedClock()
    state._choice.clock = clock
    m.register_comm_hook(state, oktopk_hook)
    current = {"step": -1}

    def inject(grad):
        if rank == 1 and current["step"] == nan_step:
            grad = grad.clone()
            grad.view(-1)[3] = float("nan")
        return grad

    m.module.trunk.weight.register_hook(inject)
    steps = []
    for step in range(nan_step + 3):
        current["step"] = step
        clock.now += 0.010 if step > 2 and state._path == "quantized" else 0.030
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
        o.zero_grad(set_to_none=True)
        F.cross_entropy(m(x, True, True), y).backward()
        finite = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())
        if finite:
            o.step()
        saved = state.state_dict()
        steps.append({"path": state._path if step >= 2 else "warm-up", "finite": finite, "tensors": saved["tensors"],
                      "residual_groups": saved["residual_groups"],
                      "quantized": {k: (v["residual"].numpy().tobytes(), v["owner_residual"].numpy().tobytes())
                                    for k, v in saved["quantized"].items()}})
    write(out, rank, {"steps": steps, "params": b"".join(p.detach().numpy().tobytes() for p in m.parameters())})
    state.close()
    dist.destroy_process_group()


def quantized_momentum(rank, world, port, out, steps=8):
    """Three runs of the same 4-bit warm-up (``warmup_iters`` past the run,
    ``warmup_compression="quantized"``) under SGD with momentum 0.9 and
    weight decay: the momentum correction on (the default), off, and on
    with the correction's velocities watched. Per run: the final
    parameters and, for the watched one, whether the correction was idle
    at each step."""
    setup(rank, world, port)
    result = {}
    for name, correction in (("on", True), ("off", False)):
        torch.manual_seed(0)
        m = DDP(small_model())
        state = OkTopkState(warmup_iters=steps + 2, warmup_compression="quantized", momentum_correction=correction)
        m.register_comm_hook(state, oktopk_hook)
        o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        idle = []
        for step in range(steps):
            x, y = batch(rank, step)
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
            c = state._momentum
            idle.append(None if c is None or not c.active else bool(c.idle))
        result[name] = {"params": [p.detach().clone() for p in m.parameters()], "idle": idle,
                        "quantized_bytes": state.quantized_bytes_sent}
        state.close()
    write(out, rank, result)
    dist.destroy_process_group()


def compressed_warmup(rank, world, port, out, warmup_compression, steps=7):
    """The hook with ``warmup_iters=5`` and ``warmup_compression``, then
    Ok-Topk at density 1, beside allreduce_hook, bf16_compress_hook and
    fp16_compress_hook on the same model; SGD at learning rate 0, so all see
    the same gradients every step. Per step: the hook's gradients,
    allreduce_hook's (the exact average), bf16_compress_hook's and
    fp16_compress_hook's, the quantized bytes sent so far and the groups
    holding a quantized residual."""
    setup(rank, world, port)
    a, b, c, d = DDP(small_model()), DDP(small_model()), DDP(small_model()), DDP(small_model())
    state = OkTopkState(algorithm="oktopk", density=1.0, warmup_iters=5, warmup_compression=warmup_compression,
                        momentum_correction=False)
    a.register_comm_hook(state, oktopk_hook)
    b.register_comm_hook(None, allreduce_hook)
    c.register_comm_hook(None, bf16_compress_hook)
    d.register_comm_hook(None, fp16_compress_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.0) for m in (a, b, c, d)]
    record = []
    for step in range(steps):
        x, y = batch(rank, step)
        for m, o in zip((a, b, c, d), opts):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
        record.append({
            "hook": torch.cat([p.grad.reshape(-1) for p in a.parameters()]).clone(),
            "exact": torch.cat([p.grad.reshape(-1) for p in b.parameters()]).clone(),
            "bf16": torch.cat([p.grad.reshape(-1) for p in c.parameters()]).clone(),
            "fp16": torch.cat([p.grad.reshape(-1) for p in d.parameters()]).clone(),
            "quantized_bytes": state.quantized_bytes_sent,
            "quantized_groups": len(state._quantized) + len(state._quantized_spill),
        })
        for o in opts:
            o.step()
    write(out, rank, {"steps": record, "sparse_iters": state.iter - state.warmup_iters})
    state.close()
    dist.destroy_process_group()


def clocked_steps(m, o, state, clock, rank, steps, seconds, warmup_path, after=None):
    """``steps`` training steps of DDP model ``m`` under ``o``, the
    injected ``clock`` advanced before each by ``seconds[path]`` of the step
    before it (``warmup_path(step)`` names a warm-up step's path; the hook's
    own ``_path`` after it); ``after()`` once a step has stepped. Returns
    each step's path."""
    paths, path = [], "native"
    for step in range(steps):
        clock.now += seconds[path]
        x, y = batch(rank, step)
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
        path = state._path if step >= state.warmup_iters else warmup_path(step)
        paths.append(path)
        if after is not None:
            after()
    return paths


def no_sparse_choice(rank, world, port, out, steps=28):
    """The hook with ``sparse=False`` under SGD with momentum 0.9 on
    small_model, its clock injected: native steps 40 ms, 4-bit ones 10 ms
    (a clear win, no native probe), sparse ones 1 ms (which would win by
    far, were sparse measured). Returns each step's path, the choice's
    summary, the 4-bit bytes sent, whether the momentum correction was idle
    on every step after the optimizer's first, and the final parameters."""
    setup(rank, world, port)
    torch.manual_seed(0)
    m = DDP(small_model())
    state = OkTopkState(sparse=False, recheck_every=8)
    clock = InjectedClock()
    state._choice.clock = clock
    m.register_comm_hook(state, oktopk_hook)
    o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    idle = []

    def watch_idle():
        c = state._momentum
        idle.append(bool(c.idle) if c is not None and c.active else None)

    paths = clocked_steps(m, o, state, clock, rank, steps, {"native": 0.040, "quantized": 0.010, "sparse": 0.001},
                          lambda step: "native", after=watch_idle)
    write(out, rank, {"choice": state.choice, "paths": paths, "quantized_bytes": state.quantized_bytes_sent, "idle": idle,
                      "params": [p.detach().clone() for p in m.parameters()], "communicator": state._reducer.comm is not None})
    state.close()
    dist.destroy_process_group()


def compressed_warmup_choice(rank, world, port, out, steps=16):
    """The default hook (algorithm None) with ``warmup_iters=6,
    warmup_compression="quantized"`` on small_model, its clock injected:
    native steps 20 ms, the 4-bit warm-up's 500 ms, sparse 15 ms (no clear
    win over 20 ms). Returns the choice's summary and each step's path."""
    setup(rank, world, port)
    m = DDP(small_model())
    state = OkTopkState(sparse_after=0, warmup_iters=6, warmup_compression="quantized", density=0.1)
    clock = InjectedClock()
    state._choice.clock = clock
    m.register_comm_hook(state, oktopk_hook)
    o = torch.optim.SGD(m.parameters(), lr=0.01)
    paths = clocked_steps(m, o, state, clock, rank, steps, {"native": 0.020, "quantized": 0.500, "sparse": 0.015},
                          lambda step: "native" if step < 2 else "quantized")
    write(out, rank, {"choice": state.choice, "paths": paths, "quantized_bytes": state.quantized_bytes_sent})
    state.close()
    dist.destroy_process_group()


def early_steps_choice(rank, world, port, out, correction, steps=16):
    """The default hook (algorithm None) with ``sparse_after=6`` on
    small_model, its clock injected: native steps 40 ms, 4-bit ones 10 ms,
    sparse ones 1 ms (each a clear win over native), beside allreduce_hook
    on the same batches. ``correction`` False: Ok-Topk at density 1 under
    SGD at learning rate 0 (every step sees the same gradients, and the
    hook's should sum to allreduce_hook's); True: SGD with momentum 0.9,
    learning rate 0.05, the momentum correction on. Per step: the path,
    the hook's and allreduce_hook's gradients, the groups holding a
    quantized residual, whether the correction was idle; and the final
    parameters."""
    setup(rank, world, port)
    torch.manual_seed(0)
    a, b = DDP(small_model()), DDP(small_model())
    state = OkTopkState(density=1.0, sparse_after=6, recheck_every=8, momentum_correction=correction)
    clock = InjectedClock()
    state._choice.clock = clock
    a.register_comm_hook(state, oktopk_hook)
    b.register_comm_hook(None, allreduce_hook)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.05 if correction else 0.0, momentum=0.9 if correction else 0.0)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.0)
    seconds = {"native": 0.040, "quantized": 0.010, "sparse": 0.001}
    record, path = [], "native"
    for step in range(steps):
        clock.now += seconds[path]
        x, y = batch(rank, step)
        for m, o in ((a, opt_a), (b, opt_b)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
        c = state._momentum
        record.append({
            "hook": torch.cat([p.grad.reshape(-1) for p in a.parameters()]).clone(),
            "exact": torch.cat([p.grad.reshape(-1) for p in b.parameters()]).clone(),
            "quantized_groups": len(state._quantized) + len(state._quantized_spill),
            "idle": bool(c.idle) if c is not None and c.active else None,
        })
        opt_a.step()
        opt_b.step()
        path = state._path if step >= state.warmup_iters else "native"
        record[-1]["path"] = path
    write(out, rank, {"steps": record, "choice": state.choice, "params": [p.detach().clone() for p in a.parameters()]})
    state.close()
    dist.destroy_process_group()
