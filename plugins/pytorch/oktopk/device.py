"""The device path: selection and residuals where the gradients live.

The staging path copies a CUDA bucket whole to pinned host memory, where
the library selects and reduces it, and copies the whole dense result back:
2 × n values across PCIe and CPU passes over n every step. On the device
path the bucket stays on its device:

1. acc = grad + residual is formed there (float32), and checked for NaN/Inf;
2. the local selection runs there with torch ops, by the library's rules
   (``select_by_rules``: the exact top-k on an exact call, the reused and
   nudged threshold otherwise), for the k, exactness and threshold the
   library plans (``Communicator.selection_plan``);
3. only the selected (index, value) pairs cross to the host, into the
   library's caller-selected call (Ok-Topk's steps 2–5, the thresholds,
   boundaries and call count kept in the library);
4. the averaged global result comes back as pairs and is scattered into
   the bucket on the device, and the residual is updated there: acc, less
   what this rank sent of the result, plus an owner's 16-bit rounding errors.

For the same inputs this is the staging path's arithmetic, bit for bit
(``tests/python/test_device.py`` runs both on CPU tensors, the device path
forced on). The bytes between host and device per call are 8 per selected
pair out and 8 per result, consumed and error pair back, plus a few counts:
``host_device_bytes``.

The rules' constants are read from the library (oktopk_selection_rules).
"""

import struct

import torch

from . import _lib
from ._lib import OkTopkError

# Indices cross as int32: the device path takes tensors below 2^31 entries.
MAX_ELEMENTS = 2**31 - 1


def f32(x):
    """x rounded to float32 (to nearest), as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def exact_top_k(magnitude, k):
    """The k largest magnitudes' indices (ascending) and the threshold the
    library keeps after an exact selection: the (k+1)-th largest magnitude,
    0 when k = n. One scalar crosses to the host."""
    n = magnitude.numel()
    if k >= n:
        return torch.arange(n, device=magnitude.device), 0.0
    values, indices = torch.topk(magnitude, k + 1, sorted=True)
    return indices[:k].sort().values, float(values[k])


def select_by_rules(magnitude, k, threshold, exact):
    """The library's local selection of |acc| (``magnitude``, float32, on
    any device) for the plan (k, exact, threshold): returns the selected
    indices (ascending, int64) and the threshold for the next call, and
    how many counts crossed to the host (for the byte count)."""
    n = magnitude.numel()
    if k == 0 or n == 0:
        return torch.empty(0, dtype=torch.int64, device=magnitude.device), threshold, 0
    if exact or threshold <= 0:
        indices, th = exact_top_k(magnitude, k)
        return indices, th, 1
    rules = _rules()
    limit = rules.too_many * k
    th = threshold
    count, syncs = int((magnitude > th).sum()), 1
    raises = 0
    while count > limit and raises < rules.max_raises:
        th = f32(th * rules.raise_)
        count, syncs, raises = int((magnitude > th).sum()), syncs + 1, raises + 1
    if count > limit or count < rules.too_few * k:
        indices, th = exact_top_k(magnitude, k)
        return indices, th, syncs + 1
    indices = torch.nonzero(magnitude > th).flatten()
    if count < rules.nudge_low * k:
        th = f32(th * rules.nudge_down)
    elif count > rules.nudge_high * k:
        th = f32(th * rules.nudge_up)
    return indices, th, syncs


_RULES = None


def _rules():
    global _RULES
    if _RULES is None:
        _RULES = _lib.selection_rules()
    return _RULES


class DeviceGroup:
    """One tensor's (a DDP group's) device-path state: its residual on the
    device, and the host memory its calls reuse."""

    def __init__(self, n, device):
        self.residual = torch.zeros(n, dtype=torch.float32, device=device)
        self.scratch = torch.empty(n, dtype=torch.float32, device=device)  # acc, then swapped in as the residual

    def checkpoint(self, comm, tensor_id):
        """The library's checkpoint of this tensor with its residual."""
        return comm.save_tensor_state_residual(tensor_id, self.residual.to("cpu"))

    def load(self, comm, tensor_id, blob):
        """Install a checkpoint (either path's) in the library for
        caller-selected calls, its residual here."""
        host = torch.empty(self.residual.numel(), dtype=torch.float32)
        comm.load_tensor_state_residual(tensor_id, blob, host)
        self.residual.copy_(host)


class HostBuffers:
    """Pinned (for CUDA) host memory for one call's pairs, grown as needed
    and reused (the worker thread makes one call at a time)."""

    def __init__(self):
        self.buffers = {}

    def take(self, name, n, dtype, pinned):
        buf = self.buffers.get((name, pinned))
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 1), dtype=dtype, pin_memory=pinned)
            self.buffers[(name, pinned)] = buf
        return buf[:n]


def selected_call(comm, tensor_id, n, k, dtype, indices, values, threshold, non_finite, host, density=None, tau_prime=None):
    """One caller-selected call from any device: this rank's selection
    (``indices``, ascending, and float32 ``values``, on the device) crosses
    to host memory from ``host`` (a :class:`HostBuffers`), the library
    reduces it (k: the plan's), and the result, consumed and error pairs
    come back to the device. Returns (statistics, those six tensors), or
    (None, None) when some rank's acc held NaN or Inf (the step is skipped
    everywhere). On CUDA the caller synchronizes its stream before the
    next call reuses the host memory."""
    device = values.device
    pinned = device.type == "cuda"
    count = indices.numel()
    sel_i = host.take("sel_i", count, torch.int32, pinned)
    sel_v = host.take("sel_v", count, torch.float32, pinned)
    sel_i.copy_(indices.to(torch.int32))
    sel_v.copy_(values)
    cap = comm.selected_capacity(n, k)
    out = (host.take("res_i", cap, torch.int32, pinned), host.take("res_v", cap, torch.float32, pinned),
           host.take("con_i", count, torch.int32, pinned), host.take("con_v", count, torch.float32, pinned),
           host.take("err_i", cap, torch.int32, pinned), host.take("err_v", cap, torch.float32, pinned))
    try:
        stats, results, consumed, errors = comm.sparse_allreduce_selected(
            tensor_id, n, dtype, sel_i, sel_v, threshold, non_finite, out, density, tau_prime)
    except OkTopkError as e:
        if e.code != _lib.NON_FINITE:
            raise
        return None, None
    lengths = (results, results, consumed, consumed, errors, errors)
    return stats, tuple(t[:m].to(device, non_blocking=True) for t, m in zip(out, lengths))


def sparse_allreduce_(comm, tensor_id, grad, group, host, hold=(), density=None, tau_prime=None):
    """The device path of one call: ``grad`` (1-D, contiguous, float32,
    float16 or bfloat16, on any device) becomes the averaged sparse global
    result in place, and ``group.residual`` the new residual; ``hold``:
    (start, end) ranges this rank holds back (never selected, kept in the
    residual). Returns (statistics, bytes between host and device, selected
    and result pairs), the statistics None when some rank's acc held NaN or
    Inf: the step is skipped
    on every rank, ``grad`` becomes NaN, the residual is unchanged. A failed
    call raises and changes neither."""
    n = grad.numel()
    device = grad.device
    pinned = device.type == "cuda"
    k, exact, threshold = comm.selection_plan(tensor_id, n, density, tau_prime)
    acc = group.scratch
    torch.add(grad, group.residual, out=acc)  # float32: grad + residual, as the library forms it
    moved = 8  # the finiteness flag
    non_finite = not bool(torch.isfinite(acc).all())
    if non_finite:
        indices = torch.empty(0, dtype=torch.int64, device=device)
        new_threshold = threshold
    else:
        magnitude = acc.abs()
        for a, b in hold:
            magnitude[a:b] = 0  # held entries read as zero, and are dropped below
        indices, new_threshold, syncs = select_by_rules(magnitude, k, threshold, exact)
        moved += 8 * syncs
        del magnitude
        if hold:
            keep = torch.ones(indices.numel(), dtype=torch.bool, device=device)
            for a, b in hold:
                keep &= (indices < a) | (indices >= b)
            indices = indices[keep]
    count = indices.numel()
    moved += 8 * count
    stats, pairs = selected_call(comm, tensor_id, n, k, grad.dtype, indices, acc[indices], new_threshold, non_finite, host,
                                 density, tau_prime)
    if stats is None:
        grad.fill_(float("nan"))
        return None, moved, count
    ri, rv, ci, cv, ei, ev = pairs
    results, consumed, errors = ri.numel(), ci.numel(), ei.numel()
    moved += 8 * (results + consumed + errors)
    # The residual: acc, less what this rank sent of the result, plus an
    # owner's rounding errors, each non-finite sum 0 (core/residual.go).
    if consumed:
        ci = ci.long()
        acc[ci] = _finite_or_0(acc[ci] - cv)
    if errors:
        ei = ei.long()
        acc[ei] = _finite_or_0(acc[ei] + ev)
    group.residual, group.scratch = acc, group.residual
    grad.zero_()
    if results:
        grad[ri.long()] = rv.to(grad.dtype)
    if pinned:
        # The host buffers are reused by the next call: its copies wait.
        torch.cuda.current_stream(device).synchronize()
    return stats, moved, count + results


def fold_(grad, group, hold=()):
    """Before a dense allreduce of ``grad`` (1-D, on the residual's device):
    grad += residual outside ``hold``, rounded to grad's dtype, and the
    residual keeps only the held entries and that rounding's error, as the
    library's oktopk_tensor_residual_fold does. When a sum is NaN or Inf
    nothing changes (the dense result is non-finite, the step skipped):
    returns whether it folded."""
    total = grad + group.residual  # float32
    free = torch.ones(grad.numel(), dtype=torch.bool, device=grad.device)
    for a, b in hold:
        free[a:b] = False
    if not bool(torch.isfinite(total[free]).all()):
        return False
    rounded = total.to(grad.dtype)
    grad.copy_(torch.where(free, rounded, grad))
    group.residual.copy_(torch.where(free, total - rounded.float(), group.residual))
    return True


def _finite_or_0(x):
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))
