"""Where each step of the DDP hook and of the FSDP2 registration begins,
before its first bucket or shard is reduced: the ranks' agreement on the
settings (the first steps, and after a load), and the measured choice's
path of the step (``oktopk.choice``), with what a change of path needs
(the used-parameter watch, releasing an idle communicator).
"""

from . import log
from .choice import NATIVE, SPARSE, debug_enabled
from .optimizers import dense_notice, family_seen
from .path_sparse import save_groups, start
from .settings import settings_digest


def agreement_settings(state):
    """The state's settings that decide which collectives a rank issues
    and when, with where the run stands (a resumed one: its step, layout
    and choice): what every rank must hold alike."""
    choice = state._choice
    groups = sorted((group_id, tuple(members)) for group_id, members in state._layout.state_dict().items())
    return {
        "density": state.density,
        "algorithm": state.algorithm,
        "warmup_iters": state.warmup_iters,
        "warmup_compression": state.warmup_compression,
        "tau": state.tau,
        "tau_prime": state.tau_prime,
        "dense_compression": state.dense_compression,
        "sparse": state.sparse,
        "sparse_after": state.sparse_after,
        "value_dtype": state.value_dtype,
        "stochastic_rounding": state.stochastic_rounding,
        "density_schedule": state.density_schedule,
        "measure_xi_every": state.measure_xi_every,
        "adaptive": state.adaptive,
        "sparse_margin": state.sparse_margin,
        "recheck_every": state.recheck_every,
        "device_path": state.device_path,
        "momentum_correction": state.momentum_correction,
        "momentum_masking": state.momentum_masking,
        "local_clip_norm": state.local_clip_norm,
        "optimizer_family": family_seen(state._optimizers.seen),
        "iter": state.iter,
        "layout": f"{len(groups)} groups, digest {settings_digest(dict(groups)).hex()[:12]}",
        "choice": None if choice is None else (choice.chosen, choice.candidate, choice.decided_at, choice.confirm_at, choice.origin),
        "communicator_at_load": state._communicator_at_load,
    }


def agree_on_settings(state, device):
    """At the first bucket of a step that begins with it (the first steps,
    and after a load): OkTopkError on every rank, naming each setting and
    every rank's value, unless every rank of the process group holds the
    same agreement_settings (oktopk.settings.check_agreement: one
    fixed-size all_gather, the same on every rank whatever its settings)."""
    choice = state._choice
    arrived = None if choice is None else choice.clock()
    state._collectives.check_agreement(agreement_settings(state), device)
    state._agreement_steps -= 1
    if choice is not None:
        # Its wait for the slowest rank (after a load: the slowest to load)
        # is no step's time: a resumed run times the step its checkpoint
        # was saved in across it, as the run that saved it did not.
        choice.leave_out(choice.clock() - arrived)


# -- the measured choice's path of each step ------------------------------------


def agree_max(state, device):
    """The choice's agreement: the max of each value over the ranks, through
    the state's collectives (on the bucket's device, as NCCL needs)."""
    collectives = state._collectives

    def agree(values):
        return collectives.max(values, device)

    return agree


def begin_step(state, s, device, untimed):
    """At the first bucket of sparse-phase step s: the path of this step
    (timing the one before, and deciding when a decision is due)."""
    choice = state._choice
    if choice.agree is None:
        choice.agree = agree_max(state, device)
        if debug_enabled() and state._collectives.rank() == 0:
            choice.log = log.decisions()
    previous, kept_dense = state._path, choice.kept_dense_for
    state._path = choice.begin_step(s, untimed)
    saved_after, state._communicator_at_load = state._communicator_at_load, None
    if saved_after is not None and state._path == NATIVE and not (saved_after == NATIVE and choice.chosen == NATIVE):
        # The first step of a run resumed from a checkpoint whose run had
        # its communicator, which that run still has at this native step
        # (it releases it below only after a native step, native chosen):
        # made again, so this step folds the residuals as that run's did.
        # Every rank makes it at the same step (the checkpoint's path and
        # communicator, this step's path and the step are agreed).
        start(state)
    if kept_dense is None and choice.kept_dense_for is not None and state._collectives.rank() == 0:
        log.notice(dense_notice(choice.kept_dense_for, compressed=choice.candidate))
    if state._path == SPARSE:
        state._layout.watching = True
    if previous == SPARSE and state._path == NATIVE:
        # The sparse steps' queued work (adaptation) finishes before a fold
        # reads their residuals.
        state._reducer.drain()
    elif previous == NATIVE and state._path == NATIVE and choice.chosen == NATIVE:
        release_communicator(state)
        if not state._residual_groups and state._layout.watching:
            # Nothing left to fold: which parameters were used no longer
            # matters until the next sparse step.
            state._layout.stop_watching()
    elif choice.candidate != SPARSE and not state._residual_groups and state._layout.watching:
        # No sparse step comes (an Adam-family optimizer), none left a
        # residual: which parameters were used never matters.
        state._layout.stop_watching()


def release_communicator(state):
    """Once native is chosen and a native step has folded the residuals in:
    save what the communicator holds per group (thresholds, region
    boundaries, held entries) and destroy it, with its worker thread. An
    idle communicator's sockets still wake their owner threads (a few
    percent of a core per rank, felt where ranks share cores); the next
    sparse step, a probe at the latest, makes a new one through the store
    and loads the saved state, as after a checkpoint. Every rank releases
    at the same step (the path is agreed)."""
    reducer = state._reducer
    if reducer.comm is None:
        return
    reducer.drain()
    state._pending_state = save_groups(reducer.comm, state._device_groups, state._layout.groups)
    state._link = reducer.comm.link() or state._link  # the next communicator chooses by the same link
    state._device_groups = {}  # their residuals are in the saved states; the next sparse step loads them again
    reducer.close()
