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

from . import path_quantized, path_sparse
from .choice import NATIVE, QUANTIZED, SPARSE
from .layout import group_id_of
from .paths import PATHS, SUPPORTED_DTYPES, timed_warmup_step, warmup_path
from .state import OkTopkState
from .step import agree_on_settings, begin_step


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
    if state._momentum is not None and state._momentum.masking:
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
        self._device = None  # the shards' device: the agreement's flag lives there (NCCL reduces CUDA tensors)
        if dist.get_world_size(state.process_group) < dist.get_world_size():
            state._folds.agree = self._agree  # several replicate groups: a NaN reaches only its own
        self._forward = model.register_forward_pre_hook(self._on_forward)
        state._optimizers.watch(model.parameters())  # an Adam-family optimizer keeps them dense (oktopk.optimizers)
        # Each module's parameters and their slices of its flat shard, for
        # the momentum correction (None: the correction is off).
        self.slices = None
        if state._momentum is not None:
            self.slices = [shard_slices(group, state._layout.param_index) for _, group in modules]
        for number, (module, _) in enumerate(modules):
            state._layout.add_group(group_id(number), (number,))  # checkpointed with the state
            module.set_all_reduce_hook(self._hook_for(number))

    def remove(self):
        if self.state._folds.agree == self._agree:
            self.state._folds.agree = None
        self._forward.remove()
        for _, group in self.modules:
            group._all_reduce_hook = None

    def _on_forward(self, module, args):
        self.new_step = True

    def _agree(self, non_finite):
        """Whether a step was non-finite on any rank of the world: each
        replicate group sees only its own shards' calls, while the script
        skips the step everywhere (AMP's scaler agrees over the world)."""
        flag = torch.tensor([1.0 if non_finite else 0.0], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _begin(self, shard):
        state = self.state
        # Before anything reads a residual: a step before that came back
        # non-finite anywhere gives back what its other modules' calls and
        # folds took, on every rank alike (StepFolds).
        self._device = shard.device
        state._folds.settle()
        state._folds.began = True
        correction = state._momentum
        if correction is not None:
            correction.record_step(state._folds)
            if correction.active:
                correction.begin_step()
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
            begin_step(state, s, shard.device, untimed=self.steps_run == 0)
            state._folds.watching = state._path == NATIVE and bool(state._residual_groups or state._quantized)
        elif self.step == timed_warmup_step(state) and state._choice is not None:
            # A native step the choice can compare the sparse probe with
            # (a process resumed from a checkpoint saved before it runs it
            # first: timed too, as in the whole run).
            state._choice.time_warmup_step()
        elif self.step == timed_warmup_step(state) + 1 and state._choice is not None:
            state._choice.end_warmup_step()  # a compressed warm-up's step follows it
        self.steps_run += 1

    def _hook_for(self, number):
        module_group = group_id(number)

        def hook(shard):
            if shard.dtype not in SUPPORTED_DTYPES or shard.device.type not in ("cpu", "cuda"):
                raise ValueError(f"oktopk.fsdp: unsupported gradient shard of {shard.dtype} on {shard.device.type}; "
                                 "liboktopk reduces float32, float16 and bfloat16 gradients on CPU or CUDA")
            if self.new_step:
                self._begin(shard)
            state = self.state
            # Momentum correction (oktopk.momentum): the shard's gradients
            # become the velocities' steps before any path (or fold) reads
            # them, and the optimizer's G after.
            work = self._correct_before(number, shard)
            try:
                self._reduce(module_group, shard)
            except BaseException:
                if state._momentum is not None:  # a failed step moves no velocity, this module's or an earlier one's
                    state._momentum.give_back_step()
                raise
            if work is not None:
                state._momentum.after(work, shard.view(-1))

        return hook

    def _correct_before(self, number, shard):
        """The correction's ``before`` on module ``number``'s shard, or None
        where it does not apply: off, not yet active (before the
        optimizer's first step), or a float16 shard (FSDP2 divides such a
        sum after the hook: the G would be scaled)."""
        correction = self.state._momentum
        if correction is None or not correction.active or shard.dtype == torch.float16:
            return None
        params, members, padded = self.slices[number]
        if padded != shard.numel() or not shard.is_contiguous():
            correction._stop(f"FSDP2's gradient shard of module {number} is not laid out as expected ({shard.numel()} "
                             f"values, {padded} expected)")
            return None
        return correction.before(params, members, shard.view(-1))

    def _reduce(self, group_id, shard):
        """The shard's average over the replicas, in place, by the step's path."""
        state = self.state
        if self.step < state.warmup_iters:
            path = warmup_path(state, self.step)  # native, or the warm-up's compression
        else:
            path = state._path if state._choice is not None else SPARSE
            if path == NATIVE:
                # What earlier steps left in the residuals joins the shard
                # first, so the switch loses nothing. (A BF16 step follows
                # no sparse step: nothing to fold.)
                path_sparse.fold_shard_(state, group_id, shard)
                path_quantized.fold_shard_(state, group_id, shard)
            else:
                # What a quantized warm-up left joins the shard first.
                if path != QUANTIZED:
                    path_quantized.fold_shard_(state, group_id, shard)
                if path == SPARSE:
                    self._note_measured_step()
        PATHS[path].reduce_(state, group_id, shard, self.step)

    def _note_measured_step(self):
        """Before a sparse step's shard: a step that measures ξ with the
        adaptive control is adapted after, when the next step begins (every
        call of it is done then, on every rank). The communicator is made
        first, as the shard's call would: a setup that fails leaves no step
        to adapt."""
        state = self.state
        path_sparse.start(state)
        _, xi_step = path_sparse.call_for(state, self.step)
        if xi_step is not None and state._reducer.adaptive is not None:
            self.measured_step = xi_step


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
