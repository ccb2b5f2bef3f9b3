"""The engine's side of ``on_rank_loss="continue"``: a step that lost a
rank voided on every survivor, the survivors going on without it at the
next step boundary (their agreement and communicators:
``oktopk.survivors``), and a rank that comes back joining.

These read the engine's private state: this module is one of the engine's
(``oktopk.engine.ENGINE_MODULES``).
"""

import io
import os

import numpy as np
import torch

from . import _lib, checkpoint, log
from ._lib import OkTopkError
from .path_sparse import save_groups
from .settings import with_checksum


def lost_a_rank(engine, error, step):
    """Whether ``error``, raised by a call of ``step``, is a lost rank the
    run goes on without: on_rank_loss="continue", a library step (after the
    warm-up, whose steps are the process group's), and a peer that died,
    stopped, aborted or never answered. The first one voids the step (the
    communicator is aborted, so the step's later calls fail at once rather
    than each after the timeout); returns True for it and every later
    failure of the same step."""
    if not engine._continuing or step < engine.warmup_iters:
        return False
    if engine._void is not None:
        return True
    if not isinstance(error, OkTopkError) or error.code not in (_lib.REMOTE_ERROR, _lib.TIMEOUT, _lib.ABORTED):
        return False
    engine._void = (step, error)
    comm = engine._reducer.comm
    if comm is not None:
        comm.abort()
    return True


def void_bucket(engine, bucket, tensor):
    """A bucket of a step already void: not reduced (its optimizer step
    steps nothing, :func:`void_grads`), counted as the step's."""
    if bucket.is_last():
        engine.iter += 1
        engine._hook_iters += 1
    return done(tensor)


def done(tensor):
    """A future that holds ``tensor`` already (what DDP takes from a void
    step's bucket)."""
    fut = torch.futures.Future(devices=[tensor.device]) if tensor.device.type == "cuda" else torch.futures.Future()
    fut.set_result(tensor)
    return fut


def void_grads(engine, optimizer, watched):
    """Before an optimizer's step right after a void step: the gradients of
    the parameters it steps that the hook reduces (``watched``: their ids)
    become None, so the step leaves them, their momentum and their weight
    decay as they were, alike on every survivor."""
    if engine._void is None:
        return False
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in watched:
                p.grad = None
    return True


def admit_if_due(engine):
    """At a step boundary: the joiners due now join (:func:`grow`)."""
    due = engine._collectives.joiners_due(engine.iter)
    if due is not None:
        grow(engine, due["slots"], due["seen"])


def _release(engine):
    """This rank's residuals saved from the communicator, which is
    destroyed; they load, regrouped, into the next one."""
    reducer = engine._reducer
    saved = {}
    if reducer.comm is not None:
        reducer.drain()
        saved = save_groups(reducer.comm, engine._device_groups, engine._layout.groups)
        engine._link = reducer.comm.link() or engine._link
        engine._device_groups = {}
        reducer.close()
    engine._pending_state = {**engine._pending_state, **saved}
    engine._pending_regrouped = True
    return saved


def grow(engine, slots, seen):
    """A member's side of a join: its residuals kept for the larger group;
    the group's rank 0 hands the joiners what they need (the script's own
    state, from ``rejoin_state``, and the engine's position and layout,
    without its residuals and velocities: a joiner starts with empty
    ones) through the job's store. From this step on, every call is over
    the larger group."""
    collectives = engine._collectives
    donor = collectives.rank() == 0
    _release(engine)
    joining, answer = collectives.grow(slots, engine._rejoin is not None)
    if joining and donor:
        fields = checkpoint.fields(engine)
        # The momentum correction's per-parameter settings and B (what the
        # optimizer's buffer was handed, alike on every rank) go over, so
        # the joiner hands its optimizer the G the others do; its own
        # velocities, like its residuals, start at zero (not absent: an
        # absent velocity is a first step, buf = G, which this optimizer's
        # buffer is long past).
        momentum = {i: dict(e, velocity=None if e["velocity"] is None else torch.zeros_like(e["velocity"]), waiting=None)
                    for i, e in fields["momentum"].items()}
        position = dict(fields, tensors={}, quantized={}, momentum=momentum, residual_groups=[], communicator=False, rank=None,
                        world_size=None)
        buf = io.BytesIO()
        torch.save({"script": engine._rejoin[0](), "engine": position}, buf)
        collectives._store().set(collectives.handover_key(), buf.getvalue())
    answer()
    if joining:
        engine._rank_joins.append({"step": engine.iter, "asked_by": seen, "joined": joining, "size": collectives.size(),
                                   "rank": collectives.rank()})
        if donor:
            log.notice(f"oktopk: rank{'s' if len(joining) > 1 else ''} {', '.join(map(str, joining))} joined at step {engine.iter}: "
                       f"{collectives.size()} ranks from this step")


def join(engine, origin=None):
    """The joining process's side: wait for the group's admission, load
    what the group's rank 0 handed over (the script's state through
    ``rejoin_state``'s ``load_state_dict``, the engine's position), and
    take part from the step it was admitted at, with empty residuals."""
    if not engine._continuing:
        raise ValueError("oktopk: join() is for on_rank_loss='continue'")
    if engine._rejoin is None:
        raise ValueError("oktopk: join() needs state.rejoin_state(state_dict, load_state_dict) first: the second loads what "
                         "the group hands this rank")
    if origin is None:
        origin = int(os.environ["RANK"])
    handed = torch.load(io.BytesIO(engine._collectives.join(origin, engine.timeout)), weights_only=True)  # tensors and plain values: no code from the store
    engine._rejoin[1](handed["script"])
    checkpoint.load_state_dict(engine, with_checksum(handed["engine"]))
    engine._agreement_steps = 0  # the group agreed long ago, and is mid-run: no collective over the process group
    engine._rank_joins.append({"step": engine.iter, "joined": [origin], "size": engine._collectives.size(),
                               "rank": engine._collectives.rank()})
    return engine.iter


def residual_mass(blob):
    """The sum of |residual| in a saved tensor state (core/state.go's
    format: the residual is its last n float32 values, n at byte 8)."""
    n = int(np.frombuffer(blob, dtype="<u8", count=1, offset=8)[0])
    return float(np.abs(np.frombuffer(blob, dtype="<f4", count=n, offset=len(blob) - 4 * n)).sum(dtype=np.float64))


def go_on(engine):
    """At the step boundary after a void step (the next step's first bucket,
    or a checkpoint before it): this rank's residuals saved from the failed
    communicator, which is destroyed (its port freed); the survivors'
    agreement; the void step uncounted; the residuals loaded, regrouped,
    into the next sparse step's communicator over the survivors
    (``oktopk_tensor_state_load_regrouped``: each kept whole, boundaries
    and thresholds measured afresh). Records the loss in ``rank_losses``."""
    step, error = engine._void
    saved = _release(engine)
    engine._void = None
    engine.iter -= 1  # the void step does not count: the schedules go on as if its batch had not been taken
    loss = engine._collectives.shrink(engine.iter, sum(residual_mass(blob) for blob in saved.values()), engine.timeout)
    loss = {"step": step, **loss, "error": str(error)}
    engine._rank_losses.append(loss)
    if loss["rank"] == 0:
        log.notice(f"oktopk: rank{'s' if len(loss['lost']) > 1 else ''} {', '.join(map(str, loss['lost']))} lost in step {step}: "
                   f"that step is void on every survivor, and the {loss['survivors']} survivors go on from it; the lost "
                   f"residual{'s' if len(loss['lost']) > 1 else ''} (about {loss['residual_mass_lost']:.4g} of |gradient| "
                   f"mass, estimated from the survivors') went with {'them' if len(loss['lost']) > 1 else 'it'}")
