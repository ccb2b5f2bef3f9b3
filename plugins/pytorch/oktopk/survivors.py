"""The survivors of a lost rank, and a rank that comes back, meeting in
the job's store (``on_rank_loss="continue"``; the engine's side is
``oktopk.continuing``): :class:`ContinuingCollectives`, the engine's
collectives, which are the process group's until a rank is lost.

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

import contextlib
import ctypes
import datetime
import json
import time

import torch.distributed as dist

from . import _lib
from ._lib import OkTopkError
from .collectives import ProcessGroupCollectives
from .comm import Communicator, _store_address, default_bind_host, from_rank_zero
from .store import bounded, wait_for

# The job store client's timeout floor (seconds): its connect and answers.
STORE_CONNECT_SECONDS = 30.0

# How often a survivor looks at the round's count while it waits for the
# others (seconds): a store read each time.
_POLL = 0.02


@contextlib.contextmanager
def store_unreachable(what):
    """A store failure inside the block (DistNetworkError and the like: the
    store's host is gone) as OkTopkError (REMOTE_ERROR) naming ``what``."""
    try:
        yield
    except OkTopkError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the store raised
        raise OkTopkError(_lib.REMOTE_ERROR, f"oktopk: {what} could not reach the job's store ({e}): its host (rank 0 under "
                                             f"env://) is gone, or the group finished without this rank; restart from a "
                                             f"checkpoint") from e


class ContinuingCollectives(ProcessGroupCollectives):
    """:class:`oktopk.collectives.ProcessGroupCollectives` until a rank is
    lost; after :meth:`shrink`, the survivors alone: their ranks renumbered
    in the original order, communicators made through the store."""

    def __init__(self, process_group=None):
        super().__init__(process_group)
        self._incarnation = None  # rank 0's random id, over the process group at the first communicator
        self._members = None  # the original ranks still in the group, ascending (None: nobody lost)
        self._origin = None  # this process's rank in the original group
        self._rounds = 0  # shrinks and grows so far
        self._made = 0  # communicators made since the latest shrink or grow
        self._world = None  # the original group's size
        self._job = None  # a client of the job's store, where these keys are kept
        self._grow = None  # the pending admission of joiners: {"at": step, "slots": [...]}
        self._admitted = 0  # join requests handled so far (the store's slots below it)

    @property
    def shrunk(self):
        """Whether a rank was lost and the group went on without it."""
        return self._members is not None

    @property
    def members(self):
        """The original ranks in the group now, ascending."""
        if self._members is None:
            size = super().size()
            return list(range(size))
        return list(self._members)

    @property
    def world(self):
        """The original group's size."""
        return super().size() if self._world is None else self._world

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
                                              f"rank{'s' if len(self.lost) > 1 else ''} "
                                              f"{', '.join(map(str, self.lost))}: after a rank is lost the group goes on over "
                                              f"the library alone (on_rank_loss='continue')")

    @property
    def lost(self):
        """The original ranks lost so far."""
        return [] if self._members is None else sorted(set(range(self.world)) - set(self._members))

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

    def _job_store(self, timeout):
        """A client of the job's store (the process group's TCPStore, or
        MASTER_ADDR:MASTER_PORT): survivors and a joining process, which has
        no share in the process group, meet there under the same keys."""
        if self._job is None:
            address = _store_address(self.process_group)
            if address is None:
                raise OkTopkError(_lib.INVALID_USAGE, "oktopk: on_rank_loss='continue' needs the job's store: a TCPStore process "
                                                      "group, or MASTER_ADDR and MASTER_PORT naming it")
            # The client's own timeout bounds its connect and each answer;
            # the waits here have theirs (wait_for, bounded). A short
            # library timeout must not fail the connect of a loaded host.
            self._job = dist.TCPStore(address[0], address[1], is_master=False,
                                      timeout=datetime.timedelta(seconds=max(timeout, STORE_CONNECT_SECONDS)))
        return self._job

    def _store(self, *parts):
        return dist.PrefixStore("/".join(("oktopk", "continue", self._incarnation, *map(str, parts))) + "/", self._job)

    def _publish(self):
        """The group as it is now, for a process that comes to join (by the
        group's rank 0)."""
        if self.rank() == 0:
            self._job.set("oktopk/continue/current", json.dumps({"incarnation": self._incarnation, "round": self._rounds,
                                                                  "members": self.members, "world": self.world}))

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
            self._world = dist.get_world_size(self.process_group)
            self._job_store(timeout)
            self._publish()
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

        with store_unreachable("the survivors' agreement after a lost rank"):
            agreed = bounded(agree, timeout, "the survivors' agreement")
        view = [record.split() for record in agreed.split(";")]
        members = [int(origin) for origin, _, _ in view]
        if self._origin not in members:
            raise OkTopkError(_lib.REMOTE_ERROR, f"oktopk: this rank (rank {self._origin} of the original {self.world}) "
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
        self._members, self._rounds, self._made, self._grow = members, self._rounds + 1, 0, None
        self._publish()
        return {"lost": lost, "survivors": len(members), "rank": members.index(self._origin),
                "residual_mass_lost": len(lost) * sum(masses) / len(masses)}

    # -- a rank that comes back ---------------------------------------------
    #
    # A joining process adds a request to the store's count. The group's
    # rank 0 looks at the count at every step boundary; seeing a new
    # request at step s, it names step s + 2 as the one the joiners are
    # admitted at. Every member reads that at a boundary up to s + 2: it
    # finished step s + 1's calls, which rank 0 began only after it wrote.
    # So every member admits them at the same step, with no collective.

    def joiners_due(self, step):
        """At the boundary before ``step``: the admission due now (every
        member alike: ``{"seen": the step rank 0 saw the requests at, "at":
        step, "slots": the requests' slots}``), or None."""
        if self._incarnation is None:
            return None
        with store_unreachable("the look for ranks that come back"):
            return self._joiners_due(step)

    def _joiners_due(self, step):
        store = self._store()
        grow_key = f"{self._rounds}/grow"
        if self._grow is None and self.rank() == 0:
            asked = store.add("join/count", 0)
            if asked > self._admitted:
                store.set(grow_key, json.dumps({"seen": step, "at": step + 2, "slots": list(range(self._admitted, asked))}))
        if self._grow is None and store.check([grow_key]):
            self._grow = json.loads(store.get(grow_key))
        if self._grow is None or self._grow["at"] != step:
            return None
        due, self._grow = self._grow, None
        return due

    def grow(self, slots, can_hand_over):
        """Admit the joiners of request ``slots`` (:meth:`joiners_due`): a
        request naming a rank of the original group that is not in it now
        joins; any other is refused, and told why (rank 0 answers). Returns
        (the ranks that join, their answers' writer: call it once the
        handover is in the store, under :meth:`handover_key`)."""
        store = self._store()
        members, joining, answers = self.members, [], {}
        for slot in slots:
            origin = int(store.get(f"join/{slot}"))
            if not can_hand_over:
                answers[slot] = {"refused": "the group was given nothing to hand a joining rank (state.rejoin_state(state_dict, "
                                            "load_state_dict) on every rank)"}
            elif not 0 <= origin < self.world or origin in members or origin in joining:
                answers[slot] = {"refused": f"rank {origin} is not a lost rank of this job (its ranks now: "
                                            f"{', '.join(map(str, members))} of the original {self.world})"}
            else:
                joining.append(origin)
                answers[slot] = {}
        answer_now = self.rank() == 0
        members = sorted(members + joining)
        self._members, self._rounds, self._made, self._admitted = members, self._rounds + 1, 0, max(slots) + 1

        def answer():
            if answer_now:
                for slot, said in answers.items():
                    store.set(f"join/{slot}/answer", json.dumps(said or {"round": self._rounds, "members": members}))
                self._publish()

        return joining, answer

    def handover_key(self):
        return f"{self._rounds}/handover"

    def join(self, origin, timeout):
        """A process that comes back as rank ``origin`` of the original
        group: its request, and the wait until the group admits it (at most
        ``timeout`` seconds). Returns the handover's bytes."""
        job = self._job_store(timeout)
        try:
            job.wait(["oktopk/continue/current"], datetime.timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001 - the store's timeout or its host gone
            raise OkTopkError(_lib.TIMEOUT, f"oktopk: join: no group to join in the job's store within {timeout:g} s (it forms "
                                            f"at the first sparse step): {e}") from e
        current = json.loads(job.get("oktopk/continue/current"))
        self._incarnation, self._world, self._origin = current["incarnation"], int(current["world"]), int(origin)
        store = self._store()
        slot = store.add("join/count", 1) - 1
        store.set(f"join/{slot}", str(self._origin))
        wait_for(store, [f"join/{slot}/answer"], timeout, "the group's admission of this rank")
        said = json.loads(store.get(f"join/{slot}/answer"))
        if "refused" in said:
            raise OkTopkError(_lib.INVALID_USAGE, f"oktopk: join refused: {said['refused']}")
        self._members, self._rounds, self._made, self._admitted = said["members"], said["round"], 0, slot + 1
        return store.get(self.handover_key())

    def __repr__(self):
        return f"ContinuingCollectives({self.process_group!r}, members={self.members if self._members is not None else 'all'})"
