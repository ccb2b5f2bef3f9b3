"""The checkpoint of an ``OkTopkState`` (``oktopk.state``): what its
``state_dict()`` and its pickle hold, and the checks a load makes.

A checkpoint holds what a resumed run needs to continue the same run rather
than start a similar one:

- where the run stands: ``iter``, which the warm-up and the density
  schedule follow, and the schedule itself and the adaptation's position
  (``adaptive``), which are part of the run, not of the settings;
- what is waiting to be sent: each group's residual and thresholds
  (``tensors``, from the library or the device path's groups), the
  QUANTIZED path's residuals (``quantized``), the momentum correction's
  velocities (``momentum``), and which groups may hold a residual
  (``residual_groups``) so that a native step folds them in first;
- the layout those are kept in (``layout``), including DDP's initial bucket
  layout, so that a run resumed at any step after the warm-up finds it;
- the measured choice's position (``choice``, its step under way included),
  the Adam-family optimizer seen (``optimizer_seen``: the ranks agree on it
  at the first step after the warm-up, before a resumed process has seen
  its optimizer step), and whether the communicator was alive and the path
  of the step just run (``communicator``, ``path``), so that the next step
  takes the path the saving run's next step would have taken;
- the rank and world size it belongs to (``rank``, ``world_size``): each
  rank's residuals are its own unsent gradients, partitioned among that
  many ranks, so another rank's or another size's is refused, not loaded
  into a drifting run;
- a checksum of it all (``oktopk.settings.with_checksum``), so that a
  changed field or byte is refused rather than trained on.

- the layout's version (``version``): a checkpoint of another layout is
  refused with a message saying so, not read field by field with guesses
  for what it lacks.

A pickle holds the same with the constructor's settings, from which
unpickling makes the state again. The field order is part of the output:
the same state pickles to the same bytes.
"""

from .choice import PATHS
from .path_sparse import save_groups
from .quantized import QuantizedGroup
from .schedule import check_schedule
from .settings import check_checksum, with_checksum

NAME = "OkTopkState"  # how a failed checksum names what failed
VERSION = 1  # the checkpoint's layout: the fields below, each always written


def placement(state):
    """(rank, world size) of this process in the state's group, or None
    before the process group exists (the state's collectives say)."""
    return state._collectives.placement()


def check_owner(state):
    """Refuse a checkpoint of another rank or world size: its residuals are
    another rank's unsent gradients, or a partition among another number of
    ranks. Loaded anyway it would make the run drift, or fail at the first
    sparse step."""
    here = placement(state)
    if state._owner is None or here is None:
        return
    (rank, size), (saved_rank, saved_size) = here, state._owner
    if saved_size != size:
        raise ValueError(
            f"oktopk: this OkTopkState checkpoint was saved by a run of {saved_size} ranks, and this run has {size}: "
            f"each rank's residuals are its own and cannot be repartitioned. Resume with {saved_size} ranks, or do "
            f"not load the oktopk state (load only the model and optimizer) and its residuals start afresh."
        )
    if saved_rank != rank:
        raise ValueError(
            f"oktopk: this OkTopkState checkpoint belongs to rank {saved_rank}, and this process is rank {rank} of "
            f"{size}: each rank keeps its own residuals and must load its own state. Save every rank's state_dict() "
            f"(e.g. to a file named with dist.get_rank()), or collect them on rank 0 with dist.gather_object, and "
            f"load on each rank the state of that rank."
        )
    state._owner = None  # checked


def fields(state):
    """The checkpoint's fields, without the checksum."""
    state._settle_step()  # a step skipped for a NaN left its residuals as they were, and does not count
    tensors = dict(state._pending_state)
    comm = state._reducer.comm
    if comm is not None:
        state._reducer.drain()  # after every queued bucket
        tensors.update(save_groups(comm, state._device_groups, state._layout.groups))
        state._link = comm.link() or state._link
    rank, size = placement(state) or state._owner or (None, None)
    return {
        "version": VERSION,
        "iter": state.iter,
        "density": state.density,
        "density_schedule": state.density_schedule,
        "adaptive": state._reducer.adaptive_state(state.measure_xi_every),
        "algorithm": state.algorithm,
        "tensors": tensors,
        "layout": state._layout.state_dict(),
        "rank": rank,
        "world_size": size,
        "choice": None if state._choice is None else state._choice.state_dict(),
        "residual_groups": sorted(state._residual_groups),
        "quantized": {group_id: group.state_dict() for group_id, group in state._quantized.items()},
        "momentum": {} if state._momentum is None else state._momentum.state_dict(),
        "momentum_sparse_steps": 0 if state._momentum is None else state._momentum.mask.steps_state(),
        "optimizer_seen": state._optimizers.seen,
        "communicator": comm is not None,
        "path": state._path,
        "link": state._link,
    }


def check_link(link):
    """A saved link model (None, or a dict of three finite seconds >= 0),
    checked; ValueError naming the field."""
    if link is None:
        return None
    names = ("latency_seconds", "seconds_per_byte", "pass_seconds_per_byte")
    if not isinstance(link, dict) or set(link) != set(names):
        raise ValueError(f"oktopk: this checkpoint's link model is not a dict of {', '.join(names)}: {link!r}")
    for name in names:
        v = link[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < float("inf"):
            raise ValueError(f"oktopk: this checkpoint's link model has {name} = {v!r}: want finite seconds >= 0")
    return {name: float(link[name]) for name in names}


def state_dict(state):
    """``OkTopkState.state_dict()``: the fields and their checksum."""
    return with_checksum(fields(state))


def load_state_dict(state, saved):
    """``OkTopkState.load_state_dict(saved)``: check ``saved`` (checksum,
    algorithm, schedule, owner) before any of it changes ``state``, then
    restore it."""
    check_checksum(saved, NAME)
    check_version(saved)
    if saved["algorithm"] != state.algorithm:
        def named(a):
            return "the measured choice (algorithm=None)" if a is None else f"algorithm {a!r}"
        raise ValueError(f"checkpoint was made with {named(saved['algorithm'])}, this state uses {named(state.algorithm)}: "
                         f"make the state with the checkpoint's algorithm")
    schedule = check_schedule(saved["density_schedule"], state.density)
    previous = state._owner
    state._owner = None if saved["world_size"] is None else (int(saved["rank"]), int(saved["world_size"]))
    try:
        check_owner(state)
    except ValueError:
        state._owner = previous
        raise
    state.iter = int(saved["iter"])
    measure_xi_every, adaptive = state.measure_xi_every, state.adaptive
    # The adaptation goes on under the saved bounds, not this state's.
    if saved["adaptive"] is not None:
        measure_xi_every = state._reducer.load_adaptive(saved["adaptive"], state.density, state.tau_prime)
        adaptive = state._reducer.adaptive.bounds
    state._settings = state._settings.resumed(schedule, adaptive, measure_xi_every)
    if state._choice is not None and saved["choice"] is not None:
        state._choice.load_state_dict(saved["choice"])
    if state._choice is not None and saved["optimizer_seen"] is not None and state._optimizers.seen is None:
        # As the run that saved it had seen it (a named algorithm only
        # warns of one: a resumed process warns again).
        state._optimizers.seen = str(saved["optimizer_seen"])
    state._quantized = {int(k): QuantizedGroup.from_state_dict(v) for k, v in saved["quantized"].items()}
    if state._momentum is not None:
        state._momentum.load_state_dict(saved["momentum"])
        state._momentum.mask.load_steps(saved.get("momentum_sparse_steps", 0))  # absent before the masking counted its steps
    # The link model "auto" chose by: the resumed run chooses as the saved
    # one would have, not by a new measurement (None: measure anew).
    state._link = check_link(saved["link"])
    if state._link is not None and state._reducer.comm is not None:
        state._reducer.comm.set_link(state._link)
    state._residual_groups = set(saved["residual_groups"])
    tensors = dict(saved["tensors"])
    state._layout.load_state_dict(saved["layout"])
    # What decides the collectives may have changed (iter, layout, the
    # choice): the next step begins with the ranks' agreement again.
    state._agreement_steps = max(state._agreement_steps, 1)
    if state._reducer.comm is not None:
        for bucket_id, blob in tensors.items():
            state._reducer.comm.load_tensor_state(bucket_id, blob)
            state._device_groups.pop(bucket_id, None)
        state._library_groups |= set(tensors)
    else:
        state._pending_state = tensors
    if state._choice is not None:
        state._choice.resume_timing()  # last: the saved step's time goes on from here
        saved_path = saved["path"]
        if saved_path not in PATHS:
            raise ValueError(f"oktopk: this checkpoint's step took the path {saved_path!r}, which this version does not know")
        alive = bool(saved["communicator"]) and state._reducer.comm is None
        state._communicator_at_load = saved_path if alive else None


def pickled(state):
    """``OkTopkState.__getstate__()``: the checkpoint's fields and the
    settings the constructor takes, under one checksum."""
    return with_checksum(fields(state) | {
        "warmup_iters": state.warmup_iters,
        "tau": state.tau,
        "tau_prime": state.tau_prime,
        "timeout": state.timeout,
        "value_dtype": state.value_dtype,
        "stochastic_rounding": state.stochastic_rounding,
        "measure_xi_every": state.measure_xi_every,
        "device_path": state.device_path,
        "dense_compression": state.dense_compression,
        "grads_as_bucket_views": state.grads_as_bucket_views,
        "momentum_correction": state.momentum_correction,
        "momentum_masking": state.momentum_masking,
        "local_clip_norm": state.local_clip_norm,
        "warmup_compression": state.warmup_compression,
    })


def constructor_arguments(saved):
    """The keyword arguments of ``OkTopkState.__init__`` that make the state a
    pickle ``saved`` was made from, once its checksum holds (checked first:
    no field of a changed pickle makes the state)."""
    check_checksum(saved, NAME)
    check_version(saved)
    saved_choice = saved["choice"]
    kwargs = {name: saved[name] for name in ("density", "algorithm", "warmup_iters", "tau", "tau_prime", "timeout", "value_dtype",
                                             "stochastic_rounding", "density_schedule", "measure_xi_every")}
    kwargs["adaptive"] = None if saved["adaptive"] is None else saved["adaptive"]["bounds"]
    if saved_choice:
        kwargs["sparse_margin"], kwargs["recheck_every"] = saved_choice["margin"], saved_choice["recheck_every"]
    kwargs.update({name: saved[name] for name in ("device_path", "dense_compression", "grads_as_bucket_views", "momentum_correction",
                                                  "momentum_masking", "local_clip_norm", "warmup_compression") if name in saved})
    return kwargs


def check_version(saved, version=VERSION, what=NAME):
    """ValueError unless ``saved`` (a ``what`` checkpoint) has its layout's
    ``version``."""
    if saved.get("version") != version:
        raise ValueError(
            f"oktopk: this {what} checkpoint has layout version {saved.get('version')!r}, and this oktopk reads version "
            f"{version}: it was saved by another version of oktopk. Load it with that version, or load only the model "
            f"and optimizer and the oktopk state starts afresh."
        )
