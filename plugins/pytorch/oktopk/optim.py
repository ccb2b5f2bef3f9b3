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

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch before 2.4 (Horovod's): no FSDP2 either
    DTensor = None

from .device import HostBuffers, selected_call
from .settings import check_agreement, check_checksum, process_group_agreement, with_checksum
from .transforms import ChunkedDCT

MOMENTUM_DECAY = 0.999  # DeMo's compression_decay
TOPK = 64  # coefficients kept per block (DeMo's public code: 32; 64 measured better, results/text.md)
CHUNK = 64  # a block's side
TENSOR_ID = 0x44654D6F  # the library's state of the flat coefficient vector ("DeMo")


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
    :param communicator: how to connect the ranks, for a job without a
        torch process group: a callable taking (density, timeout) and
        returning an ``oktopk.Communicator`` with the Ok-Topk algorithm
        (``oktopk_horovod.DeMo`` passes one over Horovod's collectives).
    :param agreement: with ``communicator``, how the ranks compare their
        settings at the first step: ``(gather_digests, gather_settings)``
        as ``oktopk.settings.check_agreement`` takes them (without it, the
        process group's collectives).

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
                 process_group=None, timeout=None, communicator=None, agreement=None):
        if not (isinstance(lr, (int, float)) and lr >= 0):
            raise ValueError(f"oktopk: lr must be a number >= 0, got {lr!r}")
        if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
            raise ValueError(f"oktopk: weight_decay must be a number >= 0, got {weight_decay!r}")
        if not (isinstance(momentum_decay, (int, float)) and 0 <= momentum_decay < 1):
            raise ValueError(f"oktopk: momentum_decay must be in [0, 1), got {momentum_decay!r}")
        if not (isinstance(topk, int) and not isinstance(topk, bool) and topk >= 1):
            raise ValueError(f"oktopk: topk must be an int >= 1, got {topk!r}")
        if not (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 1):
            raise ValueError(f"oktopk: chunk must be an int >= 1, got {chunk!r}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"oktopk: timeout must be a number of seconds > 0, got {timeout!r}")
        ddp = params if isinstance(params, torch.nn.parallel.DistributedDataParallel) else None
        if ddp is not None:
            ddp.register_comm_hook(None, _local_gradient_hook)
            if process_group is None:
                process_group = ddp.process_group
            params = [p for p in ddp.parameters() if p.requires_grad]
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.momentum_decay, self.topk, self.chunk = float(momentum_decay), topk, chunk
        self.process_group, self.timeout, self._connect = process_group, timeout, communicator
        self._agreement = agreement
        self._agreed = False  # the ranks compared their settings (the first step)
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
        self.momentum = torch.zeros(self.n, dtype=torch.float32, device=device)  # d, in DCT coefficients
        self.steps = 0  # exchanges completed
        self.skipped_steps = 0  # steps skipped for a NaN or Inf
        self.bytes_sent = 0  # by this rank's exchanges, indices included
        self._comm = None
        self._pending_library_state = None  # a checkpoint's, installed once the communicator exists
        self._host = HostBuffers()

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

                self._comm = Communicator(self.process_group, algorithm="oktopk", density=self.density, timeout=self.timeout)
            if self._pending_library_state is not None:
                host = torch.empty(self.n, dtype=torch.float32)
                self._comm.load_tensor_state_residual(TENSOR_ID, self._pending_library_state, host)
                self.momentum.copy_(host)
                self._pending_library_state = None
        return self._comm

    def _agree_on_settings(self):
        """At the first step, before the communicator: OkTopkError on every
        rank, naming each setting and every rank's value, unless every rank
        holds the same (oktopk.settings.check_agreement)."""
        settings = {"topk": self.topk, "chunk": self.chunk, "momentum_decay": self.momentum_decay,
                    "weight_decay": [group["weight_decay"] for group in self.param_groups], "coefficients": self.n,
                    "steps": self.steps}
        agreement = self._agreement
        if agreement is None and self._connect is None and torch.distributed.is_initialized():
            agreement = process_group_agreement(self.process_group, self.momentum.device)
        if agreement is not None:
            check_agreement(settings, *agreement)
        self._agreed = True

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
        if not self._agreed:
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
                if wd:
                    values.mul_(1 - lr * wd)
                values.add_(update[at : at + size].view_as(values).to(values.dtype), alpha=-lr)
                at += size
        if acc.device.type == "cuda":
            torch.cuda.current_stream(acc.device).synchronize()  # the host memory is reused by the next step
        self.steps += 1
        self.bytes_sent += stats.bytes_sent
        return loss

    def state_dict(self):
        state = super().state_dict()
        if self._comm is not None:
            library = self._comm.save_tensor_state_residual(TENSOR_ID, self.momentum.cpu()) if self.steps else None
        else:
            library = self._pending_library_state
        state["oktopk"] = with_checksum({"method": "DeMo", "n": self.n, "topk": self.topk, "chunk": self.chunk,
                                         "momentum_decay": self.momentum_decay, "steps": self.steps, "skipped_steps": self.skipped_steps,
                                         "bytes_sent": self.bytes_sent, "library_state": library})
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        mine = state_dict.pop("oktopk", None)
        if mine is None or mine.get("method") != "DeMo":
            raise ValueError("oktopk: not a DeMo checkpoint (no 'oktopk' entry of method DeMo)")
        check_checksum(mine, "DeMo")
        for key, value in (("n", self.n), ("topk", self.topk), ("chunk", self.chunk), ("momentum_decay", self.momentum_decay)):
            if mine[key] != value:
                raise ValueError(f"oktopk: the checkpoint's {key} is {mine[key]!r}, this optimizer's {value!r}")
        super().load_state_dict(state_dict)
        self.steps, self.skipped_steps, self.bytes_sent = mine["steps"], mine["skipped_steps"], mine["bytes_sent"]
        blob = mine["library_state"]
        self.momentum.zero_()
        if blob is None:
            self._pending_library_state = None
        elif self._comm is None:
            self._pending_library_state = blob
        else:
            host = torch.empty(self.n, dtype=torch.float32)
            self._comm.load_tensor_state_residual(TENSOR_ID, blob, host)
            self.momentum.copy_(host)

    def close(self):
        """Release the communicator (also done when the optimizer is
        collected)."""
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
