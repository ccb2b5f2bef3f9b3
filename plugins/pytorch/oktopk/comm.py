"""A liboktopk communicator for the ranks of a torch.distributed process
group, set up through the group's own store (the TCPStore torchrun made):
no extra port or environment variable for the user."""

import ctypes
import itertools
import threading

import torch
import torch.distributed as dist

from . import _lib
from ._lib import OkTopkError

_DTYPES = {torch.float32: _lib.FLOAT32, torch.float16: _lib.FLOAT16, torch.bfloat16: _lib.BFLOAT16}

# Communicators are created in the same order on every rank (the training
# script is the same), so a per-process counter names each one's store keys.
_instance_counter = itertools.count()


def _store_for(group):
    store = dist.distributed_c10d._get_default_store()
    if group is None or group is dist.GroupMember.WORLD:
        name = "world"
    else:
        name = "g" + "-".join(map(str, dist.get_process_group_ranks(group)))
    return dist.PrefixStore(f"oktopk/{name}/", store)


class Communicator:
    """One liboktopk communicator over the ranks of ``group``."""

    def __init__(self, group=None, algorithm="oktopk", density=0.01, tau=64, tau_prime=32, timeout=60.0):
        store = dist.PrefixStore(f"c{next(_instance_counter)}/", _store_for(group))
        rank, size = dist.get_rank(group), dist.get_world_size(group)

        def share_token(token):
            if rank == 0:
                store.set("token", token)
            return store.get("token")

        def gather_endpoints(endpoint):
            store.set(f"ep/{rank}", endpoint)
            return [store.get(f"ep/{r}") for r in range(size)]

        self.group = group
        self._connect(rank, size, share_token, gather_endpoints, algorithm, density, tau, tau_prime, timeout)

    @classmethod
    def from_exchange(cls, rank, size, share_token, gather_endpoints, algorithm="oktopk", density=0.01, tau=64, tau_prime=32, timeout=60.0):
        """A communicator whose rendezvous goes through the caller's own
        collectives (Horovod's, say): ``share_token(token_or_None)`` returns
        rank 0's token bytes on every rank, ``gather_endpoints(endpoint)``
        returns every rank's endpoint bytes in rank order."""
        self = cls.__new__(cls)
        self.group = None
        self._connect(rank, size, share_token, gather_endpoints, algorithm, density, tau, tau_prime, timeout)
        return self

    def _connect(self, rank, size, share_token, gather_endpoints, algorithm, density, tau, tau_prime, timeout):
        self.rank, self.size, self.handle = rank, size, 0
        lib = _lib.lib()
        cfg = _lib.default_config(algorithm, density, tau, tau_prime, timeout)
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
        self._lock = threading.Lock()

    def _check(self, code):
        _lib.check(code, self.handle)

    def sparse_allreduce_(self, tensor_id, tensor):
        """Averaged sparse allreduce of a contiguous CPU tensor, in place,
        with error feedback kept under ``tensor_id``. Returns the call's
        statistics."""
        dtype = _DTYPES.get(tensor.dtype)
        if dtype is None:
            raise TypeError(f"oktopk: unsupported dtype {tensor.dtype} (float32, float16, bfloat16)")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("oktopk: sparse_allreduce_ needs a contiguous CPU tensor")
        stats = _lib.new_stats()
        self._check(_lib.lib().oktopk_sparse_allreduce(
            self.handle, tensor_id, tensor.data_ptr(), tensor.numel(), dtype, ctypes.byref(stats)))
        return stats

    def allreduce_(self, tensor, average=True, algorithm="dense_ring"):
        """Dense allreduce of a contiguous CPU tensor, in place."""
        dtype = _DTYPES.get(tensor.dtype)
        if dtype is None:
            raise TypeError(f"oktopk: unsupported dtype {tensor.dtype}")
        self._check(_lib.lib().oktopk_allreduce(
            self.handle, tensor.data_ptr(), tensor.numel(), dtype, int(average), _lib.ALGORITHMS.index(algorithm)))
        return tensor

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
