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

from .layout import group_id_of
from .settings import AUTO_MASKING
from .state import OkTopkState


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
    if state.momentum_correction and state.momentum_masking not in (False, AUTO_MASKING):
        raise ValueError("oktopk.fsdp.register: momentum_masking is not supported on FSDP2 replicas yet (the momentum "
                         "correction is); pass momentum_masking=False")
    return _Registration(model, state, modules)


def shard_slices(group, index):
    """(parameters, members) of one FSDP2 module for the momentum correction:
    its sharded parameters (what the optimizer steps) and, for each, (its
    canonical index, start, end) in the flat shard the hook gets, laid out
    as FSDP2 lays out the reduce-scatter's output (each parameter's local
    shard at the start of its padded chunk). New parameters are numbered
    into ``index`` (the layout's param_index) in module and parameter
    order, the same on every rank."""
    params, members, at = [], [], 0
    for fsdp_param in group.fsdp_params:
        p = fsdp_param.sharded_param
        i = index.setdefault(id(p), len(index))
        n = fsdp_param.sharded_size.numel()
        params.append(p)
        members.append((i, at, at + n))
        at += fsdp_param.padded_sharded_param_size.numel()
    return params, members, at


class _Registration:
    """The hooks one :func:`register` call installed: a forward of the root
    module begins a new step, and each module's shard goes to the state's
    engine (``oktopk.engine``)."""

    def __init__(self, model, state, modules):
        self.state = state
        self.modules = modules
        self._forward = model.register_forward_pre_hook(self._on_forward)
        state.watch_optimizers(model.parameters())  # an Adam-family optimizer keeps them dense (oktopk.optimizers)
        # Each module's parameters and their slices of its flat shard, for
        # the momentum correction (None: the correction is off).
        slices = None
        if state.momentum_correction:
            index = state.parameter_index()
            slices = [shard_slices(group, index) for _, group in modules]
        state.attach_shards(slices, agree_over_world=dist.get_world_size(state.process_group) < dist.get_world_size())
        for number, (module, _) in enumerate(modules):
            state.add_group(group_id(number), (number,))  # checkpointed with the state
            module.set_all_reduce_hook(self._hook_for(number))

    def remove(self):
        self.state.detach_shards()
        self._forward.remove()
        for _, group in self.modules:
            group._all_reduce_hook = None

    def _on_forward(self, module, args):
        self.state.next_shard_step()

    def _hook_for(self, number):
        module_group = group_id(number)

        def hook(shard):
            self.state.reduce_shard(number, module_group, shard)

        return hook


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
