"""The engine's step for a front end that hands it fixed groups of
parameters (Horovod's optimizer, ``oktopk_horovod``): groups formed before
the first step, alike on every rank and after a restart, each reduced
whole, its gradients handed over as separate tensors, on the engine's
worker thread in group order.

Such a front end needs neither DDP's warm-up (its layout is known from the
start) nor a process group: every collective outside the library goes
through the engine's :class:`oktopk.Collectives`. Its step, in the order
the engine runs it:

1. :func:`start`: the ranks agree on the settings; the optimizer's family
   is known now, so the measured choice agrees on it before the first step
   (an Adam-family optimizer keeps the framework's allreduce throughout);
   the communicator is made; the choice names step 0's path.
2. :func:`call` as each group is issued (the front end's thread): the
   step's path, or the sparse call's density, ξ step and τ′, fixed then.
3. :func:`reduce_group` on the worker thread: the group's gradients
   replaced by their average (or sum) through that path, the residual
   folded in first on a native step, the momentum correction around it.
4. :func:`end_step` once every group is back: a non-finite step is taken
   back (``oktopk.reducer.StepFolds``), the adaptation moves, and the
   choice names the next step's path, releasing an idle communicator or
   making one again.

Its checkpoint (:func:`state_dict`) keeps the layout Horovod's optimizer
has always saved, so checkpoints of earlier versions load.
"""

import warnings

import torch

from . import device as device_path_
from . import log
from .checkpoint import check_link, check_version
from .choice import debug_enabled
from .momentum import MOMENTUM_OPTIMIZER
from .optimizers import adam_family, dense_notice, family_seen, sparse_warning
from .path_sparse import device_call, device_group, device_path_wanted, save_group, took_call
from .paths import NATIVE, SPARSE
from .schedule import check_schedule, density_at
from .settings import check_checksum, with_checksum

VERSION = 1  # the checkpoint's layout: each of its fields always written


def start(engine, optimizer, groups, average, front, demo_line, stacklevel):
    """Begin the run (see the module's text). ``groups``: (group id,
    parameters) in the order every rank issues them; ``average``: the
    front end averages (else sums, and gets no momentum correction);
    ``front``: the front end's own settings that decide its collectives,
    agreed with the engine's; ``demo_line``: the line the notice of an
    Adam-family optimizer suggests."""
    engine._group_ids = [group_id for group_id, _ in groups]
    engine._group_front = dict(front)
    engine._demo_line = demo_line
    engine._stateful_groups = set()
    # The parameters numbered in group order (alike on every rank and
    # across restarts): the momentum correction keys its velocities so.
    index = engine._layout.param_index
    for group_id, params in groups:
        for p in params:
            index.setdefault(id(p), len(index))
    # Before any collective the settings decide (the choice's first
    # agreement, the communicator's setup): every rank must hold them alike.
    engine._agreement_steps = 1
    agree(engine)
    # An Adam-family optimizer keeps the framework's allreduce with the
    # measured choice, and is warned about with a named algorithm.
    adam = adam_family(optimizer)
    engine._optimizers.seen = adam
    if adam is not None and engine.algorithm is not None:
        warnings.warn(sparse_warning(adam), stacklevel=stacklevel + 1)
    choice = engine._choice
    if choice is not None:
        collectives, cpu = engine._collectives, torch.device("cpu")
        choice.agree = lambda values: collectives.max(values, cpu)
        if debug_enabled() and collectives.rank() == 0:
            choice.log = log.decisions()
        # This step's time starts here, in no step's path: untimed.
        engine._path = choice.begin_step(engine.iter, untimed=True)
    # The correction applies to SGD with momentum, averaged.
    if not (average and isinstance(optimizer, MOMENTUM_OPTIMIZER)):
        engine._momentum = None
    engine._reducer.start(_communicator(engine))


def agreement_settings(engine):
    """The settings that decide which collectives a rank issues and when,
    with where the run stands (a resumed one: its step and choice): what
    every rank must hold alike."""
    s, choice = engine._settings, engine._choice
    return {
        "density": s.density, "algorithm": s.algorithm, "tau": s.wire.tau, "tau_prime": s.wire.tau_prime, "value_dtype": s.wire.value_dtype,
        "stochastic_rounding": s.wire.stochastic_rounding, "density_schedule": engine.density_schedule,
        "measure_xi_every": engine.measure_xi_every, "adaptive": s.adaptation.adaptive, "sparse_margin": s.choice.sparse_margin,
        "recheck_every": s.choice.recheck_every, "device_path": s.wire.device_path, "momentum_correction": s.momentum.correction,
        "optimizer_family": family_seen(engine._optimizers.seen), **engine._group_front, "buckets": len(engine._group_ids),
        "step": engine.iter,
        "choice": None if choice is None else (choice.chosen, choice.candidate, choice.decided_at, choice.confirm_at, engine._path),
    }


def agree(engine):
    """The ranks' agreement on :func:`agreement_settings` (one fixed-size
    gather; OkTopkError naming each difference)."""
    if engine._collectives.size() > 1:
        engine._collectives.check_agreement(agreement_settings(engine), torch.device("cpu"))
    engine._agreement_steps = 0


def call(engine):
    """The path of a group issued now: NATIVE, or (density or None, ξ step
    or None, τ′ or None) of this step's sparse calls, the same on every
    rank (the step count is, and the adaptation its ranks agreed on). Read
    when the group is issued, not on the worker thread: the adaptation
    moves between steps, in :func:`end_step`."""
    if engine._path == NATIVE:
        return NATIVE
    step, every = engine.iter, engine.measure_xi_every
    density = None if engine.density_schedule is None else density_at(engine.density_schedule, engine.density, step)
    tau_prime = None
    adaptive = engine._reducer.adaptive
    if adaptive is not None:
        density, tau_prime = adaptive.density, adaptive.tau_prime
        engine.last_tau_prime = tau_prime
    engine.last_density = engine.density if density is None else density
    return density, (step if every is not None and step % every == 0 else None), tau_prime


def reduce_group(engine, number, group_id, params, call, average):
    """Worker thread: the ``number``-th group's gradients (``p.grad`` of
    ``params``, dense) replaced by their average, or sum, over the ranks
    through the path of ``call``; with momentum correction each
    parameter's velocity step goes in and the gradient on which the
    optimizer's momentum lands on the average comes out."""
    correction = engine._momentum
    if correction is None or not correction.active or any(not p.grad.is_contiguous() for p in params):
        _reduce(engine, number, group_id, [p.grad for p in params], call, average)
        return
    if number == 0:
        # A native step with no residual held anywhere is the gradients'
        # own average: the correction hands it through, and the step costs
        # what Horovod's allreduce does (MomentumCorrection.begin_step).
        correction.begin_step(idle=engine._path == NATIVE and not engine._residual_groups)
    if correction.idle:
        _reduce(engine, number, group_id, [p.grad for p in params], call, average)
        return
    work = [(p, correction.before([p], [(correction.index_of(p), 0, p.numel())], p.grad.view(-1))) for p in params]
    _reduce(engine, number, group_id, [p.grad for p in params], call, average)
    for p, w in work:
        if w is not None:
            correction.after(w, p.grad.view(-1))


def _reduce(engine, number, group_id, grads, call, average):
    cuda = grads[0].device.type != "cpu"
    if _takes_device_path(engine, grads):
        _reduce_on_device(engine, number, group_id, grads, call, average)
        return
    if not cuda and len(grads) == 1 and grads[0].is_contiguous():
        host = grads[0].view(-1)  # in place
    else:
        # The one copy of a group that remains, and why: the library
        # reduces one contiguous vector in host memory, and a group's
        # gradients are separate tensors (on the GPU for CUDA, copied
        # to pinned memory: DMA transfers, no device-side concatenation).
        # The staging memory is the reducer's, reused.
        host = engine._reducer.staging_for(sum(g.numel() for g in grads), grads[0].dtype, cuda)
        at = 0
        for g in grads:
            host[at : at + g.numel()].view_as(g).copy_(g)
            at += g.numel()
    if call == NATIVE:
        # The framework's own allreduce of the group, its residual (left
        # by sparse steps) folded in first so nothing waits or is lost.
        if group_id in engine._residual_groups:
            comm = engine._reducer.comm
            comm.fold_residual_(group_id, host)
            engine._folds.took(lambda: (comm.unfold_residual(group_id), engine._residual_groups.add(group_id)))
            engine._residual_groups.discard(group_id)
        engine._collectives.allreduce_(host, average=average, name=f"oktopk.native.{number}")
    else:
        if cuda:
            engine._reducer.count_host_device(2 * host.numel() * host.element_size())
        # A step the library skipped (NaN or Inf on some rank) comes back
        # as NaN on every rank, as a dense average would, so AMP's scaler
        # or the user's own check skips it everywhere. Another group's NaN
        # can void the step after this call completed: it is taken back
        # then (took_call).
        density, xi_step, tau_prime = call
        had_residual, undoable = group_id in engine._residual_groups, len(engine._group_ids) != 1
        engine._residual_groups.add(group_id)
        stats = engine._reducer.sparse_allreduce_(group_id, host, density=density, xi_step=xi_step, tau_prime=tau_prime,
                                                 sparse_only=engine._choice is not None, undoable=undoable)
        took_call(engine, group_id, stats, had_residual, undoable=undoable)
        engine._stateful_groups.add(group_id)
        if not average:  # the library averages
            host.mul_(engine._collectives.size())
    if host.data_ptr() != grads[0].data_ptr():
        at = 0
        for g in grads:
            g.copy_(host[at : at + g.numel()].view_as(g))
            at += g.numel()


def _takes_device_path(engine, grads):
    """Whether a group of these gradients takes the device path (see
    ``device_path``): the DDP hook's rule."""
    return device_path_wanted(engine.device_path, engine.algorithm, engine.measure_xi_every, engine._reducer.adaptive, grads[0].device,
                              sum(g.numel() for g in grads))


def _reduce_on_device(engine, number, group_id, grads, call, average):
    """_reduce on the device path: the group's gradients gathered on their
    device (one of them: used in place), reduced there with only pairs
    crossing to the library, and written back."""
    whole = len(grads) == 1 and grads[0].is_contiguous()
    flat = grads[0].view(-1) if whole else torch.cat([g.reshape(-1) for g in grads])
    # A loaded checkpoint's residual (its id in _library_groups) moves here.
    made = group_id not in engine._device_groups and group_id not in engine._library_groups
    group = device_group(engine._device_groups, engine._library_groups, engine._reducer.comm, group_id, flat.numel(), flat.device)
    if call == NATIVE:
        residual = group.residual.clone() if group_id in engine._residual_groups else None
        if residual is not None and device_path_.fold_(flat, group):
            engine._folds.took(lambda: (group.residual.copy_(residual), engine._residual_groups.add(group_id)))
            engine._residual_groups.discard(group_id)
        engine._collectives.allreduce_(flat, average=average, name=f"oktopk.native.{number}")
    else:
        density, _, tau_prime = call
        had_residual = group_id in engine._residual_groups
        engine._residual_groups.add(group_id)
        stats = device_call(engine._reducer, engine._host_buffers, group_id, flat, group, density=density, tau_prime=tau_prime)
        took_call(engine, group_id, stats, had_residual, group, made)
        engine._stateful_groups.add(group_id)
        if not average:
            flat.mul_(engine._collectives.size())
    if not whole:
        at = 0
        for g in grads:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()


def end_step(engine, grads):
    """Once every group of the step is back (``grads``: all of the step's
    reduced gradients): a step that came back non-finite is taken back,
    the adaptation moves, and the choice names the next step's path (every
    rank at the same step)."""
    folds = engine._folds
    if folds.folded and engine._path == NATIVE:  # a NaN shows in the folded sum, on every rank
        folds.watching = True
        for g in grads:
            folds.see(g)
    # A step that came back non-finite is skipped: what its folds and its
    # other groups' calls took goes back (StepFolds), and it does not
    # count: the next step is begun as this one again.
    void = folds.settle()
    reducer = engine._reducer
    if (not void and reducer.adaptive is not None and engine.iter % engine.measure_xi_every == 0
            and reducer.comm is not None):
        # Every call of the step is done: the communicator is free for the
        # drift's allreduce.
        reducer.adapt(engine.iter)
    if not void:
        engine.iter += 1
    choice = engine._choice
    if choice is not None:
        # The step just reduced ends here: time it, and choose the path of
        # the next one.
        previous, kept_dense = engine._path, choice.kept_dense_for
        engine._path = choice.begin_step(engine.iter)
        if kept_dense is None and choice.kept_dense_for is not None and engine._collectives.rank() == 0:
            log.notice(dense_notice(choice.kept_dense_for, demo_line=engine._demo_line))
        _follow_path(engine, previous)


def _communicator(engine):
    """A communicator over every rank, through the engine's collectives,
    choosing by the link "auto" measured before."""
    s = engine._settings
    comm = engine._collectives.communicator(
        "auto" if s.algorithm is None else s.algorithm,  # the measured choice's sparse path
        s.density, s.wire.tau, s.wire.tau_prime, s.timeout, value_dtype=s.wire.value_dtype,
        stochastic_rounding=s.wire.stochastic_rounding)
    if engine._link is not None:
        comm.set_link(engine._link)
    return comm


def _follow_path(engine, previous):
    """Between steps, on every rank alike (the path is agreed): once native
    is chosen and a native step has folded every residual in, save the
    groups' states and destroy the idle communicator (its sockets would
    still wake their threads); before the next sparse step make a new one
    and load them. The worker thread stays: native groups run on it too."""
    reducer = engine._reducer
    if (reducer.comm is not None and previous == NATIVE and engine._path == NATIVE and engine._choice.chosen == NATIVE
            and not engine._residual_groups):
        reducer.drain()
        engine._pending_state = {group_id: save_group(reducer.comm, engine._device_groups, group_id)
                                 for group_id in sorted(engine._stateful_groups)}
        engine._device_groups = {}  # their residuals are in the saved states, loaded again at the next sparse step
        engine._link = reducer.comm.link() or engine._link
        reducer.comm.destroy()
        reducer.comm = None
    elif reducer.comm is None and engine._path == SPARSE:
        reducer.comm = _communicator(engine)
        for group_id, blob in engine._pending_state.items():
            reducer.comm.load_tensor_state(group_id, blob)
        engine._library_groups |= set(engine._pending_state)
        engine._pending_state = {}


def stepped(engine, optimizer):
    """After the optimizer's step: the momentum correction's turn."""
    if engine._momentum is not None:
        engine._momentum.stepped(optimizer)


# -- the checkpoint --------------------------------------------------------------


def state_dict(engine):
    """Every group's residual and thresholds, the rank and world size they
    belong to, the step count with the density schedule, where the
    adaptation and the measured choice stand, and the momentum
    correction's velocities, under a checksum."""
    reducer = engine._reducer
    reducer.drain()
    if reducer.comm is None:  # released while native is chosen
        tensors = dict(engine._pending_state)
    else:
        tensors = {group_id: save_group(reducer.comm, engine._device_groups, group_id) for group_id in sorted(engine._stateful_groups)}
        engine._link = reducer.comm.link() or engine._link
    rank, size = engine._collectives.placement()
    return with_checksum({"version": VERSION, "link": engine._link, "rank": rank, "world_size": size, "tensors": tensors,
                          "step": engine.iter, "density_schedule": engine.density_schedule,
                          "adaptive": reducer.adaptive_state(engine.measure_xi_every),
                          "choice": None if engine._choice is None else {**engine._choice.state_dict(), "path": engine._path},
                          "residual_ids": sorted(engine._residual_groups),
                          "momentum": {} if engine._momentum is None else engine._momentum.state_dict()})


def load_state_dict(engine, state, who, check_owner):
    """Restore a :func:`state_dict` (``who`` names it in messages;
    ``check_owner(rank, world_size)`` refuses another rank's or another
    world size's, in the front end's terms). One whose checksum fails, or
    of another layout, raises ValueError."""
    check_checksum(state, who)
    check_version(state, VERSION, who)
    check_owner(state["rank"], state["world_size"])
    tensors = state["tensors"]
    # The schedule and its step count are part of the run: a resumed run
    # continues the saved one.
    schedule = check_schedule(state["density_schedule"], engine.density)
    for group_id in tensors:
        if group_id not in engine._group_ids:
            raise ValueError(f"oktopk: checkpoint holds bucket {group_id:#x}, which this model does not have")
    reducer = engine._reducer
    if reducer.comm is None:
        engine._pending_state = dict(tensors)
    else:
        for group_id, blob in tensors.items():
            reducer.comm.load_tensor_state(group_id, blob)
            engine._device_groups.pop(group_id, None)
        engine._library_groups |= set(tensors)
    engine.iter = int(state["step"])
    # So is the adaptation: where it stood, under the saved bounds.
    measure_xi_every, adaptive = engine.measure_xi_every, engine.adaptive
    if state["adaptive"] is not None:
        measure_xi_every = reducer.load_adaptive(state["adaptive"], engine.density, engine.tau_prime)
    engine._settings = engine._settings.resumed(schedule, adaptive, measure_xi_every)
    # And the measured choice: the next step's path, and the decisions.
    if engine._choice is not None and state["choice"] is not None:
        engine._choice.load_state_dict(state["choice"])
        engine._path = state["choice"]["path"]
    engine._link = check_link(state["link"])  # None: measure anew
    if engine._link is not None and reducer.comm is not None:
        reducer.comm.set_link(engine._link)
    engine._residual_groups = set(state["residual_ids"])
    engine._stateful_groups = set(tensors)
    if engine._momentum is not None:
        engine._momentum.load_state_dict(state["momentum"])
    # What decides the collectives may have changed (the step, the
    # choice): the next step agrees again before its first group.
    engine._agreement_steps = 1
