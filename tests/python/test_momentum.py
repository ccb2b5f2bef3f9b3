"""The hook's momentum correction (oktopk.momentum) under torch.optim.SGD
with momentum, on real DDP ranks over gloo."""

import pytest
import torch

import momentum_workers
from test_ddp import run


@pytest.mark.parametrize("nesterov,dampening,weight_decay", [(False, 0.0, 0.0), (True, 0.0, 0.01), (False, 0.5, 0.01)])
def test_density_one_equals_dense_sgd_with_momentum(nesterov, dampening, weight_decay):
    # At density 1 every velocity step is sent: the average of the ranks'
    # velocities is the dense momentum, and the G handed to the optimizer
    # makes its own momentum land on it. Same values, summed and
    # subtracted in another order: float32 rounding only, relative to each
    # tensor's largest entry. The optimizer's momentum_buffer must match
    # dense's too: a checkpoint of the optimizer keeps its meaning.
    results = run(momentum_workers.density_one, 2, nesterov, dampening, weight_decay, 8)
    for r, res in results.items():
        assert res["corrected"] == res["params"], f"rank {r}: the correction did not take every parameter: {res}"
        assert res["sparse_iters"] == 6, res
        assert res["worst_param"] <= 1e-5, f"rank {r}: {res}"
        assert res["worst_buffer"] <= 1e-5, f"rank {r}: {res}"
        # Without weight decay B is the optimizer's buffer itself (a copy less);
        # with it, B leaves weight decay out and is the correction's own.
        assert res["b_views"] == (0 if weight_decay else res["params"]), f"rank {r}: {res}"


@pytest.mark.parametrize("nesterov,dampening,weight_decay", [(False, 0.0, 0.0), (True, 0.0, 0.01), (False, 0.5, 0.01)])
def test_a_clip_after_backward_is_followed_at_density_one_as_dense_sgd_clips(nesterov, dampening, weight_decay):
    # Trainer, Lightning and Accelerate clip the gradient the hook hands
    # over (clip_grad_norm_: every value times one c <= 1) before the
    # optimizer steps. The correction reads c at the step and scales this
    # step's gradient in each velocity by it: at density 1 the run is plain
    # DDP's with the same clip, up to float32 rounding, and it never stops.
    # The default masking runs ("waited": at density 1 nothing waits, so it
    # masks nothing) and follows the clip as well.
    results = run(momentum_workers.clipped, 2, "norm", nesterov, dampening, weight_decay, 8)
    for r, res in results.items():
        assert res["stopped"] is None and res["status"] == "on", f"rank {r}: {res['stopped']}"
        assert res["bit"] == 8, f"rank {r}: the clip bit at {res['bit']} of 8 steps: the test checks nothing"
        assert res["corrected"] > 0, f"rank {r}: the correction never ran"
        assert res["worst_param"] <= 1e-5, f"rank {r}: {res}"
        assert res["worst_buffer"] <= 1e-5, f"rank {r}: {res}"
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("masking", ["auto", False])
def test_a_change_the_correction_cannot_follow_stops_it_on_every_rank(masking):
    # clip_grad_value_ moves the largest values and not the small ones: no
    # one factor. The correction hands the optimizer its momentum back,
    # saying why, on every rank alike.
    named = "clip by value"
    results = run(momentum_workers.clipped, 2, "value", False, 0.0, 0.0, 4, masking)
    for r, res in results.items():
        assert res["stopped"] is not None and named in res["stopped"], f"rank {r}: {res['stopped']}"
        assert res["status"] == res["stopped"], res  # what OkTopkState.momentum_status says
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("nesterov,weight_decay", [(False, 0.0), (True, 0.01)])
def test_a_native_step_with_nothing_held_is_plain_ddp_bitwise_and_corrects_nothing(nesterov, weight_decay):
    # A native step whose average holds no residual is the gradients' own
    # average: the correction hands it through (no pass over it), and the
    # run is plain DDP's with torch's allreduce_hook, bit for bit, momentum
    # buffers included. Steps 1-5 of the warm-up are such steps once the
    # optimizer has stepped (the correction starts after its first step).
    results = run(momentum_workers.native_steps_are_plain_ddp, 2, nesterov, weight_decay, 6)
    for r, res in results.items():
        assert res["active"], res
        assert res["same"] == [True] * 6, f"rank {r}: {res}"
        assert res["worked_at"] == [], f"rank {r}: the correction worked on native steps {res['worked_at']}"


@pytest.mark.parametrize("nesterov", [False, True])
def test_velocity_mass_is_kept_and_ranks_agree(nesterov):
    world = 3
    results = run(momentum_workers.mass, world, 12, nesterov)
    for r in range(1, world):
        for a, b in zip(results[0]["params"], results[r]["params"]):
            assert torch.equal(a, b), f"rank {r}'s parameters differ from rank 0's"
    for name in results[0]["given"]:
        given = sum(results[r]["given"][name] for r in range(world))
        left = sum(results[r]["residual"][name] for r in range(world))
        applied = world * results[0]["averaged"][name]
        assert left.abs().sum() > 0, f"{name}: no residual: the sparse path never ran"
        lost = (given - applied - left).abs().sum() / given.abs().sum()
        assert lost <= 1e-5, f"{name}: {lost:.3%} of the velocities' mass lost"


def test_non_finite_step_leaves_velocity_residual_and_parameters_unchanged_on_every_rank():
    # Rank 1's NaN at sparse step 4: the library skips the step everywhere,
    # the script skips the optimizer, and nothing the correction holds may
    # move, on any rank; training then goes on alike.
    world = 2
    results = run(momentum_workers.non_finite, world, 1, 4, 8, False)
    for r, res in results.items():
        assert res["stopped"] is None, res["stopped"]
        kept = res["kept"]
        assert kept["velocities"] > 0, f"rank {r}: the correction was not running: {kept}"
        assert kept == {"velocity": True, "applied": True, "params": True, "residual": True, "velocities": kept["velocities"]}, f"rank {r}: {kept}"
        assert all(res["finite"]), f"rank {r}: {res['finite']}"
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_grad_scaler_stops_the_correction_and_training_goes_on_alike():
    # GradScaler's unscale_ divides the gradient the hook handed over
    # before the optimizer steps, which the correction's arithmetic cannot
    # follow: it must notice at the first step and hand the optimizer its
    # momentum back, on every rank, the NaN step then skipped as before.
    results = run(momentum_workers.non_finite, 2, 1, 4, 8, True)
    for r, res in results.items():
        assert res["stopped"] is not None and "unscale_" in res["stopped"], f"rank {r}: {res['stopped']}"
        assert all(res["finite"]), f"rank {r}: {res['finite']}"
        assert res["kept"]["params"] and res["kept"]["residual"], f"rank {r}: {res['kept']}"
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_density_one_equals_dense_sgd_across_sparse_native_sparse(weight_decay):
    # The measured choice takes sparse, then native (the residuals folded,
    # nothing held: the correction idle, handing the gradient through while
    # its velocities follow the optimizer's buffer), then sparse again. At
    # density 1 every switch keeps the run plain DDP's, up to float32
    # rounding. Without weight decay B is the optimizer's own buffer, so a
    # velocity left behind by the idle steps shows as a wrong step at the
    # second sparse phase; with it, B would be left behind alike and cancel
    # at density 1, so the idle steps' following is checked directly.
    results = run(momentum_workers.density_one_across_switches, 2, weight_decay)
    paths, idle = results[0]["paths"], results[0]["idle"]
    first_native = paths.index("native", paths.index("sparse"))
    second_sparse = paths.index("sparse", first_native)
    assert "sparse" not in paths[first_native:second_sparse] and second_sparse < len(paths) - 4, paths
    # Idle from the native step after the fold on, and only on native steps.
    assert idle[first_native + 1:second_sparse] == [True] * (second_sparse - first_native - 1), idle
    assert not any(idle[second_sparse:]) and not any(idle[paths.index("sparse"):first_native + 1]), idle
    for r, res in results.items():
        assert res["paths"] == paths, f"rank {r}"
        assert res["following"] and all(res["following"]), f"rank {r}: {res['following']}"
        assert res["worst_param"] <= 1e-5, f"rank {r}: {res}"
        assert res["worst_buffer"] <= 1e-5, f"rank {r}: {res}"
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
