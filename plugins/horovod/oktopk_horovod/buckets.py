"""The Horovod optimizer's buckets: its parameters grouped in the order of
their names, each under a library tensor id derived from those names, so
that the same bucket means the same thing on every rank, in every step and
after a restart. The engine (``oktopk.Engine``) reduces each one as one of
its fixed groups.
"""

import hashlib

import horovod.torch as hvd


class Bucket:
    """Parameters reduced together, under a library tensor id derived from
    their names (the same on every rank and after a restart)."""

    __slots__ = ["index", "tensor_id", "params", "pending", "future"]

    def __init__(self, index, names, params):
        self.index = index
        self.tensor_id = int.from_bytes(hashlib.blake2b("\0".join(names).encode(), digest_size=8).digest(), "little")
        self.params = params
        self.pending = 0  # parameters whose gradient is not final yet
        self.future = None


def parameters_by_name(param_groups, named_parameters):
    """(name, parameter) for every trainable parameter the optimizer holds,
    sorted by name; without names, positional ones as Horovod makes them."""
    params = [p for group in param_groups for p in group["params"] if p.requires_grad]
    if named_parameters is None:
        named = [(f"allreduce.noname.{i}", p) for i, p in enumerate(params)]
    else:
        named = list(named_parameters)
        if len({name for name, _ in named}) != len(named):
            raise ValueError("named_parameters contains duplicate names")
        known = {id(p) for _, p in named}
        missing = [i for i, p in enumerate(params) if id(p) not in known]
        if missing:
            raise ValueError("named_parameters was specified, but one or more model parameters were not named")
        held = {id(p) for p in params}
        named = [(name, p) for name, p in named if id(p) in held]
    return sorted(named, key=lambda item: item[0])


def check_ranks_agree(names):
    digest = hashlib.blake2b("\0".join(names).encode(), digest_size=16).hexdigest()
    digests = hvd.allgather_object(digest, name="oktopk.names")
    if len(set(digests)) != 1:
        raise ValueError("oktopk: ranks hold different parameter names; every rank must wrap the same model")


def make_buckets(named, bucket_bytes):
    buckets, names, params, size = [], [], [], 0
    for name, p in named:
        if params and (size + p.numel() * p.element_size() > bucket_bytes or p.dtype != params[0].dtype):
            buckets.append(Bucket(len(buckets), names, params))
            names, params, size = [], [], 0
        names.append(name)
        params.append(p)
        size += p.numel() * p.element_size()
    if params:
        buckets.append(Bucket(len(buckets), names, params))
    return buckets
