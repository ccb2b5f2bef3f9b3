"""A liboktopk communicator for the ranks of a torch.distributed process
group, set up through the group itself (rank 0's job token) and its store
(every rank's endpoint, under keys of that token): no extra port or
environment variable for the user."""

import ctypes
import datetime
import hashlib
import ipaddress
import itertools
import math
import os
import socket

import torch
import torch.distributed as dist

from . import _lib
from ._lib import OkTopkError
from .store import bounded, store_for, wait_for

_DTYPES = {torch.float32: _lib.FLOAT32, torch.float16: _lib.FLOAT16, torch.bfloat16: _lib.BFLOAT16}
_VALUE_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def value_dtype_name(value_dtype):
    """The name of the format sparse values travel in (a name of
    ``_lib.VALUE_DTYPES``), given as that name or, for the float formats,
    as the torch dtype; ValueError for anything else."""
    if isinstance(value_dtype, torch.dtype):
        name = _VALUE_DTYPE_NAMES.get(value_dtype)
    else:
        name = value_dtype if isinstance(value_dtype, str) and value_dtype in _lib.VALUE_DTYPES else None
    if name is None:
        raise ValueError(f"value_dtype must be one of {', '.join(_lib.VALUE_DTYPES)} (a name; the first three also as a torch dtype), "
                         f"got {value_dtype!r}")
    return name

def from_rank_zero(group, value, timeout, what):
    """Rank 0's ``value`` (bytes, at most 255; None on the other ranks) on
    every rank of ``group``, broadcast over the group itself, waiting at
    most ``timeout`` seconds: a rank that stopped or died before it raises
    OkTopkError (TIMEOUT) naming ``what``, not after the process group's
    own timeout (torchrun's: 30 minutes)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    buf = torch.zeros(256, dtype=torch.uint8, device=device)
    if value is not None:
        if len(value) > 255:
            raise ValueError(f"oktopk: {what}: {len(value)} bytes, at most 255 travel")
        buf[0] = len(value)
        buf[1:1 + len(value)] = torch.tensor(list(value), dtype=torch.uint8)
    src = 0 if group is None or group is dist.GroupMember.WORLD else dist.get_global_rank(group, 0)
    try:
        work = dist.broadcast(buf, src=src, group=group, async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise OkTopkError(_lib.TIMEOUT, f"communicator setup: {what} did not come over the process group within {timeout:g} s: "
                                        f"rank 0 stopped, died, or is still in an earlier step ({e})") from e
    data = buf.cpu()
    return bytes(data[1:1 + int(data[0])].tolist())


# Communicators are created in the same order on every rank (the training
# script is the same), so a per-process counter names each one's store keys.
_instance_counter = itertools.count()


def _store_address(group):
    """(host, port) of the store the process group rendezvoused through:
    the TCPStore's own address, else MASTER_ADDR/MASTER_PORT."""
    store = dist.distributed_c10d._get_default_store()
    for _ in range(16):  # PrefixStores wrap the TCPStore
        if isinstance(store, dist.TCPStore):
            return store.host, store.port
        store = getattr(store, "underlying_store", None)
        if store is None:
            break
    host = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT", "0")
    return (host, int(port)) if host else None


def _is_loopback(host):
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def route_source_address(host, port):
    """This machine's IPv4 address on the route to (host, port), or None
    when host is loopback or unreachable: the ``bind_host`` to give
    :meth:`Communicator.from_exchange` when ranks on other hosts must reach
    this one (route to the launcher's rendezvous server, say). A UDP
    connect() picks the route and getsockname() reads the source address;
    no packet is sent."""
    if _is_loopback(host):
        return None
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, address in infos:
        if _is_loopback(address[0]):
            return None  # the store's name resolves to this machine's loopback
        with socket.socket(family, kind, proto) as s:
            try:
                s.connect(address)
            except OSError:
                continue
            source = s.getsockname()[0]
            if source != "0.0.0.0":
                return source
    return None


def default_bind_host(group=None):
    """The address a rank binds and advertises when the user named none:
    the one that routes to the store's host, so that ranks on other hosts
    can reach it, or None (the library's default: OKTOPK_SOCKET_IFNAME's
    address, else loopback) when OKTOPK_SOCKET_IFNAME is set or the store
    is on loopback (a single-machine job)."""
    if os.environ.get("OKTOPK_SOCKET_IFNAME"):
        return None
    address = _store_address(group)
    return route_source_address(*address) if address else None


class XiTally:
    """ξ of one step over the calls (buckets) that measured it: the root of
    the summed squared distances over the root of the summed squared
    gradient norms (a call's distance is its xi times its norm), so that it
    is the ξ of the whole gradient, not an average of the buckets'."""

    def __init__(self):
        self.step, self._num2, self._den2 = None, 0.0, 0.0

    def add(self, step, xi, norm):
        """Add a call of ``step`` (a newer step starts afresh); returns the
        step's ξ so far."""
        if step != self.step:
            self.step, self._num2, self._den2 = step, 0.0, 0.0
        self._num2 += (xi * norm) ** 2 if norm > 0 else (0.0 if xi == 0 else math.inf)
        self._den2 += norm * norm
        num, den = math.sqrt(self._num2), math.sqrt(self._den2)
        return 0.0 if num == 0 else num / den if den > 0 else math.inf


class Communicator:
    """One liboktopk communicator over the ranks of ``group``.

    Settings left None take the library's own defaults
    (``oktopk_config_init``). Setup waits on the store for at most
    ``timeout`` seconds. ``bind_host``
    is the address to bind and advertise; by default the one on the route to
    the store's host (see :func:`default_bind_host`).

    ``value_dtype`` ("float32", "float16" or "bfloat16") is the precision
    selected values travel in, rounded stochastically when
    ``stochastic_rounding``; the rounding errors stay in the residuals.

    Calls must come from one thread at a time: a call made from another
    thread while one runs raises ``OkTopkError`` (code ``INVALID_USAGE``)
    and is not made."""

    def __init__(self, group=None, algorithm=None, density=None, tau=None, tau_prime=None, timeout=None, bind_host=None,
                 value_dtype="float32", stochastic_rounding=False):
        if timeout is None:
            timeout = _lib.library_default_config().timeout_ms / 1000
        number = next(_instance_counter)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        shared = {}

        def share_token(token):
            # Over the process group, not the store: the store may outlive
            # the group (torchrun's agent keeps one store across its
            # restarts), so a token read there could be an earlier
            # incarnation's, and the endpoints beside it too.
            shared["token"] = from_rank_zero(group, token, timeout, "rank 0's job token")
            return shared["token"]

        def gather_endpoints(endpoint):
            # Under keys of this incarnation's own token: none an earlier
            # incarnation wrote can be read as this one's.
            generation = hashlib.sha256(shared["token"]).hexdigest()[:16]
            store = dist.PrefixStore(f"c{number}/{generation}/", store_for(group))

            def exchange():
                store.set(f"ep/{rank}", endpoint)
                keys = [f"ep/{r}" for r in range(size)]
                missing = lambda: "ranks " + ", ".join(str(r) for r in range(size) if not store.check([keys[r]]))  # noqa: E731
                wait_for(store, keys, timeout, "every rank's endpoint", missing)
                return [store.get(k) for k in keys]

            return bounded(exchange, timeout, "every rank's endpoint")

        self.group = group
        if bind_host is None:
            bind_host = default_bind_host(group)
        self._connect(rank, size, share_token, gather_endpoints, algorithm, density, tau, tau_prime, timeout, bind_host,
                      value_dtype, stochastic_rounding)

    @classmethod
    def from_exchange(cls, rank, size, share_token, gather_endpoints, algorithm=None, density=None, tau=None, tau_prime=None, timeout=None,
                      bind_host=None, value_dtype="float32", stochastic_rounding=False):
        """A communicator whose rendezvous goes through the caller's own
        collectives (Horovod's, say): ``share_token(token_or_None)`` returns
        rank 0's token bytes on every rank, ``gather_endpoints(endpoint)``
        returns every rank's endpoint bytes in rank order. ``bind_host``:
        None is the library's default (OKTOPK_SOCKET_IFNAME, else loopback).
        ``algorithm`` None is the library's default algorithm."""
        self = cls.__new__(cls)
        self.group = None
        self._connect(rank, size, share_token, gather_endpoints, algorithm, density, tau, tau_prime, timeout, bind_host,
                      value_dtype, stochastic_rounding)
        return self

    def _connect(self, rank, size, share_token, gather_endpoints, algorithm, density, tau, tau_prime, timeout, bind_host=None,
                 value_dtype="float32", stochastic_rounding=False):
        self.rank, self.size, self.handle = rank, size, 0
        lib = _lib.lib()
        host = bind_host.encode() if bind_host else None  # outlives cfg's pointer to it
        cfg = _lib.default_config(algorithm, density, tau, tau_prime, timeout, host, value_dtype_name(value_dtype), stochastic_rounding)
        mine = None
        if rank == 0:
            buf = ctypes.create_string_buffer(128)
            _lib.check(lib.oktopk_make_token(buf, len(buf)))
            mine = buf.value
        token = share_token(mine)
        handle = ctypes.c_int64(0)
        endpoint = ctypes.create_string_buffer(256)
        _lib.check(lib.oktopk_comm_bind(ctypes.byref(handle), size, rank, token, ctypes.byref(cfg), endpoint, len(endpoint)))
        self.handle = handle.value
        self.endpoint = endpoint.value.decode()  # what this rank advertises, tcp://host:port
        try:
            endpoints = gather_endpoints(endpoint.value)
            if len(endpoints) != size:
                raise ValueError(f"oktopk: gather_endpoints returned {len(endpoints)} endpoints for {size} ranks")
            array = (ctypes.c_char_p * size)(*endpoints)
            self._check(lib.oktopk_comm_connect(self.handle, array, size))
        except BaseException:
            lib.oktopk_comm_destroy(self.handle)
            self.handle = 0
            raise

    def _check(self, code):
        _lib.check(code, self.handle)

    def sparse_allreduce_(self, tensor_id, tensor, hold=(), density=None, measure_xi=False, tau_prime=None, sparse_only=False,
                          undoable=False):
        """Averaged sparse allreduce of a contiguous CPU tensor, in place,
        with error feedback kept under ``tensor_id``. ``hold`` lists
        ascending, disjoint (start, end) ranges of the tensor this rank holds
        back for this call: not sent, kept in its residual (for entries whose
        result the caller discards). ``density`` and ``tau_prime`` (None: the
        communicator's) are this call's; ``measure_xi`` also measures ξ (the
        stats' ``xi``, -1 when not measured). Every rank must pass the same
        density, tau_prime and measure_xi. ``undoable``: keep what
        :meth:`undo_call` needs (a copy of the residual before the call; a
        rank's own choice). Returns the call's statistics."""
        dtype = _DTYPES.get(tensor.dtype)
        if dtype is None:
            raise TypeError(f"oktopk: unsupported dtype {tensor.dtype} (float32, float16, bfloat16)")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("oktopk: sparse_allreduce_ needs a contiguous CPU tensor")
        stats = _lib.new_stats()
        # One entry point for every sparse call: the _ex form's options
        # carry whatever this call sets.
        opts = self._options(density, tau_prime)
        if measure_xi:
            opts.flags |= _lib.CALL_MEASURE_XI
        if sparse_only:
            opts.flags |= _lib.CALL_SPARSE_ONLY
        if undoable:
            opts.flags |= _lib.CALL_UNDOABLE
        if hold:
            ranges = (ctypes.c_size_t * (2 * len(hold)))(*(x for r in hold for x in r))
            opts.hold, opts.hold_count = ranges, len(hold)
        self._check(_lib.lib().oktopk_sparse_allreduce_ex(
            self.handle, tensor_id, tensor.data_ptr(), tensor.numel(), dtype, ctypes.byref(opts), ctypes.byref(stats)))
        return stats

    @staticmethod
    def _options(density=None, tau_prime=None):
        """A call's options with its density and τ′ (None: the
        communicator's)."""
        opts = _lib.CallOptions(size=ctypes.sizeof(_lib.CallOptions))
        if density is not None:
            opts.flags |= _lib.CALL_DENSITY
            opts.density = density
        if tau_prime is not None:
            opts.flags |= _lib.CALL_TAU_PRIME
            opts.tau_prime = tau_prime
        return opts

    def selection_plan(self, tensor_id, n, density=None, tau_prime=None):
        """The plan of ``tensor_id``'s next caller-selected call on n
        elements (see :meth:`sparse_allreduce_selected`): (k, exact,
        threshold), the threshold a Python float holding a float32."""
        plan = _lib.SelectionPlan()
        self._check(_lib.lib().oktopk_selection_plan(self.handle, tensor_id, n, ctypes.byref(self._options(density, tau_prime)),
                                                     ctypes.byref(plan)))
        return plan.k, bool(plan.exact), plan.threshold

    def selected_capacity(self, n, k):
        """The most entries a caller-selected call returns as its result or
        its errors on this communicator."""
        return _lib.lib().oktopk_selected_capacity(n, k, self.size)

    def sparse_allreduce_selected(self, tensor_id, n, dtype, indices, values, threshold, non_finite, out, density=None, tau_prime=None):
        """One caller-selected call (include/oktopk.h): this rank's selection
        (``indices`` int32 and ``values`` float32, contiguous CPU tensors,
        ascending) of a tensor of n elements whose gradient is of ``dtype``,
        and the local threshold the selection rules left. ``out`` holds six
        contiguous CPU tensors (result, consumed and error indices int32 and
        values float32), each at least ``selected_capacity`` long (consumed:
        the selection's length). Returns (statistics, result count, consumed
        count, error count)."""
        code = _DTYPES.get(dtype)
        if code is None:
            raise TypeError(f"oktopk: unsupported dtype {dtype} (float32, float16, bfloat16)")
        ri, rv, ci, cv, ei, ev = out
        io = _lib.Selected(size=ctypes.sizeof(_lib.Selected))
        io.indices, io.values, io.count = indices.data_ptr(), values.data_ptr(), indices.numel()
        io.threshold, io.non_finite = threshold, int(bool(non_finite))
        io.result_indices, io.result_values, io.result_capacity = ri.data_ptr(), rv.data_ptr(), min(ri.numel(), rv.numel())
        io.consumed_indices, io.consumed_values, io.consumed_capacity = ci.data_ptr(), cv.data_ptr(), min(ci.numel(), cv.numel())
        io.error_indices, io.error_values, io.error_capacity = ei.data_ptr(), ev.data_ptr(), min(ei.numel(), ev.numel())
        stats = _lib.new_stats()
        self._check(_lib.lib().oktopk_sparse_allreduce_selected(self.handle, tensor_id, n, code, ctypes.byref(self._options(density, tau_prime)),
                                                                ctypes.byref(io), ctypes.byref(stats)))
        return stats, io.result_count, io.consumed_count, io.error_count

    def save_tensor_state_residual(self, tensor_id, residual):
        """A caller-selected tensor's checkpoint, with the caller's residual
        (a contiguous float32 CPU tensor), in save_tensor_state's format."""
        lib = _lib.lib()
        size = ctypes.c_size_t(0)
        self._check(lib.oktopk_tensor_state_size(self.handle, tensor_id, ctypes.byref(size)))
        buf = ctypes.create_string_buffer(size.value)
        self._check(lib.oktopk_tensor_state_save_residual(self.handle, tensor_id, residual.data_ptr(), residual.numel(), buf, size.value))
        return buf.raw

    def load_tensor_state_residual(self, tensor_id, blob, residual):
        """Install a checkpoint (either form's) for caller-selected calls,
        its residual written into ``residual`` (a contiguous float32 CPU
        tensor of the tensor's length)."""
        buf = ctypes.create_string_buffer(blob, len(blob))
        self._check(_lib.lib().oktopk_tensor_state_load_residual(self.handle, tensor_id, buf, len(blob), residual.data_ptr(), residual.numel()))

    def fold_residual_(self, tensor_id, tensor, hold=()):
        """Move ``tensor_id``'s residual into a contiguous CPU tensor, in
        place, before the caller reduces it with a dense allreduce of its
        own: the entries outside ``hold`` (ranges as in
        :meth:`sparse_allreduce_`) gain their residual, rounded to the
        tensor's dtype, and the residual keeps only the held entries and the
        rounding's error, so no gradient mass is lost. Nothing changes for a
        tensor without state, or when a sum is NaN or Inf (the dense result
        is then non-finite and the step skipped). Local: no communication."""
        dtype = _DTYPES.get(tensor.dtype)
        if dtype is None:
            raise TypeError(f"oktopk: unsupported dtype {tensor.dtype} (float32, float16, bfloat16)")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("oktopk: fold_residual_ needs a contiguous CPU tensor")
        ranges = (ctypes.c_size_t * (2 * len(hold)))(*(x for r in hold for x in r)) if hold else None
        self._check(_lib.lib().oktopk_tensor_residual_fold(
            self.handle, tensor_id, tensor.data_ptr(), tensor.numel(), dtype, ranges, len(hold)))
        return tensor

    def unfold_residual(self, tensor_id):
        """Undo ``tensor_id``'s latest :meth:`fold_residual_` when the dense
        allreduce that followed came out NaN or Inf (a non-finite gradient
        on some rank: the step is skipped), so the residual is what it was
        before the step. Before the tensor's next call; local."""
        self._check(_lib.lib().oktopk_tensor_residual_unfold(self.handle, tensor_id))

    def residual_zeros(self, tensor_id, before, zero, became):
        """Marks in ``zero`` (a bool CPU tensor of the tensor's length) the
        entries of ``tensor_id``'s residual that are exactly 0; given
        ``before`` (an earlier read's marks, or None), lists in ``became``
        (int64) the entries marked now and not then, ascending, as far as it
        holds them, and returns how many there are (more than ``became``
        holds: make room and ask again). After a call, the entries that left
        after waiting. Changes nothing; local."""
        for name, t, dtype in (("zero", zero, torch.bool), ("before", before, torch.bool), ("became", became, torch.int64)):
            if t is not None and (t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous()):
                raise ValueError(f"oktopk: residual_zeros needs {name} as a contiguous {dtype} CPU tensor")
        if before is not None and before.numel() != zero.numel():
            raise ValueError(f"oktopk: residual_zeros: before has {before.numel()} entries, zero {zero.numel()}")
        count = ctypes.c_size_t()
        self._check(_lib.lib().oktopk_tensor_residual_zeros(
            self.handle, tensor_id, zero.numel(), None if before is None else before.data_ptr(), zero.data_ptr(),
            became.data_ptr(), became.numel(), ctypes.byref(count)))
        return count.value

    def undo_call(self, tensor_id):
        """Take back ``tensor_id``'s latest sparse call, which completed
        (made ``undoable``, or caller-selected), when its step is skipped
        after all (another tensor of the step came back NaN: the library
        skipped that one on every rank): the residual, thresholds, region
        boundaries and call count are again what they were before it,
        bitwise. Nothing to take back (a no-op) after a failed call, a load,
        a second undo or a fold not unfolded; a call made without
        ``undoable`` raises (INVALID_USAGE). Before the tensor's next call;
        local."""
        self._check(_lib.lib().oktopk_tensor_undo_call(self.handle, tensor_id))

    def allreduce_(self, tensor, average=True, algorithm="dense_ring"):
        """Dense allreduce of a contiguous CPU tensor, in place
        (``algorithm``: "dense_ring", "dense_rabenseifner" or "auto")."""
        dtype = _DTYPES.get(tensor.dtype)
        if dtype is None:
            raise TypeError(f"oktopk: unsupported dtype {tensor.dtype}")
        self._check(_lib.lib().oktopk_allreduce(
            self.handle, tensor.data_ptr(), tensor.numel(), dtype, int(average), _lib.algorithm_code(algorithm)))
        return tensor

    def measure_link(self):
        """Measure the link again (a collective: every rank calls it at the
        same point) for the "auto" algorithm's choices; returns the agreed
        model, the same on every rank, as a dict of seconds."""
        link = _lib.new_link_model()
        self._check(_lib.lib().oktopk_comm_measure_link(self.handle, ctypes.byref(link)))
        return {
            "latency_seconds": link.latency_seconds,
            "seconds_per_byte": link.seconds_per_byte,
            "pass_seconds_per_byte": link.pass_seconds_per_byte,
        }

    def link(self):
        """The link model the "auto" algorithm chooses by (as measure_link
        returns it), or None before one was measured or set. Local."""
        link, measured = _lib.new_link_model(), ctypes.c_int(0)
        self._check(_lib.lib().oktopk_comm_get_link(self.handle, ctypes.byref(link), ctypes.byref(measured)))
        if not measured.value:
            return None
        return {
            "latency_seconds": link.latency_seconds,
            "seconds_per_byte": link.seconds_per_byte,
            "pass_seconds_per_byte": link.pass_seconds_per_byte,
        }

    def set_link(self, model):
        """Install a link model (a dict as link() returns) instead of a
        measurement: the same on every rank, at the same point of the call
        order (a resumed run, a communicator made again). Local."""
        link = _lib.new_link_model()
        link.latency_seconds = model["latency_seconds"]
        link.seconds_per_byte = model["seconds_per_byte"]
        link.pass_seconds_per_byte = model["pass_seconds_per_byte"]
        self._check(_lib.lib().oktopk_comm_set_link(self.handle, ctypes.byref(link)))

    def save_tensor_state(self, tensor_id):
        lib = _lib.lib()
        size = ctypes.c_size_t(0)
        self._check(lib.oktopk_tensor_state_size(self.handle, tensor_id, ctypes.byref(size)))
        buf = ctypes.create_string_buffer(size.value)
        self._check(lib.oktopk_tensor_state_save(self.handle, tensor_id, buf, size.value))
        return buf.raw

    def load_tensor_state(self, tensor_id, blob):
        buf = ctypes.create_string_buffer(blob, len(blob))
        self._check(_lib.lib().oktopk_tensor_state_load(self.handle, tensor_id, buf, len(blob)))

    def load_tensor_state_regrouped(self, tensor_id, blob):
        """Install a state this process saved under a communicator of
        another size (the job went on without a lost rank): its residual
        kept whole, boundaries and thresholds measured afresh at the next
        call (``oktopk_tensor_state_load_regrouped``)."""
        buf = ctypes.create_string_buffer(blob, len(blob))
        self._check(_lib.lib().oktopk_tensor_state_load_regrouped(self.handle, tensor_id, buf, len(blob)))

    @property
    def dropped(self):
        """What this rank has refused so far (an int): connections to its
        port that did not authenticate, and frames that failed validation.
        Refused traffic never reaches a call; a nonzero count says only that
        something other than this job's ranks reached the port. Raises
        OkTopkError once the communicator is destroyed."""
        count = ctypes.c_uint64(0)
        self._check(_lib.lib().oktopk_comm_dropped(self.handle, ctypes.byref(count)))
        return count.value

    def abort(self):
        if self.handle:
            _lib.lib().oktopk_comm_abort(self.handle)

    def destroy(self):
        if self.handle:
            _lib.lib().oktopk_comm_destroy(self.handle)
            self.handle = 0

    def __del__(self):
        try:
            self.destroy()
        except Exception:
            pass
