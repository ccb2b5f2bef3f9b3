"""The BF16 path (an Adam-family optimizer's choice, ``oktopk.choice``): the
process group's allreduce in bfloat16, averaged, as ``bf16_compress_hook``
runs it: half the bytes, no residual. It only runs while no residual is
held (no sparse step ran), so nothing is folded before it. A bucket or
shard already in 16 bits goes native, as it is.
"""

import torch
import torch.distributed as dist

from . import path_native


def reduce(state, bucket, tensor, step):
    """The process group's allreduce of the bucket in bfloat16, averaged, as
    ``bf16_compress_hook`` runs it: the BF16 path (an Adam-family
    optimizer's choice, oktopk.choice), which only runs while no residual is
    held. A bucket already in 16 bits goes as it is."""
    if tensor.dtype != torch.float32:
        return path_native.reduce(state, bucket, tensor, step)
    group = state.process_group
    compressed = tensor.to(torch.bfloat16).div_(dist.get_world_size(group))
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f):
        return tensor.copy_(f.value()[0])

    return fut.then(decompress)


def reduce_(state, group_id, shard, step):
    """The BF16 path (an Adam-family optimizer's choice, oktopk.choice): the
    replicate group's allreduce in bfloat16, averaged, in place, as
    ``bf16_compress_hook`` sends a bucket. A 16-bit shard goes as it is."""
    if shard.dtype != torch.float32:
        path_native.reduce_(state, group_id, shard, step)
        return
    compressed = shard.to(torch.bfloat16).div_(dist.get_world_size(state.process_group))
    dist.all_reduce(compressed, group=state.process_group)
    shard.copy_(compressed)
