"""What the Horovod front end asks of every rank through Horovod's own
collectives: ``oktopk.Collectives`` over every Horovod rank (who the ranks
are, the native path's allreduce, the measured choice's and the settings'
agreements, the communicator's rendezvous), the check that a checkpoint is
this rank's, and the address to bind.

A Horovod job need not have a torch.distributed process group, so nothing
here goes through one: every collective is Horovod's, on the CPU, named
under a prefix so that the optimizer's and ``DeMo``'s never meet.
"""

import os

import horovod.torch as hvd
import torch

from oktopk import Collectives, Communicator, route_source_address


class HorovodCollectives(Collectives):
    """:class:`oktopk.Collectives` over every Horovod rank, its collectives
    named ``<prefix>.<what>`` (alike on every rank)."""

    def __init__(self, prefix="oktopk"):
        self.prefix = prefix

    def placement(self):
        return hvd.rank(), hvd.size()

    def rank(self):
        return hvd.rank()

    def size(self):
        return hvd.size()

    def allreduce_(self, tensor, average=True, name=None):
        return hvd.allreduce_(tensor, op=hvd.Average if average else hvd.Sum, name=name)

    def max(self, values, device=None):
        # Horovod's allreduce on the CPU, in float64: the figures as the
        # ranks measured them.
        every = hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=hvd.Max, name=f"{self.prefix}.choice")
        return [float(v) for v in every.tolist()]

    def agreement(self, device=None, timeout=None, what="the settings' agreement", who="oktopk"):
        # The digests in one fixed-size allgather; Horovod bounds no wait
        # of its own collectives (its stall check reports a missing rank).
        name = f"{self.prefix}.settings"

        def gather_digests(digest):
            every = hvd.allgather(torch.tensor([list(digest)], dtype=torch.int64), name=f"{name}.digest")
            return [bytes(row.tolist()) for row in every]

        def gather_settings(settings):
            return hvd.allgather_object(settings, name=f"{name}.values")

        return gather_digests, gather_settings

    def communicator(self, algorithm, density, tau=None, tau_prime=None, timeout=None, value_dtype="float32", stochastic_rounding=False):
        # The endpoints exchanged through Horovod's own collectives (every
        # rank at the same point).
        return Communicator.from_exchange(
            hvd.rank(),
            hvd.size(),
            lambda token: hvd.broadcast_object(token, root_rank=0, name=f"{self.prefix}.token"),
            lambda endpoint: hvd.allgather_object(endpoint, name=f"{self.prefix}.endpoints"),
            algorithm,
            density,
            tau,
            tau_prime,
            timeout,
            bind_host=default_bind_host(),
            value_dtype=value_dtype,
            stochastic_rounding=stochastic_rounding,
        )

    def __repr__(self):
        return f"HorovodCollectives({self.prefix!r})"


def check_owner(saved_rank, saved_size):
    """Refuse a checkpoint of another rank or world size, saying what to do
    (OkTopkState's check, in Horovod's terms: its rank, and what to save
    and gather with)."""
    if saved_size is None:
        return
    rank, size = hvd.rank(), hvd.size()
    if saved_size != size:
        raise ValueError(
            f"oktopk: this oktopk state was saved by a run of {saved_size} ranks, and this run has {size}: each rank's "
            f"residuals are its own and cannot be repartitioned. Resume with {saved_size} ranks, or do not load the "
            f"oktopk state (load only the model and optimizer) and its residuals start afresh."
        )
    if saved_rank != rank:
        raise ValueError(
            f"oktopk: this oktopk state belongs to rank {saved_rank}, and this process is rank {rank} of {size}: each "
            f"rank keeps its own residuals and must load its own state. Save every rank's oktopk_state_dict() (e.g. to "
            f"a file named with hvd.rank()), or collect them on rank 0 with hvd.allgather_object, and load on each rank "
            f"the state of that rank."
        )


def default_bind_host():
    """Unless OKTOPK_SOCKET_IFNAME names an interface, bind the address that
    routes to horovodrun's Gloo rendezvous server, so ranks on other hosts
    can reach this one (None, the library's loopback default, for a job on
    this machine alone)."""
    if os.environ.get("OKTOPK_SOCKET_IFNAME"):
        return None
    addr, port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port or os.environ.get("HOROVOD_CROSS_SIZE", "1") == "1":
        return None
    return route_source_address(addr, int(port))
