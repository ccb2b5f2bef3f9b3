"""Optimizers that own their exchange: methods whose update is not "the
average gradient, then the optimizer", so they cannot live in a gradient
hook alone.

``DeMo`` is Decoupled Momentum optimization (Peng, Quesnelle, Kingma 2024)
with its exchange carried by Ok-Topk (Li & Hoefler, PPoPP'22). Each rank
keeps its own momentum, with the learning rate folded in, and sends a few
DCT coefficients of it per step; every rank applies the sign of the same
reduced momentum, so every coordinate moves every step (no bursts, which
is what stalls top-k under Adam) while a step sends about 1% of the
values.

One step, P ranks, n parameters (``ChunkedDCT``'s blocks: 64 x 64 for a
matrix, 64 for a vector):

1. d = 0.999 d + lr · DCT(g): the momentum, kept in DCT coefficients (the
   transform is orthonormal and linear, so this is DeMo's d, transformed);
   g is this rank's own gradient (no gradient allreduce).
2. Selection: the ``topk`` (64) largest |d| of every block (about 1.6% of a
   matrix's coefficients; all of a vector of at most 64).
3. Ok-Topk's reduction of the selections (the library's caller-selected
   call): split and reduce, global top-k, balance and allgatherv: every
   rank gets the same averaged sparse result, at most 6k words per rank
   whatever P (DeMo's own all-gather costs P · k).
4. Error feedback on the momentum, Ok-Topk's rule: d loses exactly what
   this rank sent of the global result; a coefficient it selected that the
   global selection dropped stays in d.
5. p = p (1 - lr · wd) - lr · sign(IDCT(result)).

Where DeMo averages each coefficient over the ranks that sent it, Ok-Topk
divides the sum by P; bench/adam_sim.py measured both (results/text.md).

Use::

    model = DDP(net)                                        # as before
    opt = oktopk.optim.DeMo(model, lr=3e-3, weight_decay=0.01)  # was torch.optim.AdamW(model.parameters(), ...)

Given a DDP module, DeMo turns DDP's gradient allreduce off (a comm hook
that returns the local gradient at once), since it exchanges the
momentum instead; given parameters, the caller runs backward under
``no_sync()`` (or without DDP). Clipping ``clip_grad_norm_`` before
``step`` clips the local gradient. Learning-rate schedulers work as with
any torch optimizer. The sign update wants a smaller learning rate than
AdamW's (results/text.md has the sweep).

Under HSDP (FSDP2 sharding within a replica, replicas across the slow
links), shard over the shard dimension only and give DeMo the replicate
group: FSDP2 reduce-scatters each gradient within the replica, and DeMo
exchanges the momentum of this rank's shards with the ranks that hold the
same shards::

    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = oktopk.optim.DeMo(model.parameters(), lr=3e-3, process_group=mesh.get_group("replicate"))

Its blocks are then those of each local shard (a shard is a matrix of
whole rows), so a sharded run selects other coefficients than an
unsharded one; replicas of a shard end bitwise identical.
"""

import math
import warnings

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch before 2.4 (Horovod's): no FSDP2 either
    DTensor = None

from .comm import value_dtype_name
from .device import HostBuffers, selected_call
from . import _lib
from .settings import (MAX_INT32, check_agreement, check_checksum, check_process_group, is_int, is_real, process_group_agreement,
                       settings_digest, with_checksum)
from .transforms import ChunkedDCT

MOMENTUM_DECAY = 0.999  # DeMo's compression_decay
TOPK = 64  # coefficients kept per block (DeMo's public code: 32; 64 measured better, results/text.md)
CHUNK = 64  # a block's side
# The coefficients' format by default (results/wire.md, "DeMo with 8- and
# 4-bit coefficients"): a quarter of float32's bytes, the loss held over 3
# seeds at 400 and 1,200 steps.
DEFAULT_VALUE_DTYPE = "int8"
TENSOR_ID = 0x44654D6F  # the library's state of the flat coefficient vector ("DeMo")
# The largest block side: the transform keeps a chunk x chunk matrix per side
# (4 MiB at 1024; a chunk of 10**6 would ask for terabytes).
MAX_CHUNK = 1024
# Where a step would send at least half of plain DDP's bytes (an index and
# a value for each selected coefficient, 8 bytes against DDP's 4 a value),
# the constructor warns: dimensions with few divisors up to ``chunk`` make
# small blocks, and a block no larger than topk is sent whole.
WARN_DENSITY = 0.25


def _check_rate(name, value, where=""):
    """lr and weight_decay: finite numbers >= 0 (lr=inf would make every
    step's update non-finite and be skipped, silently; weight_decay=inf
    would make the parameters so)."""
    if not (is_real(value) and 0 <= value < math.inf):
        raise ValueError(f"oktopk: {where}{name} must be a finite number >= 0, got {value!r}")


def _local(t):
    """A plain tensor's self, a DTensor's (an FSDP2 shard's) local values:
    DeMo works on what this rank holds."""
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def _check_shards(params, process_group):
    """FSDP2 shards are DeMo's only when it exchanges over the replicas:
    over the default group it would mix different shards, and under a 2-D
    (native HSDP) mesh FSDP2 has already all-reduced them densely."""
    sharded = [p for p in params if DTensor is not None and isinstance(p, DTensor)]
    if not sharded:
        return
    if any(p.device_mesh.ndim != 1 for p in sharded):
        raise ValueError(
            "oktopk: DeMo's parameters are sharded over a 2-D mesh (native HSDP), so FSDP2 all-reduces their "
            "gradients densely first; shard over the shard dimension only (fully_shard(module, mesh=mesh['shard'])) "
            "and pass process_group=mesh.get_group('replicate')"
        )
    if process_group is None:
        raise ValueError(
            "oktopk: DeMo's parameters are FSDP2 shards: pass the replicas' group, "
            "process_group=mesh.get_group('replicate'), so that each shard is exchanged with its own replicas"
        )



def _connect_through(collectives, value_dtype="float32"):
    """DeMo's ``communicator`` callable over ``collectives``: the Ok-Topk
    algorithm, made at the first step (every rank at once)."""
    def connect(density, timeout):
        return collectives.communicator("oktopk", density, timeout=timeout, value_dtype=value_dtype)

    return connect


def _local_gradient_hook(state, bucket):
    """DDP comm hook that communicates nothing: the bucket keeps this rank's
    own gradient (DeMo exchanges the momentum in ``step``)."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class DeMo(torch.optim.Optimizer):
    """DeMo over Ok-Topk (see the module's text).

    :param params: a DDP module (its gradient allreduce is turned off and
        its process group used) or an iterable of parameters or groups.
    :param lr: learning rate (the sign step's size).
    :param weight_decay: decoupled, as AdamW's: p *= 1 - lr · wd.
    :param momentum_decay: d's decay per step (DeMo's 0.999).
    :param topk: coefficients selected per block.
    :param chunk: the largest side of a block.
    :param process_group: the ranks that exchange (default: the DDP
        module's, else the default group).
    :param timeout: seconds a step's exchange may take (the library's
        default when None).
    :param value_dtype: the format the selected coefficients travel in:
        ``"int8"`` (8-bit codes with a scale per 32 values: the default
        where the exchange goes through a process group or
        ``collectives``), ``"float32"`` (the default with
        ``communicator``, which makes its own communicator),
        ``"float16"``, ``"bfloat16"`` or ``"int4"``. What the rounding
        takes off a coefficient stays in the momentum, as what was not
        selected does. int8 sends about a quarter of float32's bytes and
        held its loss over 3 seeds at 400 and 1,200 steps on the charlm
        (results/wire.md).
    :param communicator: how to connect the ranks, for a job without a
        torch process group: a callable taking (density, timeout) and
        returning an ``oktopk.Communicator`` with the Ok-Topk algorithm
        (``oktopk_horovod.DeMo`` passes one over Horovod's collectives).
    :param agreement: with ``communicator``, how the ranks compare their
        settings at the first step: ``(gather_digests, gather_settings)``
        as ``oktopk.settings.check_agreement`` takes them (without it, the
        process group's collectives).
    :param collectives: for a job without a torch process group, in place
        of ``communicator`` and ``agreement``: an :class:`oktopk.Collectives`
        over its ranks, which makes the communicator and runs the
        agreements (``oktopk_horovod.DeMo`` passes Horovod's).

    Raises ``ValueError`` on a bad setting, ``OkTopkError`` when an
    exchange fails (a dead or slow peer, a mismatched call): the momentum
    and the parameters are then unchanged. A step where any rank's
    gradient holds NaN or Inf is skipped on every rank, with nothing
    changed (``skipped_steps`` counts them).

    Example::

        model = DDP(net)
        opt = oktopk.optim.DeMo(model, lr=3e-3, weight_decay=0.01)
        for x, y in data:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    """

    def __init__(self, params, lr=1e-3, weight_decay=0.0, momentum_decay=MOMENTUM_DECAY, topk=TOPK, chunk=CHUNK,
                 process_group=None, timeout=None, communicator=None, agreement=None, collectives=None, value_dtype=None):
        _check_rate("lr", lr)
        _check_rate("weight_decay", weight_decay)
        if not (is_real(momentum_decay) and 0 <= momentum_decay < 1):
            raise ValueError(f"oktopk: momentum_decay must be a number in [0, 1), got {momentum_decay!r}")
        if not (is_int(chunk) and 1 <= chunk <= MAX_CHUNK):
            raise ValueError(f"oktopk: chunk must be an int in [1, {MAX_CHUNK}] (the transform holds a chunk x chunk matrix "
                             f"per block side), got {chunk!r}")
        if not (is_int(topk) and 1 <= topk <= chunk * chunk):
            raise ValueError(f"oktopk: topk must be an int in [1, chunk * chunk] = [1, {chunk * chunk}] "
                             f"(the coefficients of the largest block), got {topk!r}")
        if timeout is not None and not (is_real(timeout) and 0 < timeout <= MAX_INT32 / 1000):
            raise ValueError(f"oktopk: timeout must be None or a number of seconds in (0, {MAX_INT32 // 1000}], got {timeout!r}")
        if communicator is not None and not callable(communicator):
            raise ValueError(f"oktopk: communicator must be None or a callable (density, timeout) -> Communicator, got {communicator!r}")
        if value_dtype is None:
            value_dtype = "float32" if communicator is not None else DEFAULT_VALUE_DTYPE
        value_dtype = value_dtype_name(value_dtype)  # ValueError naming the formats
        if communicator is not None and value_dtype != "float32":
            raise ValueError(f"oktopk: value_dtype {value_dtype} needs process_group or collectives: a communicator callable "
                             "makes its communicator, and the format with it")
        if collectives is not None:
            if communicator is not None or agreement is not None or process_group is not None:
                raise ValueError("oktopk: DeMo takes collectives in place of communicator, agreement and process_group: pass one way")
            communicator = _connect_through(collectives, value_dtype)
        process_group = check_process_group(process_group)
        ddp = params if isinstance(params, torch.nn.parallel.DistributedDataParallel) else None
        if ddp is not None:
            ddp.register_comm_hook(None, _local_gradient_hook)
            if process_group is None:
                process_group = ddp.process_group
            params = [p for p in ddp.parameters() if p.requires_grad]
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self._check_groups()
        self.momentum_decay, self.topk, self.chunk = float(momentum_decay), topk, chunk
        self.process_group, self.timeout, self._connect = process_group, timeout, communicator
        self.value_dtype = value_dtype
        self._agreement = agreement
        self._collectives = collectives
        self._default_timeout = None  # the library's, read at the first wait that needs it
        self._params = [p for group in self.param_groups for p in group["params"]]
        _check_shards(self._params, process_group)
        for p in self._params:
            if not p.is_floating_point():
                raise ValueError(f"oktopk: DeMo steps floating-point parameters, got {p.dtype}")
        if len({p.device for p in self._params}) > 1:
            raise ValueError("oktopk: DeMo's parameters must all be on one device")
        self.transform = ChunkedDCT([_local(p).shape for p in self._params], chunk)
        self.n = self.transform.numel
        device = _local(self._params[0]).device if self._params else torch.device("cpu")
        self.transform.to(device)
        self.selected = sum(blocks * min(topk, length) for _, blocks, length in self.transform.blocks())
        # Parameters of at most topk values are sent whole by design; the
        # surprise is a large one whose dimensions split into small blocks.
        whole = sorted({tuple(_local(p).shape) for p, (_, rows, cols, r, c) in zip(self._params, self.transform.parts)
                        if r * c <= topk < rows * cols})
        if whole and self.density >= WARN_DENSITY:
            warnings.warn(
                f"oktopk: DeMo selects {self.density:.0%} of the coefficients each step, so each step sends about "
                f"{2 * self.density:.2g}x plain DDP's bytes (an index and a value per coefficient): the parameters shaped "
                f"{', '.join(map(str, whole))} split into blocks of at most topk={topk} coefficients "
                f"(their dimensions have no larger divisor up to chunk={chunk}), which are sent whole. Pad or reshape those "
                f"dimensions to multiples of a number up to chunk, or leave those parameters to another optimizer.",
                stacklevel=2)
        self.momentum = torch.zeros(self.n, dtype=torch.float32, device=device)  # d, in DCT coefficients
        self.steps = 0  # exchanges completed
        self.skipped_steps = 0  # steps skipped for a NaN or Inf
        self.bytes_sent = 0  # by this rank's exchanges, indices included
        self._comm = None
        self._pending_library_state = None  # a checkpoint's, installed once the communicator exists
        self._host = HostBuffers()

    def _check_groups(self):
        """Every param group's lr and weight_decay (a scheduler or the
        caller may set them between steps): ValueError naming the group."""
        for i, group in enumerate(self.param_groups):
            for name in ("lr", "weight_decay"):
                _check_rate(name, group[name], where=f"param_groups[{i}]: ")

    @property
    def density(self):
        """The share of the coefficients each rank selects per step."""
        return self.selected / self.n if self.n else 0.0

    def _communicator(self):
        if self._comm is None:
            if self._connect is not None:
                self._comm = self._connect(self.density, self.timeout)
            else:
                from .comm import Communicator

                self._comm = Communicator(self.process_group, algorithm="oktopk", density=self.density, timeout=self.timeout,
                                          value_dtype=self.value_dtype)
            if self._pending_library_state is not None:
                host = torch.empty(self.n, dtype=torch.float32)
                self._comm.load_tensor_state_residual(TENSOR_ID, self._pending_library_state, host)
                self.momentum.copy_(host)
                self._pending_library_state = None
        return self._comm

    def _agreement_functions(self, what):
        """(gather_digests, gather_settings) across the ranks that exchange,
        or None for a job of one process (no process group, no agreement
        given). Over a process group the digests' gather waits at most the
        library's timeout."""
        if self._agreement is not None:
            return self._agreement
        if self._collectives is not None:
            return self._collectives.agreement(self.momentum.device, timeout=self._timeout_seconds(), what=what, who="oktopk: DeMo")
        if self._connect is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            return process_group_agreement(self.process_group, self.momentum.device, timeout=self._timeout_seconds(),
                                           what=what, who="oktopk: DeMo")
        return None

    def _timeout_seconds(self):
        """The seconds a wait of DeMo's may take: its timeout, else the
        library's default (read once)."""
        if self.timeout is not None:
            return self.timeout
        if self._default_timeout is None:
            self._default_timeout = _lib.library_default_config().timeout_ms / 1000
        return self._default_timeout

    def _settings(self):
        """What every rank must hold alike at a step: the settings that
        decide the exchange, every group's lr and weight_decay (they decide
        the update: a rank that steps with another lr drifts from the
        others), and where the run stands."""
        return {"topk": self.topk, "chunk": self.chunk, "momentum_decay": self.momentum_decay, "value_dtype": self.value_dtype,
                "coefficients": self.n,
                "lr": [group["lr"] for group in self.param_groups],
                "weight_decay": [group["weight_decay"] for group in self.param_groups],
                "groups": [len(group["params"]) for group in self.param_groups], "steps": self.steps}

    def _agree_on_settings(self):
        """At every step, before the exchange: OkTopkError on every rank,
        naming each setting and every rank's value, unless every rank holds
        the same (oktopk.settings.check_agreement: one fixed-size gather of
        a 16-byte digest). Every step, not only the first: a learning rate
        or weight decay changed on one rank at any step is a different
        update on that rank."""
        agreement = self._agreement_functions(f"step {self.steps}'s settings' agreement")
        if agreement is not None:
            check_agreement(self._settings(), *agreement, who="oktopk: DeMo")
        self._check_groups()  # the same values on every rank now: refused on every rank alike

    def _flat_gradient(self):
        """Every parameter's lr-scaled gradient, flat, float32 (zeros for a
        parameter without one)."""
        pieces = []
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    pieces.append(torch.zeros(_local(p).numel(), dtype=torch.float32, device=self.momentum.device))
                else:
                    if g.is_sparse:
                        raise ValueError("oktopk: DeMo does not take sparse gradients")
                    pieces.append(_local(g).detach().reshape(-1).float() * group["lr"])
        return torch.cat(pieces) if pieces else torch.zeros(0)

    def _select(self, acc):
        """Step 2: the ``topk`` largest |acc| of every block, ascending."""
        chosen = []
        for at, blocks, length in self.transform.blocks():
            magnitude = acc[at : at + blocks * length].view(blocks, length).abs()
            idx = torch.topk(magnitude, min(self.topk, length), dim=1, sorted=False).indices
            chosen.append((idx + torch.arange(blocks, device=acc.device)[:, None] * length + at).reshape(-1))
        return torch.cat(chosen).sort().values if chosen else torch.zeros(0, dtype=torch.int64)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.n == 0:
            return loss
        self._agree_on_settings()
        comm = self._communicator()
        acc = self._flat_gradient()
        acc = self.transform.apply(acc)
        acc.add_(self.momentum, alpha=self.momentum_decay)  # step 1 (d is not touched until the exchange succeeds)
        non_finite = not bool(torch.isfinite(acc).all())
        indices = torch.zeros(0, dtype=torch.int64, device=acc.device) if non_finite else self._select(acc)
        k, _, threshold = comm.selection_plan(TENSOR_ID, self.n)
        stats, pairs = selected_call(comm, TENSOR_ID, self.n, k, torch.float32, indices, acc[indices], threshold, non_finite,
                                     self._host)  # step 3
        if stats is None:
            self.skipped_steps += 1
            return loss
        ri, rv, ci, cv, ei, ev = pairs
        acc[ci.long()] -= cv  # step 4
        if ei.numel():
            acc[ei.long()] += ev
        self.momentum = acc
        reduced = torch.zeros(self.n, dtype=torch.float32, device=acc.device)
        reduced[ri.long()] = rv
        update = self.transform.apply(reduced, inverse=True).sign_()
        at = 0
        for group in self.param_groups:  # step 5
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                values = _local(p)  # a shard's local tensor shares the shard's storage
                size = values.numel()
                if not p.requires_grad:  # frozen: neither decayed nor moved, as torch's AdamW leaves it
                    at += size
                    continue
                if wd:
                    values.mul_(1 - lr * wd)
                values.add_(update[at : at + size].view_as(values).to(values.dtype), alpha=-lr)
                at += size
        if acc.device.type == "cuda":
            torch.cuda.current_stream(acc.device).synchronize()  # the host memory is reused by the next step
        self.steps += 1
        self.bytes_sent += stats.bytes_sent
        return loss

    def _placement(self):
        """(rank, world size) among the ranks that exchange, where known:
        the communicator's, else the process group's; None before a
        Horovod run's first step."""
        if self._comm is not None:
            return self._comm.rank, self._comm.size
        if self._connect is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(self.process_group), torch.distributed.get_world_size(self.process_group)
        return None

    def state_dict(self):
        state = super().state_dict()
        if self._comm is not None:
            library = self._comm.save_tensor_state_residual(TENSOR_ID, self.momentum.cpu()) if self.steps else None
        else:
            library = self._pending_library_state
        rank, size = self._placement() or (None, None)
        state["oktopk"] = with_checksum({"method": "DeMo", "n": self.n, "topk": self.topk, "chunk": self.chunk,
                                         "momentum_decay": self.momentum_decay, "value_dtype": self.value_dtype, "steps": self.steps, "skipped_steps": self.skipped_steps,
                                         "bytes_sent": self.bytes_sent, "library_state": library, "rank": rank, "world_size": size})
        return state

    def _refusal(self, mine, torch_state):
        """Why this rank cannot load the checkpoint (its oktopk entry
        ``mine``, the rest ``torch_state``), or None. Everything that could
        refuse it is checked here, before anything changes."""
        if not isinstance(mine, dict) or mine.get("method") != "DeMo":
            return "oktopk: not a DeMo checkpoint (no 'oktopk' entry of method DeMo)"
        try:
            check_checksum(mine, "DeMo")
        except ValueError as e:
            return str(e)
        for key, value in (("n", self.n), ("topk", self.topk), ("chunk", self.chunk), ("momentum_decay", self.momentum_decay),
                           ("value_dtype", self.value_dtype)):
            saved = mine.get(key, "float32" if key == "value_dtype" else None)  # checkpoints before value_dtype: float32
            if saved != value:
                hint = f" (pass value_dtype={saved!r} to resume it)" if key == "value_dtype" else ""
                return f"oktopk: the checkpoint's {key} is {saved!r}, this optimizer's {value!r}{hint}"
        here, saved = self._placement(), (mine.get("rank"), mine.get("world_size"))
        if here is not None and saved[0] is not None and tuple(saved) != tuple(here):
            return (f"oktopk: this DeMo checkpoint belongs to rank {saved[0]} of {saved[1]}, and this process is rank {here[0]} "
                    f"of {here[1]}: each rank keeps its own momentum and must load its own state_dict()")
        groups, saved_groups = self.param_groups, torch_state.get("param_groups")
        if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(groups) or any(
                not isinstance(saved, dict) or len(saved.get("params", ())) != len(group["params"]) for saved, group in zip(saved_groups, groups)):
            return "oktopk: the checkpoint's param groups differ in number or size from this optimizer's"
        for i, g in enumerate(saved_groups):
            for name in ("lr", "weight_decay"):
                if name in g and not (is_real(g[name]) and 0 <= g[name] < math.inf):
                    return f"oktopk: the checkpoint's param_groups[{i}]: {name} must be a finite number >= 0, got {g[name]!r}"
        return None

    def _agree_on_load(self, refusal):
        """Every rank's outcome of checking its checkpoint, compared: one
        fixed-size gather when every rank accepts, the reasons gathered
        when any refused. Raises ValueError on every rank when any rank
        refused, naming each such rank and why, so that no rank goes on to
        a step the refusing rank never makes."""
        agreement = self._agreement_functions("load_state_dict's agreement (every rank loads its checkpoint at once)")
        if agreement is None:
            if refusal is not None:
                raise ValueError(refusal)
            return
        gather_digests, gather_outcomes = agreement
        outcome = {"refused": refusal}
        digests = gather_digests(settings_digest(outcome))
        if all(d == digests[0] for d in digests[1:]) and refusal is None:
            return
        every = gather_outcomes(outcome)
        refused = [(r, o["refused"]) for r, o in enumerate(every) if o["refused"] is not None]
        raise ValueError(f"oktopk: DeMo's checkpoint was refused on {len(refused)} of {len(every)} ranks, so no rank loaded it "
                         f"(every optimizer is as it was): " + "; ".join(f"rank {r}: {why}" for r, why in refused))

    def load_state_dict(self, state_dict):
        """Load a checkpoint of this rank's ``state_dict()``. Where the
        ranks exchange over a process group (or Horovod), every rank loads
        at once and the ranks compare the outcome: a checkpoint refused on
        any rank (another rank's, another run's settings, a changed field
        or byte) raises ValueError on every rank, naming it, and leaves
        every rank's optimizer exactly as it was. An accepted one replaces
        the momentum and counters; a running communicator is closed, and
        the next step connects afresh with the checkpoint's library state,
        as a restarted run would."""
        state_dict = dict(state_dict)
        mine = state_dict.pop("oktopk", None)
        self._agree_on_load(self._refusal(mine, state_dict))
        super().load_state_dict(state_dict)
        self.steps, self.skipped_steps, self.bytes_sent = mine["steps"], mine["skipped_steps"], mine["bytes_sent"]
        self.momentum.zero_()
        self.close()
        self._pending_library_state = mine["library_state"]

    def close(self):
        """Release the communicator (also done when the optimizer is
        collected)."""
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
