"""One rank of the PyTorch plugin's fault campaign (tests/chaos_torch).

The campaign (campaign.py) starts a *session*: 2 or 3 of these processes,
which import torch and oktopk once and form a gloo process group. It then
hands them jobs, one JSON line each on stdin; every job runs on a process
group of its own (``dist.new_group``, with the job's timeout), so a job
that failed on purpose (a mismatch) leaves nothing behind for the next one.
A job that kills or stops a rank ends its session.

What a rank tells the campaign goes out as JSON lines on the file
descriptor that was stdout (stdout itself is pointed at stderr, the rank's
log, so that a print of the plugin's cannot garble them):

    {"ev": "ready"}                       the session is up
    {"ev": "step", "step": g, "t": ...}   step g starts (jobs that ask)
    {"ev": "done", "result": {...}}       the job's findings

Only the plugin's public API is used: ``oktopk.OkTopkState``,
``oktopk.oktopk_hook``, ``oktopk.fsdp.register``, ``oktopk.optim.DeMo``,
``state_dict()``/``load_state_dict()`` and public attributes (``choice``,
``momentum``, ``skipped_steps``). The path of each step is read from
``state.choice["steps"]`` (which counts the steps run on each path).
"""

import argparse
import copy
import datetime
import hashlib
import json
import os
import random
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
PLUGIN = os.path.join(ROOT, "plugins", "pytorch")
if PLUGIN not in sys.path:
    sys.path.insert(0, PLUGIN)

PROTO = None  # the protocol's file (the original stdout)


def send(msg):
    PROTO.write(json.dumps(msg) + "\n")
    PROTO.flush()


# -- the cost schedules ----------------------------------------------------
#
# The measured choice (algorithm=None) times whole steps. For a resumed run
# to take the paths of the uninterrupted one, whatever the machine's load,
# the training loop sleeps after each step by the step's path, so that the
# timings, and with them the decisions, are set by the schedule: SLOW
# seconds against a few milliseconds of work. s is the step after the
# warm-up (s = -1: the warm-up step the choice times as native, the last
# one or, with a compressed warm-up, DDP's second; s = -2: the others);
# "candidate" is the path measured against native (sparse, or quantized
# or bf16 under an Adam-family optimizer).
SLOW = 0.3


def _sparse_then_native(path, s):
    # The warm-up step slow: the candidate's probe (s 0-3) wins clearly and
    # is chosen at s 4, confirmed at s 8; a clear win's first recheck comes
    # 2 x recheck_every (16) steps on. From s 17 the candidate is slow, so
    # the native probe at s 20-23 (the switch at 20 folds its residuals)
    # wins at s 24, confirmed at s 28; the candidate's probe at s 32-35
    # (a new communicator) loses, back to native at s 36.
    if s == -1:
        return SLOW
    if path != "native" and path != "warm-up" and s >= 17:
        return SLOW
    return 0.0


def _native_then_candidate(path, s):
    # The candidate slow at first: no clear win at s 4, the native probe
    # (s 4-7) wins at s 8 (the communicator is released); native slow from
    # s 12 and the candidate fast from s 16, so its probe at s 16-19 wins
    # at s 20, confirmed at s 24.
    if path == "warm-up":
        return 0.0
    if path == "native":
        return SLOW if s >= 12 else 0.0
    return SLOW if s < 16 else 0.0


SCHEDULES = {"sparse-then-native": _sparse_then_native, "native-then-candidate": _native_then_candidate, "none": lambda path, s: 0.0}


# -- models and data -------------------------------------------------------

def small_model(torch, nn, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))


def deep_model(torch, nn, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 5))


def batch(torch, rank, step):
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + 5)
    return torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)


# -- canonical digests -----------------------------------------------------

def feed(h, x):
    """x into the hash h, canonically (tensors by dtype, shape and bytes)."""
    import torch

    if isinstance(x, torch.Tensor):
        if hasattr(x, "to_local"):
            x = x.to_local()
        t = x.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(x.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(x, dict):
        h.update(b"{")
        for key in sorted(x, key=repr):
            feed(h, key)
            feed(h, x[key])
        h.update(b"}")
    elif isinstance(x, (list, tuple)):
        h.update(b"[")
        for item in x:
            feed(h, item)
        h.update(b"]")
    elif isinstance(x, (bytes, bytearray)):
        h.update(b"B%d:" % len(x))
        h.update(bytes(x))
    elif type(x).__module__ == "numpy" and hasattr(x, "tobytes"):
        h.update(f"N{x.dtype}{getattr(x, 'shape', ())}:".encode())
        h.update(x.tobytes())
    else:
        h.update(f"{type(x).__name__}:{x!r};".encode())


def digest(x):
    h = hashlib.blake2b(digest_size=12)
    feed(h, x)
    return h.hexdigest()


def mass_of(sd):
    """What holds gradient mass in an OkTopkState.state_dict(), per group:
    the library's state of each group (residual and thresholds), each
    quantized group's residuals (and whether they are all zero: a group
    a step made afresh), the groups a native step must fold, and the
    momentum correction's velocities."""
    quantized = {}
    for k, v in sd.get("quantized", {}).items():
        zero = not bool(v["residual"].any()) and not bool(v["owner_residual"].any())
        quantized[str(k)] = [digest([v["residual"], v["owner_residual"]]), zero]
    return {"tensors": {str(k): digest(v) for k, v in sd.get("tensors", {}).items()}, "quantized": quantized,
            "residual_groups": sorted(str(g) for g in sd.get("residual_groups", [])), "momentum": digest(sd.get("momentum"))}


# -- one training run --------------------------------------------------------

class Run:
    """A model, its optimizer and (but for DeMo) its OkTopkState, on the
    job's process group, as the job's config says:

    front: "ddp" | "fsdp" | "demo"; optimizer: "sgd" | "sgdm" | "adamw";
    model: "small" | "deep"; state: OkTopkState's keyword arguments (or
    DeMo's for demo); schedule: a SCHEDULES name."""

    def __init__(self, ctx, cfg, overrides=None):
        import torch
        import torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel as DDP

        import oktopk

        self.ctx, self.cfg = ctx, cfg
        self.torch = torch
        self.front = cfg["front"]
        rank, group = ctx.rank, ctx.group
        kwargs = dict(cfg.get("state", {}))
        kwargs.update(overrides or {})
        for key in ("density_schedule", "adaptive"):
            if isinstance(kwargs.get(key), list):
                kwargs[key] = tuple(kwargs[key])
        net = (deep_model if cfg.get("model") == "deep" else small_model)(torch, nn)
        self.state = None
        if self.front == "fsdp":
            from torch.distributed.fsdp import fully_shard

            import oktopk.fsdp

            for layer in net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=ctx.mesh)
            fully_shard(net, mesh=ctx.mesh)
            self.model, self.module = net, net
            self.state = oktopk.OkTopkState(process_group=group, **kwargs)
            self.registration = oktopk.fsdp.register(net, self.state)
        else:
            bucket = {"bucket_cap_mb": 0.002} if cfg.get("model") == "deep" else {}
            self.model = DDP(net, process_group=group, **bucket)
            self.module = net
            if self.front == "ddp":
                self.state = oktopk.OkTopkState(process_group=group, **kwargs)
                self.model.register_comm_hook(self.state, oktopk.oktopk_hook)
        if self.front == "demo":
            import oktopk.optim

            self.opt = oktopk.optim.DeMo(self.model, **kwargs)
        else:
            params = self.model.parameters()
            name = cfg.get("optimizer", "sgd")
            if name == "adamw":
                self.opt = torch.optim.AdamW(params, lr=1e-2)
            elif name == "sgdm":
                self.opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
            else:
                self.opt = torch.optim.SGD(params, lr=0.05)
        self.schedule = SCHEDULES[cfg.get("schedule", "none")]
        self.warmup = self.state.warmup_iters if self.state is not None else 0
        # The warm-up step the choice times as native (s = -1 of the cost
        # schedules): the last one, or DDP's second with a compressed warm-up.
        self.timed_warmup = -1
        if self.state is not None:

            self.timed_warmup = self.state.timed_warmup_step()
        self.paths = {}
        self.algorithms, self._counts = {}, {}
        self.inject = None  # (step, value) on this rank: a non-finite value into the hidden activation's gradient
        self.pause_at = None  # the step at whose start this rank (a kill's or stop's victim) waits for the campaign
        self.step_now = None
        hidden = self.module[0]

        def poison(module, inputs, output):
            if self.inject is None or self.step_now != self.inject[0] or not output.requires_grad:
                return None

            def hook(grad):
                grad = grad.clone()
                grad.view(-1)[5] = self.inject[1]
                return grad

            output.register_hook(hook)
            return None

        if self.front != "demo":
            hidden.register_forward_hook(poison)

    # -- what the run holds ---------------------------------------------

    def params_digest(self):
        return digest([p for p in self.model.parameters()])

    def path_counts(self):
        if self.state is None or self.state.choice is None:
            return None
        return dict(self.state.choice["steps"])

    def mass(self):
        """The digests of what holds gradient mass on this rank, or
        {"error": ...} when the plugin's state_dict() raises."""
        try:
            if self.front == "demo":
                sd = self.opt.state_dict()["oktopk"]
                return {"momentum": digest(self.opt.momentum), "library_state": digest(sd["library_state"])}
            return mass_of(self.state.state_dict())
        except Exception as e:  # noqa: BLE001 - a finding: the campaign reports it
            return {"error": f"{type(e).__name__}: {e}"[:500]}

    def checkpoint(self):
        """Everything a resumed run needs, in memory."""
        out = {"opt": self.opt.state_dict()}
        if self.front == "fsdp":
            out["model"] = {name: p.to_local().detach().clone() for name, p in self.model.named_parameters()}
        else:
            out["model"] = self.module.state_dict()
        if self.state is not None:
            out["oktopk"] = self.state.state_dict()
        return out

    def load(self, saved):
        torch = self.torch
        if self.front == "fsdp":
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.to_local().copy_(saved["model"][name])
        else:
            self.module.load_state_dict(saved["model"])
        self.opt.load_state_dict(saved["opt"])
        if self.state is not None:
            self.state.load_state_dict(saved["oktopk"])

    def close(self):
        if self.state is not None:
            self.state.close()
        if self.front == "demo":
            self.opt.close()

    # -- training ---------------------------------------------------------

    def step(self, g, progress=False):
        """Step g: forward, backward, the optimizer's step unless a gradient
        is not finite (as GradScaler skips it), then the schedule's sleep.
        Returns (finite, path). Raises what the step raises."""
        torch = self.torch
        import torch.nn.functional as F

        self.step_now = g
        if progress:
            send({"ev": "step", "step": g, "t": time.monotonic()})
        before = self.path_counts()
        self.pending = (g, before)
        if self.pause_at == g:
            sys.stdin.readline()  # the campaign's go: the fault lands this far into step g
        x, y = batch(torch, self.ctx.rank, g)
        self.opt.zero_grad(set_to_none=True)
        F.cross_entropy(self.model(x), y).backward()
        if self.front == "demo":
            if self.inject is not None and self.inject[0] == g:
                self.module[0].weight.grad.view(-1)[5] = self.inject[1]
            skipped = self.opt.skipped_steps
            self.opt.step()
            finite = self.opt.skipped_steps == skipped
            path = "demo"
        else:
            finite = all(bool(torch.isfinite(p.grad).all()) for p in self.model.parameters() if p.grad is not None)
            if finite:
                self.opt.step()
            path = self.path_of(g, before)
        self.paths[g] = path
        if self.state is not None:  # the library calls of this step, by algorithm ("auto": the one it chose)
            counts = dict(self.state.algorithm_counts)
            self.algorithms[g] = {a: n - self._counts.get(a, 0) for a, n in counts.items() if n != self._counts.get(a, 0)}
            self._counts = counts
        s = g - self.warmup if g >= self.warmup else -1 if g == self.timed_warmup else -2
        time.sleep(self.schedule(path, s))
        return finite, path

    def failing_path(self):
        """The path of the step that raised (begun at its first bucket)."""
        g, before = self.pending
        if self.front == "demo":
            return "demo"
        try:
            path = self.path_of(g, before)
        except Exception:  # noqa: BLE001
            path = "?"
        # No path counted: the step failed before its first bucket took one
        # (the choice's agreement at a decision, or DDP's forward).
        return "agreement or forward" if path == "?" else path

    def path_of(self, g, before):
        if g < self.warmup:
            return "warm-up"
        if before is None:
            return "sparse"  # a named algorithm: sparse on every step after the warm-up
        after = self.path_counts()
        taken = [p for p in after if after[p] != before.get(p, 0)]
        return taken[0] if len(taken) == 1 else "?"


def error_info(e, g, started):
    text = f"{type(e).__name__}: {e}"
    return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "msg": text[:2000], "step": g,
            "t": time.monotonic(), "seconds": time.monotonic() - started}


# -- the jobs ----------------------------------------------------------------

def job_fault_run(ctx, job):
    """sigkill, sigstop (the campaign does the killing), nan, inf: one
    run of ``steps`` steps. The NaN/Inf rank poisons its gradient at
    ``inject_step``; every rank records its mass before and after that step
    and whether the step's gradient was finite. On a failure, the mass and
    (DeMo) the momentum and parameters after it against before it."""
    run = Run(ctx, job["cfg"])
    inject = job.get("inject")
    if inject is not None and ctx.rank == inject["rank"]:
        run.inject = (inject["step"], float(inject["value"]))
    watch_failure = job["kind"] in ("sigkill", "sigstop")
    if watch_failure and job["fault"]["victim"] == ctx.rank:
        run.pause_at = job["fault"]["step"]
    result = {"error": None, "finite": {}, "paths": run.paths}
    before = None
    for g in range(job["steps"]):
        if inject is not None and g == inject["step"]:
            result["mass_before"] = run.mass()
        if watch_failure:
            before = {"mass": run.mass(), "params": run.params_digest()}
        started = time.monotonic()
        try:
            finite, _ = run.step(g, progress=job.get("progress", False))
        except Exception as e:  # noqa: BLE001 - what the step raises is the finding
            result["error"] = error_info(e, g, started)
            result["failing_path"] = run.failing_path()
            if watch_failure and before is not None:
                try:
                    result["after_failure"] = {"mass": run.mass(), "params": run.params_digest()}
                    result["before_failure"] = before
                except Exception as e2:  # noqa: BLE001
                    result["after_failure_error"] = f"{type(e2).__name__}: {e2}"[:500]
            break
        result["finite"][g] = finite
        if inject is not None and g == inject["step"]:
            result["mass_after"] = run.mass()
            result["inject_seconds"] = time.monotonic() - started
    result["params"] = run.params_digest()
    result["steps_done"] = len(result["finite"])
    if result["error"] is None:
        run.close()
    return result


def job_mismatch(ctx, job):
    """Each rank makes its state with its own value of one setting (or,
    for "resume", loads a checkpoint of its own step); the first steps must
    fail on every rank, naming the setting."""
    result = {"error": None}
    cfg = job["cfg"]
    mine = job["values"][ctx.rank]
    if job["setting"] in ("resume-step", "resume-fresh"):
        return mismatch_resume(ctx, job)
    change_at = job.get("change_at")
    if job["setting"] == "optimizer_family":
        cfg = dict(cfg, optimizer=mine)
        run = Run(ctx, cfg)
    elif change_at is not None:
        run = Run(ctx, cfg)  # every rank alike until change_at
    else:
        run = Run(ctx, cfg, {job["setting"]: mine})
    for g in range(job["steps"]):
        if g == change_at:
            run.opt.param_groups[0][job["setting"]] = mine  # DeMo: a scheduler's or a hand's change, on one rank
        started = time.monotonic()
        try:
            run.step(g)
        except Exception as e:  # noqa: BLE001
            result["error"] = error_info(e, g, started)
            break
    result["params"] = run.params_digest()
    return result


def mismatch_resume(ctx, job):
    """Train, saving after two steps; then every rank resumes from its own
    checkpoint, the victim from another step's (or from none)."""
    cfg = job["cfg"]
    run = Run(ctx, cfg)
    saved = {}
    for g in range(job["save_steps"][-1] + 1):
        run.step(g)
        if g + 1 in job["save_steps"]:
            saved[g + 1] = copy.deepcopy(run.checkpoint())
    run.close()
    cut = job["values"][ctx.rank]
    resumed = Run(ctx, cfg)
    if cut is not None:
        resumed.load(saved[cut])
    result = {"error": None}
    first = cut if cut is not None else 0
    for g in range(first, first + 3):
        started = time.monotonic()
        try:
            resumed.step(g)
        except Exception as e:  # noqa: BLE001
            result["error"] = error_info(e, g, started)
            break
    result["params"] = resumed.params_digest()
    return result


def save_to(path, obj):
    import torch

    torch.save(obj, path)


def flip_in_file(path, payload, rng, blob):
    """Flip one bit of ``payload`` where torch.save wrote it in the file: a
    tensor's storage verbatim, a bytes blob as pickle protocol 2 writes
    bytes (latin-1 text, UTF-8 encoded: only an ASCII byte is flipped, to
    another ASCII byte, so that the file still loads). The payload is
    found by a window of it that occurs once in the file; None when it
    has none (all zeros, say)."""
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    encoded = bytes(payload).decode("latin-1").encode("utf-8") if blob else bytes(payload)
    width = min(len(encoded), 64)
    at = None
    for i in range(0, max(1, len(encoded) - width + 1), width):
        window = encoded[i : i + width]
        if window and raw.count(window) == 1:
            start = raw.find(window) - i
            if start >= 0 and raw[start : start + len(encoded)] == encoded:
                at = start
                break
    if at is None:
        return None
    if blob:
        ascii_at = [at + i for i, b in enumerate(encoded) if b < 0x80]
        if not ascii_at:
            return None
        offset = rng.choice(ascii_at)
        raw[offset] ^= 1 << rng.randrange(7)
    else:
        offset = at + rng.randrange(len(encoded))
        raw[offset] ^= 1 << rng.randrange(8)
    with open(path, "wb") as f:
        f.write(raw)
    return offset


def leaves(x, path=()):
    """(path, value) of every leaf of a nested checkpoint dict."""
    if isinstance(x, dict):
        for k in sorted(x, key=repr):
            yield from leaves(x[k], path + (k,))
    elif isinstance(x, (list, tuple)) and x and not all(isinstance(v, (int, float, str)) for v in x):
        for i, v in enumerate(x):
            yield from leaves(v, path + (i,))
    else:
        yield path, x


def get_at(x, path):
    for k in path:
        x = x[k]
    return x


def set_at(x, path, value):
    for k in path[:-1]:
        x = x[k]
    if isinstance(x, tuple):
        raise TypeError("tuple")
    x[path[-1]] = value


def payloads(sd):
    """The leaves that hold bytes: tensors (non-empty) and blobs."""
    import torch

    out = []
    for path, v in leaves(sd):
        if isinstance(v, torch.Tensor) and v.numel() > 0:
            out.append(path)
        elif isinstance(v, (bytes, bytearray)) and len(v) > 0:
            out.append(path)
    return out


def edited(v, rng):
    """Another value of a scalar field's type, or None when it has none."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + rng.choice([1, -1, 7])
    if isinstance(v, float):
        return v * 1.5 + 0.01 if v == v else 0.5
    if isinstance(v, str):
        return v + "x" if v != "checksum" else v[::-1]
    if v is None:
        return 0
    if isinstance(v, list):
        return v[:-1] if v else [0]
    if isinstance(v, tuple):
        return tuple(v[:-1]) if v else (0,)
    return None


def corrupt(sd, spec, rng, workdir, rank):
    """A corrupted copy of checkpoint dict ``sd`` (the plugin's own part),
    as ``spec["how"]`` says; returns (copy, what was changed)."""
    import torch

    how = spec["how"]
    bad = copy.deepcopy(sd)
    if how in ("byte", "file") and not payloads(bad):
        # Nothing holds bytes at this step (a loaded machine's timing chose
        # native early, and every residual was folded): a field is edited
        # instead, which the checksum must catch all the same.
        how = "field"
    if how == "byte":
        path = rng.choice(payloads(bad))
        v = get_at(bad, path)
        if isinstance(v, torch.Tensor):
            flat = v.view(-1).view(torch.uint8) if v.is_contiguous() else None
            if flat is None:
                v = v.contiguous()
                set_at(bad, path, v)
                flat = v.view(-1).view(torch.uint8)
            i = rng.randrange(flat.numel())
            flat[i] ^= 1 << rng.randrange(8)
        else:
            b = bytearray(v)
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
            set_at(bad, path, bytes(b))
        return bad, "bit of " + "/".join(map(str, path))
    if how == "field":
        fields = []
        for path, v in leaves(bad):
            if isinstance(v, (torch.Tensor, bytes, bytearray)):
                continue
            if edited(v, rng) is not None:
                fields.append(path)
        if spec.get("field") == "checksum-dropped":
            del bad["checksum"]
            return bad, "checksum dropped"
        path = rng.choice(fields)
        v = get_at(bad, path)
        try:
            set_at(bad, path, edited(v, rng))
        except TypeError:  # inside a tuple: replace the tuple
            parent = get_at(bad, path[:-1])
            items = list(parent)
            items[path[-1]] = edited(items[path[-1]], rng)
            set_at(bad, path[:-1], tuple(items))
        return bad, "field " + "/".join(map(str, path)) + f" ({v!r} edited)"
    if how == "file":
        file = os.path.join(workdir, f"ckpt-{rank}-{rng.randrange(10**9)}.pt")
        save_to(file, bad)
        paths = payloads(bad)
        rng.shuffle(paths)
        for path in paths:
            v = get_at(bad, path)
            raw = v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if isinstance(v, torch.Tensor) else bytes(v)
            if len(raw) >= 16 and flip_in_file(file, raw, rng, blob=not isinstance(v, torch.Tensor)) is not None:
                loaded = torch.load(file, weights_only=False)
                os.unlink(file)
                return loaded, "file byte of " + "/".join(map(str, path))
        os.unlink(file)
        raise RuntimeError(f"no payload found in the saved file (payloads: {['/'.join(map(str, p)) for p in paths]})")
    raise ValueError(how)


def plugin_part(run, saved):
    """The part of a checkpoint the plugin saves and checksums."""
    return saved["opt"]["oktopk"] if run.front == "demo" else saved["oktopk"]


def load_plugin_part(run, saved, part):
    """Load a checkpoint whose plugin part is ``part`` into ``run`` the way
    a script does: DeMo through the optimizer, the hook through its state."""
    if run.front == "demo":
        sd = dict(saved["opt"])
        sd["oktopk"] = part
        run.opt.load_state_dict(sd)
    else:
        run.state.load_state_dict(part)


def job_corrupt(ctx, job):
    """Train, save a checkpoint, then for each corruption: load the
    corrupted copy into a fresh run and into the live one; both must refuse
    it, naming the checksum, and the live one must be as it was. The intact
    checkpoint must load, and training goes on."""
    rng = random.Random(job["seed"] * 1000 + ctx.rank)
    cfg = job["cfg"]
    run = Run(ctx, cfg)
    for g in range(job["steps"]):
        run.step(g)
    saved = run.checkpoint()
    part = plugin_part(run, saved)
    result = {"faults": [], "error": None}
    fresh = Run(ctx, cfg)
    try:
        load_plugin_part(fresh, saved, copy.deepcopy(part))  # the intact one loads
        result["intact_loads"] = True
    except Exception as e:  # noqa: BLE001
        result["intact_loads"] = f"{type(e).__name__}: {e}"[:500]
    for spec in job["corruptions"]:
        bad, what = corrupt(part, spec, rng, ctx.workdir, ctx.rank)
        if spec.get("victim") is not None and spec["victim"] != ctx.rank:
            bad, what = copy.deepcopy(part), f"intact here, rank {spec['victim']}'s corrupt ({what})"
        entry = {"how": spec["how"], "what": what}
        for target in ("fresh", "live"):
            r = fresh if target == "fresh" else run
            before = digest(r.checkpoint())
            started = time.monotonic()
            try:
                load_plugin_part(r, saved, bad)
                entry[target] = None  # accepted
            except Exception as e:  # noqa: BLE001
                entry[target] = error_info(e, None, started)
            entry[target + "_changed"] = digest(r.checkpoint()) != before
        result["faults"].append(entry)
    fresh.close()
    for g in range(job["steps"], job["steps"] + 2):
        run.step(g)  # the live run goes on, unharmed
    result["params"] = run.params_digest()
    run.close()
    return result


def job_resume(ctx, job):
    """The whole run, saving after each cut; then, for each cut, a fresh
    model, optimizer and state loaded from it and run to the end: its
    paths, final parameters and mass against the whole run's."""
    import torch

    cfg = job["cfg"]
    steps, cuts = job["steps"], job["cuts"]
    run = Run(ctx, cfg)
    files, choice_at = {}, {}
    for g in range(steps):
        run.step(g)
        if g + 1 in cuts:
            try:
                saved = run.checkpoint()
            except Exception as e:  # noqa: BLE001 - a finding: no checkpoint at this step
                run.close()
                return {"error": error_info(e, g + 1, time.monotonic()), "checkpoint_failed": True, "warmup": run.warmup,
                        "whole": {"paths": dict(run.paths)}, "resumed": {}, "choice_at": {}}
            if run.front == "fsdp":
                files[g + 1] = copy.deepcopy(saved)
            else:
                files[g + 1] = os.path.join(ctx.workdir, f"resume-{job['id']}-{ctx.rank}-{g + 1}.pt")
                torch.save(saved, files[g + 1])
            if "oktopk" in saved and saved["oktopk"].get("choice") is not None:
                c = saved["oktopk"]["choice"]
                choice_at[g + 1] = {"chosen": c["chosen"], "decided_at": c["decided_at"], "confirm_at": c["confirm_at"]}
    whole = {"params": run.params_digest(), "mass": run.mass(), "paths": dict(run.paths), "algorithms": dict(run.algorithms)}
    run.close()
    result = {"whole": whole, "choice_at": choice_at, "resumed": {}, "warmup": run.warmup, "error": None}
    for cut in cuts:
        resumed = Run(ctx, cfg)
        saved = files[cut] if isinstance(files[cut], dict) else torch.load(files[cut], weights_only=False)
        entry = {"error": None}
        g = cut
        started = time.monotonic()
        try:
            resumed.load(saved)
            for g in range(cut, steps):
                started = time.monotonic()
                resumed.step(g)
            entry.update(params=resumed.params_digest(), mass=resumed.mass(), paths=dict(resumed.paths), algorithms=dict(resumed.algorithms))
        except Exception as e:  # noqa: BLE001
            entry["error"] = error_info(e, g, started)
            result["resumed"][str(cut)] = entry
            break  # the ranks may now be out of step: no further cut
        resumed.close()
        result["resumed"][str(cut)] = entry
    return result


def job_record(ctx, job):
    """One run, recorded after every step for a comparison of two versions
    of the code (tests/chaos_torch/bits.py): the path, whether the step was
    finite, and the digests of the gradients the optimizer stepped on, the
    parameters and what holds gradient mass (residuals, thresholds,
    quantized residuals, velocities; DeMo: its momentum and library
    state)."""
    run = Run(ctx, job["cfg"])
    steps = []
    for g in range(job["steps"]):
        finite, path = run.step(g)
        steps.append({"path": path, "finite": finite, "grads": digest([p.grad for p in run.model.parameters()]),
                      "params": run.params_digest(), "mass": digest(run.mass())})
    run.close()
    return {"steps": steps}


JOBS = {"fault_run": job_fault_run, "mismatch": job_mismatch, "corrupt": job_corrupt, "resume": job_resume, "record": job_record}


class Context:
    pass


def main():
    global PROTO
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    PROTO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import torch
    import torch.distributed as dist

    import oktopk  # noqa: F401 - the library loads now, not in the first job
    import oktopk.fsdp  # noqa: F401
    import oktopk.optim  # noqa: F401
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=120))
    send({"ev": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("exit"):
            break
        ctx = Context()
        ctx.rank, ctx.world, ctx.workdir = args.rank, args.world, args.workdir
        print(f"--- job {job['id']} ({job['kind']}): {json.dumps(job)[:400]}", flush=True)
        ctx.group = dist.new_group(list(range(args.world)), timeout=datetime.timedelta(seconds=job["pg_timeout"]), backend="gloo")
        # Every rank at the job's start under the session's long timeout:
        # the job's short one is for its faults, and a rank that read its
        # job a few seconds after the others (a loaded machine) would
        # otherwise time out in DDP's first collective.
        dist.barrier()
        if job["cfg"]["front"] == "fsdp":
            shards = [dist.new_group([r], backend="gloo") for r in range(args.world)]
            ctx.mesh = DeviceMesh.from_group(shards[args.rank], "cpu")
        try:
            result = JOBS[job["type"]](ctx, job)
        except Exception as e:  # noqa: BLE001 - the harness's own failure, reported as such
            traceback.print_exc()
            result = {"harness_error": f"{type(e).__name__}: {e}"[:2000]}
        print(f"--- job {job['id']} done: {json.dumps(result, default=str)[:600]}", flush=True)
        send({"ev": "done", "id": job["id"], "result": result})
        if job.get("last"):
            break
    sys.stderr.flush()
    # No orderly teardown: a job that failed on purpose leaves collectives
    # behind, and gloo's threads can abort the interpreter's finalization
    # (tests/python/workers.py, exit_when_done).
    os._exit(0)


if __name__ == "__main__":
    main()
