"""How the engine reaches the other ranks outside the library's own
transport: the few collectives a step needs beside its sparse calls.

The library's sparse allreduce travels over its own sockets; what a
front end must still do with its framework's collectives is small, and the
same for every framework:

* who this rank is (``rank``, ``size``, and ``placement``, which a
  checkpoint records and checks);
* the dense allreduce of a native step (``allreduce_``);
* the measured choice's agreement: the max of a few figures (``max``);
* the settings' agreement: one fixed-size gather of a digest, and, only
  when the digests differ, a gather of the settings themselves
  (``agreement``, as :func:`oktopk.settings.check_agreement` takes them);
* the communicator's rendezvous: the job token from rank 0 and every
  rank's endpoint (``communicator``).

:class:`Collectives` is that interface. :class:`ProcessGroupCollectives`
runs it over a torch.distributed process group (the DDP hook's and FSDP2's,
what the engine uses unless given another); a framework without one
implements it with its own (``oktopk_horovod`` with Horovod's).
"""

import torch
import torch.distributed as dist

from .comm import Communicator
from .peer_errors import peer_failures_named
from .settings import check_agreement, process_group_agreement


class Collectives:
    """The collectives an engine, or an optimizer such as ``DeMo``, issues
    outside the library (see the module's text). Every rank calls each
    method at the same point of its step, in the same order; a subclass
    implements all of them."""

    def placement(self):
        """(rank, world size) of this process among the ranks, or None
        while the ranks are not connected yet (a process group not made
        yet)."""
        raise NotImplementedError

    def rank(self):
        """This process's rank among the ranks."""
        return self.placement()[0]

    def size(self):
        """How many ranks there are."""
        return self.placement()[1]

    def allreduce_(self, tensor, average=True, name=None):
        """``tensor`` replaced, in place, by its sum over the ranks, or its
        average when ``average``; returns it. ``name``: the collective's
        name where the framework names them (alike on every rank)."""
        raise NotImplementedError

    def max(self, values, device):
        """Each of ``values`` (floats) maxed over the ranks, as a list of
        floats: the measured choice's agreement. ``device``: where the
        tensor that carries them may live (the gradients' device)."""
        raise NotImplementedError

    def agreement(self, device, timeout=None, what="the settings' agreement", who="oktopk"):
        """``(gather_digests, gather_settings)`` for
        :func:`oktopk.settings.check_agreement`: every rank's digest bytes
        through one fixed-size collective, and every rank's settings dict
        (called only on a mismatch), each in rank order. ``timeout``
        (seconds), where the framework can bound a wait: the digests'
        gather raises ``OkTopkError`` (TIMEOUT) naming ``what`` after it."""
        raise NotImplementedError

    def communicator(self, algorithm, density, tau=None, tau_prime=None, timeout=None, value_dtype="float32", stochastic_rounding=False):
        """A new :class:`oktopk.Communicator` over these ranks (every rank
        calls this at once: its rendezvous is a collective)."""
        raise NotImplementedError

    def check_agreement(self, settings, device, who="oktopk"):
        """Raise ``OkTopkError`` (MISMATCH) on every rank, naming each
        setting that differs and every rank's value, unless every rank
        holds ``settings`` (a dict of plain values): one fixed-size gather
        through :meth:`agreement`, whatever the settings."""
        check_agreement(settings, *self.agreement(device), who=who)


class ProcessGroupCollectives(Collectives):
    """:class:`Collectives` over a torch.distributed process group
    (``None``: the default group), as the DDP hook and FSDP2 run them."""

    def __init__(self, process_group=None):
        self.process_group = process_group

    def placement(self):
        if not dist.is_available() or not dist.is_initialized():
            return None
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    def rank(self):
        return dist.get_rank(self.process_group)

    def size(self):
        return dist.get_world_size(self.process_group)

    def allreduce_(self, tensor, average=True, name=None):
        with peer_failures_named(f"the allreduce{f' of {name}' if name else ''}"):
            dist.all_reduce(tensor, group=self.process_group)
        if average:
            tensor.div_(dist.get_world_size(self.process_group))
        return tensor

    def max(self, values, device):
        # On the gradients' device, as NCCL needs (it reduces no float64).
        t = torch.tensor(values, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
        with peer_failures_named("the measured choice's agreement"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return [float(v) for v in t.tolist()]

    def agreement(self, device, timeout=None, what="the settings' agreement", who="oktopk"):
        return process_group_agreement(self.process_group, device, timeout=timeout, what=what, who=who)

    def communicator(self, algorithm, density, tau=None, tau_prime=None, timeout=None, value_dtype="float32", stochastic_rounding=False):
        return Communicator(self.process_group, algorithm, density, tau, tau_prime, timeout, value_dtype=value_dtype,
                            stochastic_rounding=stochastic_rounding)

    def __repr__(self):
        return f"ProcessGroupCollectives({self.process_group!r})"
