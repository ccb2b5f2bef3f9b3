"""A NaN or Inf in one DDP bucket's gradient (the campaign's nan-one-group
finding, results/chaos_torch.md): the library skips that bucket's call on
every rank and the script skips the optimizer step (as GradScaler does),
so the step is void. The step's other buckets were reduced; the hook
takes their calls back (oktopk_tensor_undo_call), and their velocities'
steps: on every rank, every library residual, threshold and call count,
every velocity (and "waited" mask) is bitwise what it was before the step,
the step does not count in ``state.iter``, and the run goes on as if that
step's batch had never been taken: its parameters are bitwise those of a
run without it."""

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
        if bad_step < 2:
            # A native warm-up step with nothing held: the hook hands the
            # average through unread (what makes it cost what torch's
            # allreduce_hook does), so it cannot tell the step was void, and
            # counts it; the warm-up is one batch shorter than the run
            # without it, and the runs differ from the first sparse step on.
            assert res["sparse_steps_nan"] == res["sparse_steps_without"] + 1
            continue
        # A step the hook reads (sparse, folding or corrected) and finds void
        # does not count (state.iter): the run with it and the run without
        # its batch have taken as many steps, and went the same way.
        assert res["sparse_steps_nan"] == res["sparse_steps_without"], \
            f"rank {r}: {res['sparse_steps_nan']} steps after the warm-up counted with the void step, {res['sparse_steps_without']} without"
        same = [torch.equal(a, b) for a, b in zip(res["params_nan"], res["params_without"])]
        assert all(same), f"rank {r}: parameters differ from the run without that batch ({same.count(False)} of {len(same)} tensors)"
    for a, b in zip(results[0]["params_nan"], results[1]["params_nan"]):
        assert torch.equal(a, b), "rank 1's parameters differ from rank 0's"

