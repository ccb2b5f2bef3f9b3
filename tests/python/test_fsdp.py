"""Hybrid parallelism: oktopk across the replicas of FSDP2 (HSDP) on a 2 x 2
mesh, and several communicators in one process (one per data-parallel
group, as pipeline stages have), on 4 CPU ranks over gloo."""

import numpy as np
import pytest

import fsdp_workers
from test_ddp import run

WORLD = 4


@pytest.mark.parametrize("nesterov,weight_decay", [(False, 0.0), (True, 0.01)])
def test_a_native_shard_step_with_nothing_held_is_native_hsdp_bitwise_and_corrects_nothing(nesterov, weight_decay):
    # A native step whose average holds no residual is the gradients' own
    # average: the correction hands it through (no pass over it), and the
    # run is native HSDP's, bit for bit, momentum buffers included, as the
    # DDP hook's is plain DDP's. Steps 1-4 of the warm-up are such steps once
    # the optimizer has stepped (the correction starts after its first step).
    results = run(fsdp_workers.native_steps_hand_through, WORLD, 5, nesterov, weight_decay)
    for r, res in results.items():
        assert res["active"], res
        assert res["same"] == [True] * 5, f"rank {r}: {res}"
        assert res["worked_at"] == [], f"rank {r}: the correction worked on native steps {res['worked_at']}"


@pytest.mark.parametrize("nesterov,dampening,weight_decay", [(False, 0.0, 0.0), (True, 0.0, 0.01), (False, 0.5, 0.01)])
def test_hsdp_momentum_correction_at_density_one_equals_native_hsdp_sgd_with_momentum(nesterov, dampening, weight_decay):
    # The momentum correction on FSDP2 replicas: each rank's velocity of its
    # own shard is reduced, and the optimizer's own momentum lands on the
    # average. At density 1 that is native HSDP's SGD with momentum, the
    # optimizer's momentum buffers included, to float32 rounding.
    results = run(fsdp_workers.density_one, WORLD, 6, (0.9, nesterov, dampening, weight_decay))
    for r, res in results.items():
        assert res["corrected"] == res["params"], f"rank {r}: the correction took {res['corrected']} of {res['params']}"
        # Every module's shard of every step after the optimizer's first but
        # the warm-up's second (native, nothing held: handed through).
        assert res["corrected_shards"] == 4 * 4, f"rank {r}: {res['corrected_shards']} shards corrected"
        for name, native in res["native"].items():
            diff = np.abs(res["sparse"][name] - native).max()
            assert diff <= 1e-5 * max(1.0, np.abs(native).max()), f"rank {r} {name}: {diff}"
        for name, native in res["native", "buffers"].items():
            diff = np.abs(res["sparse", "buffers"][name] - native).max()
            assert diff <= 1e-5 * max(1.0, np.abs(native).max()), f"rank {r} momentum buffer of {name}: {diff}"


def test_hsdp_at_density_one_equals_native_hsdp():
    # k = n: every entry travels, so the result is FSDP2's own HSDP average,
    # summed in another order: float32 rounding only.
    results = run(fsdp_workers.density_one, WORLD, 5)
    for r, res in results.items():
        assert res["sparse_calls"] == {"oktopk": 3 * 4}, res["sparse_calls"]  # 4 modules, 3 steps after the 2 dense ones
        for name, native in res["native"].items():
            diff = np.abs(res["sparse"][name] - native).max()
            assert diff <= 1e-5 * max(1.0, np.abs(native).max()), f"rank {r} {name}: {diff}"


@pytest.fixture(scope="module")
def oktopk_run():
    return run(fsdp_workers.mass, WORLD, "oktopk", 30)


@pytest.fixture(scope="module")
def device_run():
    return run(fsdp_workers.mass, WORLD, "oktopk", 30, True)  # the device path forced on the CPU shards


@pytest.fixture(scope="module", params=["oktopk", None, "device"], ids=["oktopk", "measured_choice", "device_path"])
def mass_run(request, oktopk_run, device_run):
    if request.param == "oktopk":
        return oktopk_run
    if request.param == "device":
        return device_run
    return run(fsdp_workers.mass, WORLD, request.param, 30)


def test_hsdp_device_path_equals_staging_path_bitwise(oktopk_run, device_run):
    for r in range(WORLD):
        for name, shard in oktopk_run[r]["shards"].items():
            assert np.array_equal(shard, device_run[r]["shards"][name]), f"rank {r} {name}: the paths' parameters differ"
        for number, residual in oktopk_run[r]["residual"].items():
            assert np.array_equal(residual, device_run[r]["residual"][number]), f"rank {r} module {number}: residuals differ"


def test_hsdp_keeps_gradient_mass_and_replicas_agree_bitwise(mass_run):
    # Per shard (ranks j and j + 2 hold shard j): over the steps after the
    # warm-up, what the replicas gave the hook equals 2 x what it returned
    # plus the residuals they hold at the end, on the sparse path and across
    # switches to gloo's allreduce (which folds the residual in first).
    for j in (0, 1):
        a, b = mass_run[j], mass_run[j + 2]
        for number in a["given"]:
            given = a["given"][number] + b["given"][number]
            left = sum(0 if x["residual"][number] is None else x["residual"][number].astype(np.float64) for x in (a, b))
            assert np.array_equal(a["returned"][number], b["returned"][number]), f"shard {j} module {number}: replicas differ"
            lost = np.abs(given - 2 * a["returned"][number] - left).sum() / np.abs(given).sum()
            assert lost <= 1e-5, f"shard {j} module {number}: {lost:.3%} of the gradient mass lost"
        for name in a["shards"]:
            assert np.array_equal(a["shards"][name], b["shards"][name]), f"shard {j} {name}: replicas' parameters differ"


def test_hsdp_runs_the_named_algorithm_or_the_measured_choice_alike_on_every_rank(mass_run):
    if mass_run[0]["choice"] is None:  # algorithm="oktopk": every step after the warm-up, every module
        assert all(mass_run[r]["counts"] == {"oktopk": 4 * 28} for r in range(WORLD)), mass_run[0]["counts"]
        return
    # The injected clock: native probe, sparse probe, sparse chosen; sparse
    # turns slow and a recheck goes back to native.
    paths = mass_run[0]["paths"]
    assert all(mass_run[r]["paths"] == paths for r in range(WORLD))
    assert "sparse" in paths and paths[-1] == "native", paths
    assert mass_run[0]["choice"]["path"] == "native" and mass_run[0]["choice"]["decisions"] >= 2, mass_run[0]["choice"]


def test_hsdp_resumes_exactly_through_torch_distributed_checkpoint(tmp_path):
    results = run(fsdp_workers.checkpoint, WORLD, str(tmp_path / "ckpt"), 10, 5)
    for r, res in results.items():
        assert res["resumed_iter"] == 5
        for name, straight in res["straight"].items():
            assert np.array_equal(res["resumed"][name], straight), f"rank {r} {name}: the resumed run differs"


def test_two_communicators_in_one_process_on_two_groups():
    results = run(fsdp_workers.two_communicators, WORLD, 5)
    for r, res in results.items():
        for name in ("a", "b"):
            assert res[1.0, name, "oktopk", "calls"] == {"oktopk": 3}, res[1.0, name, "oktopk", "calls"]
            for p, plain in res[1.0, name, "plain"].items():
                diff = np.abs(res[1.0, name, "oktopk"][p] - plain).max()
                assert diff <= 1e-5 * max(1.0, np.abs(plain).max()), f"rank {r} model {name} {p}: {diff}"
    # At 10%, each group's members agree bitwise (A: 0-1, 2-3; B: 0-2, 1-3)
    # and the two models differ from their dense runs (sparse really ran).
    for name, pairs in (("a", ((0, 1), (2, 3))), ("b", ((0, 2), (1, 3)))):
        for x, y in pairs:
            for p in results[x][0.1, name, "oktopk"]:
                assert np.array_equal(results[x][0.1, name, "oktopk"][p], results[y][0.1, name, "oktopk"][p]), (name, x, y, p)
        assert any(not np.allclose(results[0][0.1, name, "oktopk"][p], results[0][0.1, name, "plain"][p])
                   for p in results[0][0.1, name, "plain"])


def test_register_refuses_native_hsdp_the_world_group_an_unsharded_model_and_a_second_registration():
    messages = run(fsdp_workers.refusals, WORLD)[0]
    assert "native HSDP" in messages["native_hsdp"] and "mesh['shard']" in messages["native_hsdp"]
    assert "replicate dimension's group" in messages["world_group"]
    assert "fully_shard" in messages["not_sharded"]
    assert "registered twice" in messages["twice"]


@pytest.mark.parametrize("example", ["hsdp", "pipeline"])
def test_examples_at_density_one_match_dense(example):
    # The examples' own runs (their main(), on 4 ranks started with
    # torchrun's environment variables), 8 steps: at k = n the sparse run's
    # loss is the dense run's, on both mesh dimensions' setups.
    def final(argv):
        printed = run(fsdp_workers.example, WORLD, example, ["--steps", "8", *argv])[0]
        line = [x for x in printed.splitlines() if x.startswith("RESULT")][-1]
        return dict(kv.split("=") for kv in line.split()[1:])

    dense, sparse = final([]), final(["--oktopk", "--algorithm", "oktopk", "--density", "1"])
    assert sparse["mode"] == "oktopk" and dense["mode"] == "dense", (dense, sparse)
    assert sparse["final_loss"] == dense["final_loss"], (dense, sparse)


def test_tensor_parallel_model_replicated_by_fsdp2_at_density_one_equals_native():
    # Parameters that are DTensors on a "tp" dimension: the hook reduces
    # each rank's local tensor-parallel shard over its replicas. DDP itself
    # cannot wrap such a model in this torch (its first broadcast has no
    # DTensor rule), whatever the hook: the test records that too, so a torch
    # that lifts the limit shows up here.
    results = run(fsdp_workers.tensor_parallel, WORLD, 4)
    for r, res in results.items():
        assert res["sparse_calls"] == {"oktopk": 2}, res["sparse_calls"]
        for name, native in res["native"].items():
            diff = np.abs(res["sparse"][name] - native).max()
            assert diff <= 1e-5 * max(1.0, np.abs(native).max()), f"rank {r} {name}: {diff}"
        assert res["ddp"] is not None and "sharding strategy" in res["ddp"], res["ddp"]


def test_hsdp_adaptive_density_moves_alike_on_the_ranks_of_a_replicate_group():
    # The adaptation (oktopk.adaptive) runs between steps on each replicate
    # group's communicator: both replicas of a shard follow the same
    # densities and end with bitwise equal parameters; the density moved.
    results = run(fsdp_workers.adaptive, WORLD, 12)
    for j in (0, 1):
        a, b = results[j], results[j + 2]
        assert a["densities"] == b["densities"], (a["densities"], b["densities"])
        for name in a["shards"]:
            assert np.array_equal(a["shards"][name], b["shards"][name]), name
        sparse = [d for d, _ in a["densities"][2:]]
        assert a["xi"] is not None and len(set(sparse)) > 1, a["densities"]


@pytest.mark.parametrize("compression", ["quantized", "bf16"])
def test_the_default_on_replicas_stepped_by_adam_stays_dense_and_every_allreduce_is_its_paths_arithmetic(compression):
    # The registration watches the model's parameters: Adam steps them, so
    # no sparse call is made; the choice measures the replicate group's
    # allreduce against it compressed (the injected clock makes that
    # slower: its probe, then the native probe, then native). Each
    # allreduce's result is the same on the two replicas (ranks r and r ^ 2
    # on the 2 x 2 mesh), and exactly its path's arithmetic on their shards
    # for native and bf16 (quantized rounds, oktopk.quantized; its first
    # native step folds the residuals in). Native HSDP
    # reduces in another order (reduce-scatter over the whole mesh), and the
    # probe rounded to bfloat16, so the final shards agree closely, not
    # bitwise.
    import torch

    results = run(fsdp_workers.adam_default, WORLD, 12, compression)
    for r in range(WORLD):
        res, other = results[r], results[r ^ 2]
        assert res["choice"]["kept_dense_for"] == "Adam" and res["calls"] == {}, res["choice"]
        warmup = res["paths"].count("warm-up")
        assert res["paths"][warmup:] == [compression] * 4 + ["native"] * (12 - warmup - 4), res["paths"]
        assert res["choice"]["path"] == "native" and res["choice"]["steps"]["sparse"] == 0
        assert len(res["reduced"]) == len(other["reduced"]) > 0
        paths, folded, modules = [], set(), len(res["reduced"]) // 12  # one call per module per step
        for call, ((path, before, after), (other_path, other_before, other_after)) in enumerate(zip(res["reduced"], other["reduced"])):
            a, b = torch.from_numpy(before), torch.from_numpy(other_before)
            assert path == other_path and np.array_equal(after, other_after), (r, path)
            if path == "bf16":
                assert np.array_equal(after, (a.bfloat16() / 2 + b.bfloat16() / 2).float().numpy()), r
            elif path == "native" and (compression == "bf16" or call % modules in folded or call < warmup * modules):
                assert np.array_equal(after, ((a + b) / 2).numpy()), r
            elif path == "native":
                folded.add(call % modules)  # the first native step after quantized ones of this module
            paths.append(path)
        assert set(paths) == {"native", compression}
        for name, shard in res["native"].items():
            # Adam moves a weight by about lr (1e-3) per step whatever its
            # gradient's scale, so a gradient near zero that bfloat16
            # rounding changes can move it by up to that per probe step.
            worst = np.abs(shard - res["sparse"][name]).max()
            assert worst <= 4e-3, f"rank {r} {name}: {worst}"


def test_demo_over_hsdp_replicas_is_demo_of_each_local_shard_and_replicas_agree():
    # Mesh (replicate, shard) = (2, 2): rank = 2 * replica + shard, so ranks
    # r and r + 2 hold the same shards.
    steps = 4
    results = run(fsdp_workers.demo_hsdp, WORLD, steps)
    for r, res in results.items():
        assert "process_group" in res["refusals"]["no_group"], res["refusals"]
        assert res["bytes"] > 0
        for name, sharded in res["sharded"].items():
            # DeMo on DTensor shards is DeMo on their local tensors, bit for bit.
            assert np.array_equal(sharded, res["plain"][name]), (r, name)
            assert not np.array_equal(sharded, res["start"][name]), (r, name)  # it stepped
    for r in (0, 1):
        twin = results[r + 2]
        for name in results[r]["sharded"]:
            assert np.array_equal(results[r]["sharded"][name], twin["sharded"][name]), (r, name)
            # No dense exchange across the replicas: their shard gradients differ.
            assert not np.array_equal(results[r]["grad0"][name], twin["grad0"][name]), (r, name)


@pytest.mark.parametrize("optimizer,path,poisoned", [("SGD", "sparse", (0, 1)), ("AdamW", "quantized", (0, 1)),
                                                     ("SGD", "sparse", (0,)), ("AdamW", "quantized", (0,)),
                                                     ("SGD momentum", "sparse", (0,))])
def test_a_nan_in_one_modules_shard_leaves_every_residual_as_before_the_step(optimizer, path, poisoned):
    # The campaign's nan-one-group finding on FSDP2: the NaN's module is
    # skipped on every replica, but the other modules were reduced, and
    # their residuals (library states, quantized groups) moved on; the
    # skipped step lost what they sent. Now they are taken back before the
    # next step, bitwise, on every rank. Poisoned on rank 0 alone, the NaN
    # reaches one replicate group (ranks 0 and 2); ranks 1 and 3 see only
    # finite calls and learn of it from the world's agreement.
    bad_step = 5
    results = run(fsdp_workers.nan_one_module, WORLD, bad_step + 3, bad_step, optimizer, poisoned)
    for r in range(WORLD):
        res = results[r]
        steps = res["steps"]
        before, at, after = steps[bad_step - 1], steps[bad_step], steps[bad_step + 1]
        assert res["modules"] >= 2, f"rank {r}: {res['modules']} module(s); the test needs several"
        assert before["path"] == at["path"] == path, (r, [s["path"] for s in steps])
        assert before["finite"] and not at["finite"] and after["finite"], r
        held = before["quantized"] if path == "quantized" else before["tensors"]
        assert len(held) >= 2, f"rank {r} held {len(held)} residual(s) before the bad step: the test checks too little"
        assert at["tensors"] == before["tensors"], f"rank {r}: a library state changed across the skipped step"
        assert at["residual_groups"] == before["residual_groups"], r
        assert at["quantized"] == before["quantized"], f"rank {r}: a quantized residual changed across the skipped step"
        assert at["velocities"] == before["velocities"], f"rank {r}: a velocity changed across the skipped step"
        if optimizer == "SGD momentum":
            assert len(before["velocities"]) >= 2 and at["velocities"] != after["velocities"], r
        assert at["tensors"] != after["tensors"] or at["quantized"] != after["quantized"], f"rank {r}: the next step moved nothing"
    for r in range(WORLD):  # replicas (ranks r and r ^ 2) agree bitwise
        for name, shard in results[r]["shards"].items():
            assert np.array_equal(shard, results[r ^ 2]["shards"][name]), (r, name)


def test_hsdp_compressed_warm_up_is_bf16_then_native_then_quantized_and_its_residuals_join_the_first_sparse_step():
    native, warmup, steps = 1, 5, 7
    results = run(fsdp_workers.compressed_warmup, WORLD, steps)
    for r, res in results.items():
        exact, hook = res["native"]["grads"], res["sparse"]["grads"]
        scale = max(g.abs().max().item() for g in exact)
        for s in range(steps):
            error = (hook[s] - exact[s]).abs().max().item()
            if s == 0:  # bfloat16: its 8-bit mantissa, rounded twice (the values, then their sum)
                assert 0 < error <= 2**-7 * scale, (r, s, error)
            elif native < s < warmup:  # 4 bits a value
                assert error > 1e-4 * scale, (r, s, error)
            elif s != warmup:  # FSDP2's own average, or Ok-Topk at density 1: float32 rounding only
                assert error <= 1e-5 * scale, (r, s, error)
        held = res["sparse"]["held"]
        assert held[warmup - 1] == 4 and held[warmup:] == [0] * (steps - warmup), held  # every module's residual folded
        # Nothing lost: the first sparse step sends what the quantized
        # residuals held, so the updates from the native step on sum to the
        # exact averages.
        total = sum(g.double() for g in hook[native : warmup + 1]) - sum(g.double() for g in exact[native : warmup + 1])
        assert total.abs().max().item() <= 1e-5 * scale, (r, total.abs().max().item())
