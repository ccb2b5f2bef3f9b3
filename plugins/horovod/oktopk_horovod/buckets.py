"""The Horovod optimizer's buckets: its parameters grouped in the order of
their names, and one bucket reduced on the step's path, on the optimizer's
worker thread.

The paths are NATIVE and SPARSE (``oktopk.choice``), and what they share
with the DDP hook's (``oktopk.paths``) is shared: whether a bucket takes
the device path, its device group, the device call and the saving of its
state are ``oktopk.path_sparse``'s. The rest is Horovod's own, and why:

* NATIVE is Horovod's allreduce (``hvd.allreduce_``, under the
  optimizer's op), not ``oktopk.path_native``'s: a Horovod job need not
  have a torch.distributed process group;
* a bucket is a list of separate gradient tensors, staged once for either
  path (not one DDP buffer in a group's layout, with parameters to hold
  back), and its call's density and τ′ were fixed when it was issued
  (the optimizer's ``_call``), not read on the worker thread;
* op=hvd.Sum scales the library's average back into a sum, and the
  optimizer's ``synchronize()`` shows the step's sums to the folds itself.
"""

import hashlib

import horovod.torch as hvd
import torch

from oktopk.choice import NATIVE
from oktopk import device as device_path_
from oktopk.path_sparse import device_call, device_group, device_path_wanted, took_call


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


def reduce_bucket(opt, bucket, call):
    """Worker thread: the bucket's gradients (of the optimizer ``opt``)
    replaced by their average (or sum, under op=hvd.Sum), through the path
    of ``call``: NATIVE, or this step's (density, ξ step, τ′)."""
    for p in bucket.params:
        if p.grad.is_sparse:
            if not opt._sparse_as_dense:
                raise ValueError(
                    "oktopk: a parameter has a sparse gradient (nn.Embedding(sparse=True)); "
                    "pass sparse_as_dense=True to reduce it as a dense gradient"
                )
            p.grad = p.grad.to_dense()
    grads = [p.grad for p in bucket.params]
    cuda = grads[0].device.type != "cpu"
    if takes_device_path(opt, grads):
        _reduce_on_device(opt, bucket, grads, call)
        return
    if not cuda and len(grads) == 1 and grads[0].is_contiguous():
        host = grads[0].view(-1)  # in place
    else:
        # The one copy of a bucket that remains, and why: the library
        # reduces one contiguous vector in host memory, and a bucket's
        # gradients are separate tensors (on the GPU for CUDA, copied
        # to pinned memory: DMA transfers, no device-side concatenation).
        # The staging memory is the reducer's, reused.
        host = opt._reducer.staging_for(sum(g.numel() for g in grads), grads[0].dtype, cuda)
        at = 0
        for g in grads:
            host[at : at + g.numel()].view_as(g).copy_(g)
            at += g.numel()
    if call == NATIVE:
        # Horovod's own allreduce of the bucket, its residual (left by
        # sparse steps) folded in first so nothing waits or is lost.
        if bucket.tensor_id in opt._residual_groups:
            comm, tid = opt._reducer.comm, bucket.tensor_id
            comm.fold_residual_(tid, host)
            opt._folds.took(lambda: (comm.unfold_residual(tid), opt._residual_groups.add(tid)))
            opt._residual_groups.discard(tid)
        opt._collectives.allreduce_(host, average=opt._op == hvd.Average, name=f"oktopk.native.{bucket.index}")
    else:
        if cuda:
            opt._reducer.count_host_device(2 * host.numel() * host.element_size())
        # A step the library skipped (NaN or Inf on some rank) comes back
        # as NaN on every rank, as Horovod's dense average would, so AMP's
        # scaler or the user's own check skips it everywhere.
        # Another bucket's NaN can void the step after this call completed:
        # it is taken back then (took_call, the DDP hook's rule).
        density, xi_step, tau_prime = call
        had_residual, undoable = bucket.tensor_id in opt._residual_groups, len(opt._buckets) != 1
        opt._residual_groups.add(bucket.tensor_id)
        stats = opt._reducer.sparse_allreduce_(bucket.tensor_id, host, density=density, xi_step=xi_step, tau_prime=tau_prime,
                                               sparse_only=opt._choice is not None, undoable=undoable)
        took_call(opt, bucket.tensor_id, stats, had_residual, undoable=undoable)
        opt._stateful_ids.add(bucket.tensor_id)
        if opt._op == hvd.Sum:
            host.mul_(opt._collectives.size())
    if host.data_ptr() != grads[0].data_ptr():
        at = 0
        for g in grads:
            g.copy_(host[at : at + g.numel()].view_as(g))
            at += g.numel()


def takes_device_path(opt, grads):
    """Whether a bucket of these gradients takes the device path (see
    Compression.oktopk's device_path): the DDP hook's rule, on the
    compressor's settings."""
    c = opt._compressor
    return device_path_wanted(c.device_path, c.algorithm, opt._measure_xi_every, opt._reducer.adaptive, grads[0].device,
                              sum(g.numel() for g in grads))


def _reduce_on_device(opt, bucket, grads, call):
    """reduce_bucket on the device path: the bucket's gradients gathered on
    their device (one of them: used in place), reduced there with only
    pairs crossing to the library, and written back."""
    whole = len(grads) == 1 and grads[0].is_contiguous()
    flat = grads[0].view(-1) if whole else torch.cat([g.reshape(-1) for g in grads])
    tid = bucket.tensor_id
    # A loaded checkpoint's residual (its id in _library_ids) moves here.
    made = tid not in opt._device_groups and tid not in opt._library_ids
    group = device_group(opt._device_groups, opt._library_ids, opt._reducer.comm, tid, flat.numel(), flat.device)
    if call == NATIVE:
        residual = group.residual.clone() if tid in opt._residual_groups else None
        if residual is not None and device_path_.fold_(flat, group):
            opt._folds.took(lambda: (group.residual.copy_(residual), opt._residual_groups.add(tid)))
            opt._residual_groups.discard(tid)
        opt._collectives.allreduce_(flat, average=opt._op == hvd.Average, name=f"oktopk.native.{bucket.index}")
    else:
        density, _, tau_prime = call
        had_residual = tid in opt._residual_groups
        opt._residual_groups.add(tid)
        stats = device_call(opt._reducer, opt._host_buffers, tid, flat, group, density=density, tau_prime=tau_prime)
        took_call(opt, tid, stats, had_residual, group, made)
        opt._stateful_ids.add(tid)
        if opt._op == hvd.Sum:
            flat.mul_(opt._collectives.size())
    if not whole:
        at = 0
        for g in grads:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()


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
