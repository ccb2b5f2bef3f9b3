"""Ok-Topk across the replicas of FSDP2 (HSDP): each sharded module's
gradient shard is reduced sparsely over the replicate dimension.

HSDP shards a model within a group of ranks (a node) and replicates it
across groups, where the links are slow. FSDP2 reduce-scatters each
module's gradients within the shard group, then all-reduces the shard over
the replicate group. Here FSDP2 shards over the shard dimension only, and
the all-reduce over the replicate dimension is this module's: the same
measured choice, warm-up, settings and residuals (error feedback, one per
module's shard) as the DDP hook::

    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.fsdp import fully_shard
    >>> import oktopk.fsdp
    >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    >>> for block in model.blocks:
    ...     fully_shard(block, mesh=mesh["shard"])
    >>> fully_shard(model, mesh=mesh["shard"])
    >>> state = oktopk.OkTopkState(process_group=mesh.get_group("replicate"))
    >>> oktopk.fsdp.register(model, state)

FSDP2 calls the hook (``FSDPModule.set_all_reduce_hook``) during backward
with the module's flat, reduce-scattered (shard-averaged) gradient; the
hook replaces it, in place, by its average over the replicas. Each rank's
residuals are its own: save ``state.state_dict()`` per rank, or through
``torch.distributed.checkpoint`` with :func:`checkpoint_state` beside the
model's sharded state.
"""

import pickle

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .choice import BF16, NATIVE, QUANTIZED
from .quantized import QuantizedGroup
from . import device as device_path_
from .ddp import SUPPORTED_DTYPES, OkTopkState, _begin_step, _call, _reduce_on_device, _start, _takes_device_path, agree_on_settings
from .layout import group_id_of


def sharded_modules(model):
    """The FSDP2 modules of ``model`` that hold parameters, in
    ``model.modules()`` order: the same on every rank, so their position
    names each one's residual."""
    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out.append((module, group))
    return out


def group_id(number):
    """The library tensor id of the residual of the ``number``-th module of
    :func:`sharded_modules`."""
    return group_id_of([number])


def register(model, state):
    """Reduce every FSDP2 module's gradient shard of ``model`` across the
    replicas with ``state`` (an :class:`oktopk.OkTopkState` whose
    ``process_group`` is the replicate dimension's group). Returns a handle;
    ``handle.remove()`` restores FSDP2's own behaviour (no all-reduce).

    ValueError when the model is not sharded with FSDP2, when it shards
    over a 2-D mesh (native HSDP: FSDP2 would all-reduce densely before the
    hook), or when ``state`` names no replicate group."""
    if not isinstance(state, OkTopkState):
        raise TypeError(f"oktopk.fsdp.register needs an OkTopkState, got {type(state).__name__}")
    if state.process_group is None or state.process_group is dist.GroupMember.WORLD:
        raise ValueError(
            "oktopk.fsdp.register: the state's process_group must be the replicate dimension's group "
            "(e.g. OkTopkState(process_group=mesh.get_group('replicate'))), not the whole world"
        )
    modules = sharded_modules(model)
    if not modules:
        raise ValueError("oktopk.fsdp.register: the model has no FSDP2 module with parameters (call fully_shard first)")
    for module, group in modules:
        if getattr(group, "_is_hsdp", False):
            raise ValueError(
                f"oktopk.fsdp.register: {type(module).__name__} is sharded over a 2-D mesh (native HSDP), so FSDP2 "
                f"all-reduces its gradients densely before any hook; shard over the shard dimension only "
                f"(fully_shard(module, mesh=mesh['shard'])) and let the state reduce over mesh.get_group('replicate')"
            )
    if any(g._all_reduce_hook is not None for _, g in modules):
        raise ValueError("oktopk.fsdp.register: the model already has all-reduce hooks (registered twice?)")
    return _Registration(model, state, modules)


class _Registration:
    """The hooks one :func:`register` call installed, and the step they are
    in: a forward of the root module starts a new step, whose first
    reduced shard times the one before (the measured choice) and whose
    shards then all take its path."""

    def __init__(self, model, state, modules):
        self.state = state
        self.modules = modules
        self.step = None  # the step under way (state.iter when it began)
        self.new_step = True
        self.steps_run = 0
        self.measured_step = None  # a step whose ξ was measured, to adapt after
        self._forward = model.register_forward_pre_hook(self._on_forward)
        state._optimizers.watch(model.parameters())  # an Adam-family optimizer keeps them dense (oktopk.optimizers)
        for number, (module, _) in enumerate(modules):
            state._layout.add_group(group_id(number), (number,))  # checkpointed with the state
            module.set_all_reduce_hook(self._hook_for(group_id(number)))

    def remove(self):
        self._forward.remove()
        for _, group in self.modules:
            group._all_reduce_hook = None

    def _on_forward(self, module, args):
        self.new_step = True

    def _begin(self, shard):
        state = self.state
        if state._agreement_steps:
            agree_on_settings(state, shard.device)  # before anything the settings decide
        if self.measured_step is not None:  # every call of that step is done, on every rank
            state._reducer.adapt(self.measured_step)
            self.measured_step = None
        self.step = state.iter
        state.iter += 1
        self.new_step = False
        s = self.step - state.warmup_iters
        if s >= 0 and state._choice is not None:
            state._folds.settle()  # before anything reads the residuals the step before folded
            _begin_step(state, s, shard.device, untimed=self.steps_run == 0)
            state._folds.watching = state._path == NATIVE and bool(state._residual_groups or state._quantized)
        elif s == -1 and state._choice is not None and self.steps_run > 0:
            state._choice.time_warmup_step()  # a native step the choice can compare the sparse probe with
        self.steps_run += 1

    def _hook_for(self, group_id):
        def hook(shard):
            if shard.dtype not in SUPPORTED_DTYPES or shard.device.type not in ("cpu", "cuda"):
                raise ValueError(f"oktopk.fsdp: unsupported gradient shard of {shard.dtype} on {shard.device.type}; "
                                 "liboktopk reduces float32, float16 and bfloat16 gradients on CPU or CUDA")
            if self.new_step:
                self._begin(shard)
            state = self.state
            if self.step < state.warmup_iters:
                _native_(state, shard)
            elif state._choice is not None and state._path == NATIVE:
                _fold_residual(state, group_id, shard)
                if group_id in state._quantized and shard.dtype == torch.float32:
                    group = state._quantized.pop(group_id).to(shard.device)
                    state._folds.took(lambda: state._quantized.__setitem__(group_id, group))
                    shard.view(-1).add_(group.held())
                _native_(state, shard)
            elif state._choice is not None and state._path == BF16:
                _bf16_(state, shard)  # no sparse step ran: nothing to fold
            elif state._choice is not None and state._path == QUANTIZED:
                _quantized_(state, group_id, shard)
            else:
                self._sparse_(group_id, shard)

        return hook

    def _sparse_(self, group_id, shard):
        state = self.state
        _start(state)
        density, xi_step = call = _call(state, self.step)
        if xi_step is not None and state._reducer.adaptive is not None:
            self.measured_step = xi_step
        tau_prime = None
        adaptive = state._reducer.adaptive
        if adaptive is not None:
            density, tau_prime = adaptive.density, adaptive.tau_prime
            state.last_density, state.last_tau_prime = density, tau_prime
        else:
            state.last_density = state.density if call[0] is None else call[0]
        if _takes_device_path(state, shard) and shard.is_contiguous():
            # The shard stays on its device; only pairs cross (oktopk.device).
            flat = shard.view(-1)
            _reduce_on_device(state, group_id, [(flat, 0, flat.numel())], (), density)
            return
        host = _host(state, shard)
        state._residual_groups.add(group_id)
        state._reducer.sparse_allreduce_(group_id, host, density=density, xi_step=xi_step, tau_prime=tau_prime,
                                         sparse_only=state._choice is not None)
        if host is not shard:
            shard.copy_(host)


def _host(state, shard):
    """The shard itself when the library can read it (a contiguous CPU
    tensor), else a host copy in the state's reused staging memory (pinned
    for CUDA shards)."""
    if shard.device.type == "cpu" and shard.is_contiguous():
        return shard
    host = state._reducer.staging_for(shard.numel(), shard.dtype, shard.device.type == "cuda")
    host.copy_(shard.reshape(-1))
    return host


def _native_(state, shard):
    """The replicate group's own allreduce, averaged, in place."""
    dist.all_reduce(shard, group=state.process_group)
    shard.div_(dist.get_world_size(state.process_group))
    state._folds.see(shard)


def _bf16_(state, shard):
    """The BF16 path (an Adam-family optimizer's choice, oktopk.choice): the
    replicate group's allreduce in bfloat16, averaged, in place, as
    ``bf16_compress_hook`` sends a bucket. A 16-bit shard goes as it is."""
    if shard.dtype != torch.float32:
        _native_(state, shard)
        return
    compressed = shard.to(torch.bfloat16).div_(dist.get_world_size(state.process_group))
    dist.all_reduce(compressed, group=state.process_group)
    shard.copy_(compressed)


def _quantized_(state, group_id, shard):
    """The QUANTIZED path (an Adam-family optimizer's choice, oktopk.choice):
    the shard through oktopk.quantized over the replicas, in place, its
    residuals kept under the module's group id. A 16-bit shard goes native."""
    if shard.dtype != torch.float32 or not shard.is_contiguous():
        _native_(state, shard)
        return
    pg = state.process_group
    group = state._quantized.get(group_id)
    if group is None:
        group = state._quantized[group_id] = QuantizedGroup((group_id,), (shard.numel(),), dist.get_world_size(pg), dist.get_rank(pg),
                                                            shard.device)
    state._quantized_bytes += group.to(shard.device).allreduce_(shard.view(-1), pg)


def _fold_residual(state, group_id, shard):
    """Before a native step: the residual a sparse step left joins the
    shard, so the switch loses nothing."""
    if state._reducer.comm is None or group_id not in state._residual_groups:
        return
    group = state._device_groups.get(group_id)
    if group is not None:
        flat = shard.reshape(-1)
        residual = group.residual.clone()
        if device_path_.fold_(flat, group):
            state._folds.took(lambda: (group.residual.copy_(residual), state._residual_groups.add(group_id)))
            state._residual_groups.discard(group_id)
            if flat.data_ptr() != shard.data_ptr():
                shard.copy_(flat.view_as(shard))
        return
    host = _host(state, shard)
    comm = state._reducer.comm
    comm.fold_residual_(group_id, host)
    state._folds.took(lambda: (comm.unfold_residual(group_id), state._residual_groups.add(group_id)))
    if host is not shard:
        shard.copy_(host)
    state._residual_groups.discard(group_id)


class checkpoint_state:
    """``state`` as a ``torch.distributed.checkpoint`` Stateful entry:
    ``dcp.save({"model": ..., "oktopk": checkpoint_state(state)})`` stores
    every rank's state and ``dcp.load`` gives each rank back its own.

    Why one pickled entry per rank: DCP keeps a single copy of a key that
    several ranks save, and loads only the keys the loading state already
    has, which a fresh state (no residuals yet) would lack."""

    def __init__(self, state):
        self.state = state

    def _key(self):
        return f"rank{dist.get_rank()}_of_{dist.get_world_size()}"

    def state_dict(self):
        return {self._key(): pickle.dumps(self.state.state_dict())}

    def load_state_dict(self, saved):
        key = self._key()
        if key not in saved:
            raise ValueError(f"oktopk.fsdp: the checkpoint holds no state for {key} (it has {sorted(saved)})")
        self.state.load_state_dict(pickle.loads(saved[key]))
