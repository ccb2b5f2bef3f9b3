"""The device path (oktopk.device): selection and residuals where the
gradients live, only pairs across. On CPU tensors with the path forced on,
it must give the staging path's results, residuals and thresholds bit for
bit, and move bytes in proportion to the pairs, not to n."""

import pytest

import workers
from test_ddp import run


@pytest.mark.parametrize("model_dtype, value_dtype, find_unused", [
    ("float32", "float32", False),
    ("float32", "float16", True),
    ("bfloat16", "bfloat16", False),
])
def test_device_path_equals_staging_path_bitwise(model_dtype, value_dtype, find_unused):
    # 14 sparse steps at τ = 3, τ' = 4: exact and reused thresholds,
    # repartitions, a gradient scale that jumps 4x up and down (raises,
    # nudges, the exact fallback); a NaN on rank 1 at step 7 skips that step on both paths
    # and every rank; unused parameters held back.
    results = run(workers.device_path, 2, model_dtype, value_dtype, find_unused)
    for r, res in results.items():
        assert all(res["equal"]), f"rank {r}: gradients differ at steps {[s for s, e in enumerate(res['equal']) if not e]}"
        assert res["nan_seen"] == [s == 7 for s in range(16)], res["nan_seen"]
        assert res["same_checkpoint"], f"rank {r}: the states (thresholds, boundaries, residuals) differ"
        assert res["device_groups"] >= 1


def test_device_path_moves_bytes_in_proportion_to_pairs_not_n():
    # The staging path moves each bucket twice (a CPU bucket is counted as
    # if it were a GPU's: 2 x 4 B x n per call); the device path at most
    # 3 x 8 B per selected and result pair.
    results = run(workers.device_path, 2, "float32", "float32", False)
    n = sum(p.numel() for p in workers.Branchy().parameters())
    for r, res in results.items():
        staging, on_device = res["bytes"]
        calls = res["calls"][1]
        assert res["calls"][0] == 0, "a CPU bucket on the staging path crosses no PCIe"
        assert calls == 14 and on_device <= 3 * 8 * res["pairs"], res  # the counts it reads are in the bound too
        assert res["pairs"] / calls < 0.25 * n  # 5% density, 2 ranks: far fewer pairs than entries


def test_a_checkpoint_resumes_on_either_path():
    results = run(workers.device_path_resume, 2)
    for r, res in results.items():
        assert all(res.values()), f"rank {r}: {res}"


def test_the_setting_is_refused_when_not_a_bool_and_survives_pickling():
    import pickle

    from oktopk import OkTopkState

    with pytest.raises(ValueError):
        OkTopkState(device_path="yes")
    state = OkTopkState(algorithm="oktopk", device_path=True)
    assert pickle.loads(pickle.dumps(state)).device_path is True
    state.close()
