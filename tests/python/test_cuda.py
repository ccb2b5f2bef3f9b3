"""The hook on CUDA tensors: DDP buckets live on the GPU, the hook stages
them through pinned host memory for liboktopk and copies the average back.
Skipped (and reported as skipped) where torch sees no GPU, as in CI; run
where one is, e.g. `pytest tests/python/test_cuda.py`."""

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
