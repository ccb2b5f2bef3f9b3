"""The bf16 path (an Adam-family optimizer's choice, ``oktopk.choice``): the
process group's allreduce in bfloat16, averaged, as ``bf16_compress_hook``
runs it: half the bytes, no residual. It only runs while no residual is
held (no sparse step ran), so nothing is folded before it. A bucket or
shard already in 16 bits goes native, as it is.
"""

import torch
import torch.distributed as dist

from . import callbacks, path_native
from .peer_errors import peer_failures_named, value_of
from .paths import Path


class BF16(Path):
    """The process group's allreduce in bfloat16, averaged, as
    ``bf16_compress_hook`` runs it. A bucket or shard already in 16 bits
    goes native, as it is."""

    name = "bf16"
    compresses_dense = True
    dtype = torch.bfloat16
    described = "in bfloat16"

    def reduce(self, engine, bucket, tensor, step):
        if tensor.dtype != torch.float32:
            return path_native.PATH.reduce(engine, bucket, tensor, step)
        group = engine.process_group
        compressed = tensor.to(self.dtype).div_(dist.get_world_size(group))
        fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(f):
            return tensor.copy_(value_of(f, f"the {self.name} allreduce of step {step}")[0])

        return callbacks.then(fut, decompress)

    def reduce_shard(self, engine, group_id, shard, step):
        if shard.dtype != torch.float32:
            path_native.PATH.reduce_shard(engine, group_id, shard, step)
            return
        compressed = shard.to(self.dtype).div_(dist.get_world_size(engine.process_group))
        with peer_failures_named(f"the {self.name} allreduce of step {step}"):
            dist.all_reduce(compressed, group=engine.process_group)
        shard.copy_(compressed)


PATH = BF16()
