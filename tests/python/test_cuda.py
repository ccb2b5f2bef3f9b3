"""The hook on CUDA tensors: DDP buckets live on the GPU; the device path
selects there and moves only pairs, the staging path copies buckets through
pinned host memory. Skipped (and reported as skipped) where torch sees no
GPU, as in CI; `make gpu-check` runs them where one is."""

import pytest
import torch

import workers
from test_ddp import run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")


@pytest.mark.parametrize(
    "dtype,tolerance",
    [
        ("float32", 1e-5),  # another summation order: float32 rounding only
        ("float16", 2e-3),  # both round the average to float16: an ulp or two
        ("bfloat16", 2e-2),
    ],
)
def test_cuda_buckets_density_one_equal_allreduce_hook(dtype, tolerance):
    results = run(workers.density_one, 2, "cuda", dtype)
    for r, res in results.items():
        assert res["sparse_iters"] == 5, res
        assert res["worst_relative_diff"] <= tolerance, f"rank {r}: {res}"


@pytest.mark.parametrize("model_dtype, value_dtype, find_unused", [("float32", "float32", False), ("bfloat16", "float16", True)])
def test_cuda_device_path_equals_staging_path_bitwise(model_dtype, value_dtype, find_unused):
    # The device path (selection and residual on the GPU, pairs across)
    # against the staging path (the bucket copied whole to pinned memory):
    # the same gradients every step, the same checkpoints at the end.
    results = run(workers.device_path, 2, model_dtype, value_dtype, find_unused, "cuda")
    for r, res in results.items():
        assert all(res["equal"]), f"rank {r}: gradients differ at steps {[s for s, e in enumerate(res['equal']) if not e]}"
        assert res["same_checkpoint"] and res["nan_seen"] == [s == 7 for s in range(16)], res


def test_cuda_device_path_moves_pairs_where_staging_moves_buckets():
    results = run(workers.device_path, 2, "float32", "float32", False, "cuda")
    n = sum(p.numel() for p in workers.Branchy().parameters())
    for r, res in results.items():
        staging, on_device = res["bytes"]
        assert res["calls"] == [14, 14] and staging == 14 * 2 * 4 * n, res
        assert on_device <= 3 * 8 * res["pairs"], res


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: fewer than 2 GPUs visible")
def test_nccl_process_group():
    results = run(workers.nccl_hook, 2)
    for r, res in results.items():
        assert res["worst_relative_diff"] <= 1e-5 and res["device_calls"] == 6, res
        assert res["finite"] and res["choice"]["steps"]["native"] + res["choice"]["steps"]["sparse"] == 6, res
