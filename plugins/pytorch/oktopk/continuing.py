"""Going on without a lost rank (``on_rank_loss="continue"``): the
survivors' agreement on who is left, and the collectives of the smaller
group.

When a rank dies or stops, every survivor's next library call fails (a dead
peer's connections close; a stopped one misses its heartbeats; a survivor
that gives up aborts, and its abort reaches the rest at once). The engine
voids that step on every survivor and, at the next step boundary, calls
:meth:`ContinuingCollectives.shrink`. There the survivors agree on the
group through the job's store, which stays up while its host does (rank 0's
under ``env://``, the agent's under torchrun's own rendezvous):

1. each survivor adds itself to the round's count and writes its record:
   its rank in the original group, the step it stands at, the mass of its
   residual;
2. it waits until every rank of the current group but one has come (one
   rank lost, the common case: no wait beyond the slowest survivor), or
   until the library's timeout has passed (two or more lost);
3. it proposes the members it then sees, and the first proposal stored
   (the store's compare-and-set) is the group for everyone. A survivor that
   came after it is left out, and says so; it never trains on alone.

The survivors must all stand at the same step, or their parameters differ:
a rank lost in the very last message of a step can let one survivor finish
the step that another voided. Then every survivor raises instead of
going on (a restart from the checkpoint, as fail-stop, is the way back).

The new communicator meets through the same store, under keys of this
incarnation and round, with a new job token from the group's first rank.
The process group itself is not used again: it still counts the lost rank,
and a collective on it would wait for it. So a shrunken group refuses what
needs it (a dense step, an agreement of settings, FSDP2's collectives) with
an error that says so; ``OkTopkState`` refuses those configurations at
setup (``oktopk.settings``).
"""

import ctypes
import time

import numpy as np
import torch
import torch.distributed as dist

from . import _lib, log
from ._lib import OkTopkError
from .collectives import ProcessGroupCollectives
from .comm import Communicator, default_bind_host, from_rank_zero
from .path_sparse import save_groups
from .store import bounded, store_for, wait_for

# How often a survivor looks at the round's count while it waits for the
# others (seconds): a store read each time.
_POLL = 0.02


class ContinuingCollectives(ProcessGroupCollectives):
    """:class:`oktopk.collectives.ProcessGroupCollectives` until a rank is
    lost; after :meth:`shrink`, the survivors alone: their ranks renumbered
    in the original order, communicators made through the store."""

    def __init__(self, process_group=None):
        super().__init__(process_group)
        self._incarnation = None  # rank 0's random id, over the process group at the first communicator
        self._members = None  # the original ranks still in the group, ascending (None: nobody lost)
        self._origin = None  # this process's rank in the original group
        self._rounds = 0  # shrinks so far
        self._made = 0  # communicators made since the latest shrink

    @property
    def shrunk(self):
        """Whether a rank was lost and the group went on without it."""
        return self._members is not None

    @property
    def members(self):
        """The original ranks still in the group, ascending."""
        if self._members is None:
            size = super().size()
            return list(range(size))
        return list(self._members)

    def placement(self):
        if self._members is None:
            return super().placement()
        return self._members.index(self._origin), len(self._members)

    def rank(self):
        return self.placement()[0]

    def size(self):
        return self.placement()[1]

    def _refuse(self, what):
        raise OkTopkError(_lib.INVALID_USAGE, f"oktopk: {what} needs the process group, which still counts the lost "
                                              f"rank{'s' if len(self._members) < super().size() - 1 else ''} "
                                              f"{', '.join(map(str, self.lost))}: after a rank is lost the group goes on over "
                                              f"the library alone (on_rank_loss='continue')")

    @property
    def lost(self):
        """The original ranks lost so far."""
        return [] if self._members is None else sorted(set(range(super().size())) - set(self._members))

    def allreduce_(self, tensor, average=True, name=None):
        if self._members is not None:
            self._refuse("a dense allreduce over the process group")
        return super().allreduce_(tensor, average, name)

    def max(self, values, device):
        if self._members is not None:
            self._refuse("the measured choice's agreement")
        return super().max(values, device)

    def agreement(self, device, timeout=None, what="the settings' agreement", who="oktopk"):
        if self._members is not None:
            self._refuse(what)
        return super().agreement(device, timeout, what, who)

    def _store(self, *parts):
        return dist.PrefixStore("/".join(("continue", self._incarnation, *map(str, parts))) + "/", store_for(self.process_group))

    def communicator(self, algorithm, density, tau=None, tau_prime=None, timeout=None, value_dtype="float32", stochastic_rounding=False):
        if timeout is None:
            timeout = _lib.library_default_config().timeout_ms / 1000
        if self._incarnation is None:
            # Every rank is here while the process group is whole (the first
            # sparse step): rank 0's id names this incarnation's keys, so no
            # key an earlier run left in a long-lived store is read as ours.
            mine = None
            if dist.get_rank(self.process_group) == 0:
                buf = ctypes.create_string_buffer(128)
                _lib.check(_lib.lib().oktopk_make_token(buf, len(buf)))
                mine = buf.value[:16]
            self._incarnation = from_rank_zero(self.process_group, mine, timeout, "rank 0's incarnation id").decode()
            self._origin = dist.get_rank(self.process_group)
        if self._members is None:
            return super().communicator(algorithm, density, tau, tau_prime, timeout, value_dtype, stochastic_rounding)
        rank, size = self.placement()
        store = self._store(self._rounds, "comm", self._made)
        self._made += 1

        def share_token(token):
            def exchange():
                if rank == 0:
                    store.set("token", token)
                wait_for(store, ["token"], timeout, "the new group's job token")
                return store.get("token")

            return bounded(exchange, timeout, "the new group's job token")

        def gather_endpoints(endpoint):
            def exchange():
                store.set(f"ep/{rank}", endpoint)
                keys = [f"ep/{r}" for r in range(size)]
                wait_for(store, keys, timeout, "every survivor's endpoint")
                return [store.get(k) for k in keys]

            return bounded(exchange, timeout, "every survivor's endpoint")

        return Communicator.from_exchange(rank, size, share_token, gather_endpoints, algorithm, density, tau, tau_prime, timeout,
                                          bind_host=default_bind_host(self.process_group), value_dtype=value_dtype,
                                          stochastic_rounding=stochastic_rounding)

    def shrink(self, step, residual_mass, timeout):
        """The survivors' agreement (the module's steps 1 to 3), at a step
        boundary of every survivor: ``step`` is where this rank stands (its
        void step not counted), ``residual_mass`` the sum of |residual| it
        holds. Returns ``{"lost": [original ranks], "survivors": n,
        "rank": this rank's new number, "residual_mass_lost": estimate}``;
        raises OkTopkError when this rank was left out, when the survivors
        stand at different steps, or when the store cannot be reached."""
        if self._incarnation is None:
            raise OkTopkError(_lib.INVALID_USAGE, "oktopk: a rank was lost before the first sparse step: the process group "
                                                  "itself failed, and only the library's steps can go on without a rank")
        before = self.members
        store = self._store(self._rounds, "members")
        deadline = time.monotonic() + timeout

        def agree():
            slot = store.add("count", 1) - 1
            store.set(f"m/{slot}", f"{self._origin} {step} {residual_mass!r}")
            while store.add("count", 0) < len(before) - 1 and time.monotonic() < deadline:
                time.sleep(_POLL)
            seen = store.add("count", 0)
            records = sorted((store.get(f"m/{i}").decode() for i in range(seen)), key=lambda r: int(r.split()[0]))
            return store.compare_set("view", "", ";".join(records)).decode()

        try:
            agreed = bounded(agree, timeout, "the survivors' agreement")
        except OkTopkError:
            raise
        except Exception as e:  # noqa: BLE001 - DistNetworkError and the like: the store's host is gone
            raise OkTopkError(_lib.REMOTE_ERROR, f"oktopk: the survivors' agreement after a lost rank could not reach the job's "
                                                 f"store ({e}): its host (rank 0 under env://, the agent under torchrun) is gone, "
                                                 f"or the group finished without this rank; restart from a checkpoint") from e
        view = [record.split() for record in agreed.split(";")]
        members = [int(origin) for origin, _, _ in view]
        if self._origin not in members:
            raise OkTopkError(_lib.REMOTE_ERROR, f"oktopk: this rank (rank {self._origin} of the original {super().size()}) "
                                                 f"reached the survivors' agreement after it closed: the group went on as "
                                                 f"ranks {', '.join(map(str, members))} without it (it was stopped or slow for "
                                                 f"longer than the timeout, {timeout:g} s); restart it from a checkpoint")
        steps = {int(s) for _, s, _ in view}
        if len(steps) > 1:
            raise OkTopkError(_lib.MISMATCH, f"oktopk: the survivors of a lost rank stand at different steps "
                                             f"({', '.join(f'rank {o}: step {s}' for o, s, _ in view)}): the rank was lost in "
                                             f"the last message of a step, which some of them completed and others voided, so "
                                             f"their parameters differ; going on would train on a state that differs across "
                                             f"ranks: restart every rank from the latest checkpoint")
        lost = [r for r in before if r not in members]
        masses = [float(m) for _, _, m in view]
        self._members, self._rounds, self._made = members, self._rounds + 1, 0
        return {"lost": lost, "survivors": len(members), "rank": members.index(self._origin),
                "residual_mass_lost": len(lost) * sum(masses) / len(masses)}

    def __repr__(self):
        return f"ContinuingCollectives({self.process_group!r}, members={self.members if self._members is not None else 'all'})"


# -- the engine's side: a step voided, then the survivors going on ------------
#
# These read the engine's private state: this module is one of the engine's
# (oktopk.engine.ENGINE_MODULES).


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
    reducer = engine._reducer
    saved = {}
    if reducer.comm is not None:
        reducer.drain()
        saved = save_groups(reducer.comm, engine._device_groups, engine._layout.groups)
        engine._link = reducer.comm.link() or engine._link
        engine._device_groups = {}
        reducer.close()
    engine._void = None
    engine.iter -= 1  # the void step does not count: the schedules go on as if its batch had not been taken
    loss = engine._collectives.shrink(engine.iter, sum(residual_mass(blob) for blob in saved.values()), engine.timeout)
    engine._pending_state = {**engine._pending_state, **saved}
    engine._pending_regrouped = True
    loss = {"step": step, **loss, "error": str(error)}
    engine._rank_losses.append(loss)
    if loss["rank"] == 0:
        log.notice(f"oktopk: rank{'s' if len(loss['lost']) > 1 else ''} {', '.join(map(str, loss['lost']))} lost in step {step}: "
                   f"that step is void on every survivor, and the {loss['survivors']} survivors go on from it; the lost "
                   f"residual{'s' if len(loss['lost']) > 1 else ''} (about {loss['residual_mass_lost']:.4g} of |gradient| "
                   f"mass, estimated from the survivors') went with {'them' if len(loss['lost']) > 1 else 'it'}")
