"""What the Horovod front end asks of every rank through Horovod's own
collectives: the measured choice's agreement, the settings' agreement, the
check that a checkpoint is this rank's, and the address to bind.
"""

import os

import horovod.torch as hvd
import torch

from oktopk.comm import route_source_address


def agree_max(values):
    """The measured choice's agreement: each value's max over the ranks.
    Not oktopk.step.agree_max: that one runs on the process group (on the
    bucket's device, as NCCL needs); here Horovod's allreduce, on the CPU,
    over every Horovod rank."""
    return [float(v) for v in hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=hvd.Max, name="oktopk.choice").tolist()]


def horovod_agreement(name):
    """(gather_digests, gather_settings) for oktopk.settings.check_agreement
    over every Horovod rank: the digests in one fixed-size allgather."""
    def gather_digests(digest):
        every = hvd.allgather(torch.tensor([list(digest)], dtype=torch.int64), name=f"{name}.digest")
        return [bytes(row.tolist()) for row in every]

    def gather_settings(settings):
        return hvd.allgather_object(settings, name=f"{name}.values")

    return gather_digests, gather_settings


def check_owner(saved_rank, saved_size):
    """Refuse a checkpoint of another rank or world size, saying what to do
    (OkTopkState._check_owner's check, in Horovod's terms: its rank, and
    what to save and gather with)."""
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
