"""A NaN or Inf in one DDP bucket's gradient (the campaign's nan-one-group
finding, results/chaos_torch.md): the library skips that bucket's call on
every rank and the script skips the optimizer step (as GradScaler does),
so the step is void. The step's other buckets were reduced; the hook
takes their calls back (oktopk_tensor_undo_call), and their velocities'
steps: on every rank, every library residual, threshold and call count,
every velocity (and "waited" mask) is bitwise what it was before the step,
and the run goes on as if that step's batch had never been taken."""

import pytest
import torch

import nan_workers
from test_ddp import run


@pytest.mark.parametrize("bad_step, device_path, masking", [
    (4, None, False),
    (4, True, False),
    (4, None, "waited"),
    (1, None, False),
], ids=["sparse-host", "sparse-device-path", "sparse-host-waited-masking", "warm-up"])
def test_a_nan_in_one_bucket_leaves_the_state_as_before_the_step_and_the_run_as_without_that_batch(bad_step, device_path, masking):
    steps = 8
    results = run(nan_workers.nan_in_one_bucket, 2, steps, bad_step, device_path, masking)
    for r, res in results.items():
        assert res["groups"] >= 2, f"rank {r}: the model's parameters are in {res['groups']} group(s); the test needs several"
        assert not res["finite_at_bad_step"], f"rank {r}: the NaN did not reach every rank's gradient"
        assert res["skipped_finite_after"], f"rank {r}: the step after the NaN is not finite"
        assert res["velocities"] > 0, f"rank {r}: no velocity before the bad step: the momentum correction checks nothing"
        if bad_step >= 2:  # a sparse step: some calls completed before the NaN's was skipped
            assert 0 < res["calls_at_bad_step"] < res["groups"], f"rank {r}: {res['calls_at_bad_step']} calls at the bad step"
            assert res["residual_entries"] > 0, f"rank {r}: no residual before the bad step: the test checks nothing"
        assert res["changed"] == [], f"rank {r}: changed by the skipped step: {res['changed']}"
        # The hook counts the void step as one of its steps (state.iter):
        # one more sparse step, or, in the warm-up, one warm-up step less
        # of the batches, so the runs differ from the first sparse step on
        # and only the state across the void step is compared.
        assert res["sparse_steps_nan"] == res["sparse_steps_without"] + 1
        if bad_step < 2:
            continue
        same = [torch.equal(a, b) for a, b in zip(res["params_nan"], res["params_without"])]
        assert all(same), f"rank {r}: parameters differ from the run without that batch ({same.count(False)} of {len(same)} tensors)"
    for a, b in zip(results[0]["params_nan"], results[1]["params_nan"]):
        assert torch.equal(a, b), "rank 1's parameters differ from rank 0's"

