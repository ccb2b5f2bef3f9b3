"""Real multi-process DDP over gloo on CPU with oktopk's communication hook.

Every test starts fresh processes (forked from a server that imported torch) that form a torch.distributed
process group; oktopk's communicator rendezvouses through that group's own
store and moves gradients over its ZeroMQ transport.
"""

import math
import os
import pickle
import signal
import time
from multiprocessing import connection as mp_connection

import pytest
import torch
import torch.multiprocessing as mp

import workers
from conftest import free_port
from oktopk import ALGORITHMS, OkTopkState


# Ranks are forked from a server that imported torch once (about 2.5 s of
# CPU a process otherwise, most of the suite's time on a 2-core machine),
# and oktopk's Python modules and the tests' worker modules (a 2-rank run
# of a function that does nothing took 0.13 s instead of 0.21). The server
# holds no library (oktopk loads it at its first call), thread pool or
# process group: each rank still starts with none, as a spawned one does.
START_METHOD = os.environ.get("OKTOPK_TEST_START_METHOD", "forkserver")
if START_METHOD == "forkserver":
    mp.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel", "numpy", "oktopk", "workers", "fsdp_workers",
                               "dgc_workers", "momentum_workers", "nan_workers", "optim_workers"])


def run(fn, world, *args, expect_exit=None, timeout=240):
    """Run fn(rank, world, port, out, *args) on `world` spawned processes and
    return what each rank wrote (its folder removed after)."""
    import shutil
    import tempfile

    out = tempfile.mkdtemp(prefix="oktopk-test-")
    try:
        ctx = mp.start_processes(workers.exit_when_done, args=(fn, world, free_port(), out) + args, nprocs=world, join=False,
                                 start_method=START_METHOD)
        # Woken by each rank's end (its sentinel), not by polling.
        deadline = time.monotonic() + timeout
        running = [p.sentinel for p in ctx.processes]
        while running:
            left = deadline - time.monotonic()
            if left <= 0:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"ranks still running after {timeout}s")
            for ended in mp_connection.wait(running, timeout=left):
                running.remove(ended)
        for p in ctx.processes:
            p.join()
        codes = [p.exitcode for p in ctx.processes]
        want = expect_exit or [0] * world
        assert codes == want, f"exit codes {codes}, want {want}"
        results = {}
        for r in range(world):
            path = os.path.join(out, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results[r] = pickle.load(f)
        return results
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.parametrize("world", [2, 4])
def test_density_one_equals_allreduce_hook(world):
    # Same average, summed in another order: float32 rounding only. The
    # tolerance is relative to each parameter's largest gradient entry.
    results = run(workers.density_one, world)
    for r, res in results.items():
        assert res["sparse_iters"] == 4, res
        assert res["worst_relative_diff"] <= 1e-5, f"rank {r}: {res}"


@pytest.mark.accuracy
def test_sparse_cnn_reaches_dense_accuracy_and_ranks_agree():
    world, epochs = 4, 30
    dense = run(workers.train_cnn, world, ["--epochs", str(epochs)])
    sparse = run(workers.train_cnn, world, ["--epochs", str(epochs), "--oktopk", "--algorithm", "oktopk", "--density", "0.01"])
    for res in (dense, sparse):
        assert len({res[r]["params"] for r in range(world)}) == 1, "ranks ended with different parameters"
    acc_dense, acc_sparse = dense[0]["accuracy"], sparse[0]["accuracy"]
    print(f"digits CNN, {world} ranks, {epochs} epochs: dense {acc_dense:.2f}%, oktopk 1% {acc_sparse:.2f}%")
    assert acc_sparse >= acc_dense - 1.0, f"oktopk {acc_sparse:.2f}% vs dense {acc_dense:.2f}%"


def test_every_algorithm_selectable_by_name():
    results = run(workers.every_algorithm, 2, list(ALGORITHMS))
    assert [a for a, _, _ in results[0]] == list(ALGORITHMS)
    for (alg, p0, sent), (_, p1, _) in zip(results[0], results[1]):
        assert p0 == p1, f"{alg}: ranks differ"
        assert sent > 0, f"{alg}: nothing sent through oktopk"


def test_auto_counts_the_algorithm_of_every_call_alike_on_every_rank():
    # Three ranks (the link measurement leaves one unpaired), buckets of a
    # few to thousands of parameters, 6 sparse steps.
    world, steps = 3, 8
    results = run(workers.auto_counts, world, steps)
    counts = results[0]["counts"]
    assert "auto" in ALGORITHMS and counts and "auto" not in counts, counts
    assert set(counts) <= set(ALGORITHMS), counts
    assert sum(counts.values()) == (steps - 2) * results[0]["buckets"], counts
    for r in range(1, world):
        assert results[r]["counts"] == counts, f"rank {r} counted {results[r]['counts']}, rank 0 {counts}"
        assert results[r]["params"] == results[0]["params"], f"rank {r} ended with other parameters"
    print(f"auto, {world} ranks, {results[0]['buckets']} buckets: {counts}")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"density": 0},
        {"density": 1.5},
        {"density": float("nan")},
        {"algorithm": "nope"},
        {"warmup_iters": 0},
        {"warmup_iters": 1},
        {"tau": 0},
        {"tau_prime": -1},
        {"timeout": 0},
        {"density": True},
        {"density": "0.1"},
        {"tau": True},
        {"timeout": "5"},
        {"timeout": float("inf")},
        {"timeout": float("nan")},
        {"value_dtype": "float64"},
        {"value_dtype": "float16", "algorithm": "gtopk"},
        {"value_dtype": "bfloat16", "algorithm": "dense_ring"},
        {"value_dtype": "int4", "algorithm": "gtopk"},
        {"stochastic_rounding": True},
        {"stochastic_rounding": 1, "value_dtype": "float16"},
        {"stochastic_rounding": True, "value_dtype": "int8"},
        {"grads_as_bucket_views": 1},
        {"grads_as_bucket_views": None},
        {"momentum_correction": 1},
        {"momentum_correction": "yes"},
    ],
)
def test_bad_settings_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        OkTopkState(**kwargs)


# One bad value of every OkTopkState setting, by the setting's name (which
# its message must say). Values that are bad only beside another setting
# (16-bit values with a dense algorithm) are in the list above.
BAD_VALUE_OF_EVERY_SETTING = [
    ("density", 0), ("warmup_iters", 1), ("tau", 0), ("tau_prime", -1), ("timeout", 0), ("value_dtype", "float64"),
    ("stochastic_rounding", 1), ("density_schedule", (0.5,)), ("measure_xi_every", 0), ("adaptive", (0.1, 0.01)),
    ("sparse_margin", 1.0), ("sparse_margin", True), ("recheck_every", 1), ("recheck_every", 8.0), ("device_path", "yes"),
    ("sparse", "no"), ("sparse", 0),
    ("dense_compression", "fp8"), ("dense_compression", "float16"), ("grads_as_bucket_views", 1), ("momentum_correction", "yes"),
    ("warmup_compression", "fp8"), ("warmup_compression", "float32"), ("device_path", 0), ("process_group", "world"),
]


@pytest.mark.parametrize("algorithm", (None, *ALGORITHMS), ids=lambda a: f"algorithm={a}")
@pytest.mark.parametrize("name,value", BAD_VALUE_OF_EVERY_SETTING, ids=lambda x: repr(x))
def test_every_bad_setting_is_refused_whatever_the_algorithm(algorithm, name, value):
    # The measured choice's settings (sparse_margin, recheck_every,
    # dense_compression) were once checked only with algorithm=None.
    with pytest.raises(ValueError, match=name):
        OkTopkState(algorithm=algorithm, **{name: value})


@pytest.mark.parametrize(
    "name,values,fails_at",
    [
        ("dense_compression", ("quantized", "bf16"), 0),
        ("dense_compression", ("quantized", None), 0),
        ("sparse", (True, False), 0),
        ("warmup_compression", ("quantized", None), 0),
        ("warmup_iters", (2, 3), 0),
        ("density", (0.1, 0.05), 0),
        ("algorithm", (None, "oktopk"), 0),
        ("optimizer_family", ("AdamW", "SGD"), 1),  # seen once it has stepped
    ],
    ids=lambda x: repr(x),
)
def test_a_setting_that_differs_across_ranks_fails_every_rank_within_seconds_naming_it(name, values, fails_at):
    # Before: a dense_compression mismatch hung until gloo's 30-minute
    # timeout, a warm-up mismatch aborted a rank inside gloo. The process
    # group's timeout (gloo's default) is left as it is: it must not be
    # what ends the run.
    results = run(workers.settings_mismatch, 2, name, values, timeout=120)
    for r in range(2):
        res = results[r]
        assert res["step"] == fails_at, (r, res)
        assert res["seconds"] <= 5.0, (r, res)
        assert "settings differ across ranks" in res["error"], (r, res)
        named = f"{name}: rank 0 has {values[0]!r}, rank 1 has {values[1]!r}"
        if name == "density":
            named = f"density: rank 0 has {float(values[0])!r}, rank 1 has {float(values[1])!r}"
        if name == "optimizer_family":
            named = "optimizer_family: rank 0 has 'Adam-family (AdamW)', rank 1 has 'not Adam-family'"
        assert named in res["error"], (r, res)


def test_python_defaults_and_result_names_are_the_librarys():
    # settings.DEFAULTS is Python's one copy of the settings' defaults: it
    # must say what the library's oktopk_config_init says; error messages
    # name a result as the library does.
    from oktopk import _lib
    from oktopk.settings import DEFAULTS

    cfg = _lib.library_default_config()
    assert (DEFAULTS.density, DEFAULTS.tau, DEFAULTS.tau_prime, DEFAULTS.timeout) == (
        pytest.approx(cfg.density), cfg.tau, cfg.tau_prime, cfg.timeout_ms / 1000)
    assert str(_lib.OkTopkError(_lib.MISMATCH, "x")) == f"oktopk: {_lib.lib().oktopk_get_error_string(_lib.MISMATCH).decode()}: x"
    assert _lib.result_name(_lib.TIMEOUT) == "timeout"


def test_dead_rank_makes_others_raise_within_timeout():
    timeout = 4.0
    results = run(workers.dead_peer, 2, timeout, expect_exit=[0, 3])
    res = results[0]
    assert res["step"] == 3, res
    assert "oktopk" in res["error"], res
    assert res["seconds"] <= timeout * 1.1 + 1.0, res
    assert res["corrected"] > 0 and res["velocities_kept"], res


def test_stopped_rank_on_a_process_group_step_is_named_on_every_survivor():
    # One rank of 3 stopped during a step on the process group's own
    # allreduce. gloo fails the survivors in different words: the first
    # whose wait ends at the process group's timeout says it timed out and
    # closes its connections, and another may then read "Connection closed
    # by peer". Every survivor's error names the step's collective and what
    # a closed connection can mean, keeping gloo's words.
    pg_timeout = 4
    results = run(workers.stopped_peer_on_native_step, 3, pg_timeout, "native")
    for r in (0, 1):
        res = results[r]
        assert res["step"] == 2, res
        assert res["error"].count("oktopk:") == 1, res["error"]
        assert "the native allreduce of step 2 over the process group failed" in res["error"], res["error"]
        assert "when its own wait for a stopped or slow rank ends at the process group's timeout" in res["error"], res["error"]
        assert "gloo" in res["error"], res["error"]
        assert res["seconds"] <= 3 * pg_timeout + 4, res  # the timeout, not the stopped rank's return (a minute on)


def test_a_step_that_fails_after_some_of_its_buckets_completed_gives_back_what_they_took():
    # The 4-bit path in several buckets, SGD with momentum: rank 1 dies in
    # step 4 after the last layers' buckets were reduced. Rank 0's step
    # fails in a later bucket; the 4-bit residuals (its own and the
    # owner's, of every group) and the velocities are then bitwise what
    # they were before the step, so a checkpoint saved after the failure
    # is the one of the step before.
    res = run(workers.dead_peer_between_buckets, 2, 4.0, expect_exit=[0, 3])[0]
    assert res["step"] == 4 and "oktopk" in res["error"], res
    before, after = res["before"], res["after"]
    assert after["bytes"] > before["bytes"], "no bucket of the failed step completed: the case under test did not occur"
    assert len(before["quantized"]) >= 2, before["quantized"].keys()
    assert after["quantized"] == before["quantized"], "the failed step moved 4-bit residuals"
    assert after["momentum"] == before["momentum"], "the failed step moved velocities"


def test_a_failure_says_whether_a_rank_was_lost():
    # What an elastic restart recovers from (oktopk_horovod raises these as
    # HorovodInternalError): a peer's error or death, a timeout, an abort
    # after one; not a mismatch, a bad argument or the library's own error.
    from oktopk import OkTopkError, _lib

    lost = {_lib.REMOTE_ERROR, _lib.TIMEOUT, _lib.ABORTED}
    for code in range(_lib.SUCCESS + 1, _lib.IN_PROGRESS):
        assert OkTopkError(code, "x").lost_peer == (code in lost), _lib.result_name(code)


def test_process_group_failures_are_named_and_other_errors_pass_through():
    # The words gloo fails a survivor with when another survivor's timeout
    # closed their connection (the race the test above cannot force).
    from oktopk import OkTopkError, _lib
    from oktopk.peer_errors import peer_failures_named

    closed = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:23456")
    timed_out = RuntimeError("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete")
    for err, code in ((closed, _lib.REMOTE_ERROR), (timed_out, _lib.TIMEOUT)):
        with pytest.raises(OkTopkError) as caught:
            with peer_failures_named("the bf16 allreduce of step 7"):
                raise err
        assert caught.value.code == code and caught.value.__cause__ is err
        message = str(caught.value)
        assert message.startswith(f"oktopk: {_lib.result_name(code)}: the bf16 allreduce of step 7 over the process group failed: {err}"), message
        assert "when it dies, or when its own wait for a stopped or slow rank ends at the process group's timeout" in message
    # Not the process group's transport: the error itself, unchanged.
    for err in (RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"), OkTopkError(_lib.TIMEOUT, "oktopk: timeout: x")):
        with pytest.raises(type(err)) as caught:
            with peer_failures_named("the native allreduce of step 1"):
                raise err
        assert caught.value is err


@pytest.mark.parametrize("multi_bucket", [False, True], ids=["one_bucket", "multi_bucket"])
def test_checkpoint_resume_matches_uninterrupted_run(tmp_path, multi_bucket):
    # Checkpoints after step 1 (inside the warm-up of 2), after step 2
    # (state.iter == warmup_iters: no sparse step yet) and after step 4.
    # multi_bucket: the saved layout has several buckets, and the resumed
    # run's first step gets DDP's initial layout (one bucket) again.
    cuts = [1, 2, 4]
    full = run(workers.checkpoint, 2, "full", str(tmp_path), multi_bucket, cuts)
    resumed = run(workers.checkpoint, 2, "resume", str(tmp_path), multi_bucket, cuts)
    for r in range(2):
        for cut in cuts:
            assert resumed[r][cut]["params"] == full[r]["params"], f"rank {r}, resumed after step {cut}: parameters differ from the uninterrupted run's"
            # SGD with momentum: the resumed run corrects momentum
            # (oktopk.momentum) from its first step, from the checkpoint.
            assert resumed[r][cut]["corrected"] == full[r]["corrected"] > 0, (cut, resumed[r][cut]["corrected"], full[r]["corrected"])
            if multi_bucket:
                assert full[r]["groups"] >= 3, full[r]["groups"]
                assert resumed[r][cut]["groups"] == full[r]["groups"], (cut, resumed[r][cut]["groups"], full[r]["groups"])
    assert full[0]["params"] == full[1]["params"]


def test_checkpoint_of_another_rank_is_refused_at_load(tmp_path):
    # The save-on-rank-0 habit: rank 1 loading rank 0's residuals would drift.
    results = run(workers.checkpoint_of_another_rank, 2, str(tmp_path))
    for r in range(2):
        res = results[r]
        error = res["error"]
        assert error is not None, f"rank {r} accepted rank {1 - r}'s state"
        assert f"belongs to rank {1 - r}" in error and f"this process is rank {r} of 2" in error, error
        assert "Save every rank's state_dict()" in error, error
        assert res["saved"] == (r, 2), res


def test_checkpoint_of_another_world_size_is_refused_at_load(tmp_path):
    run(workers.checkpoint_of_another_rank, 2, str(tmp_path))
    res = run(workers.checkpoint_of_another_world_size, 1, str(tmp_path))[0]
    assert res["at_load"] is not None and "saved by a run of 2 ranks, and this run has 1" in res["at_load"], res
    assert "Resume with 2 ranks" in res["at_load"], res
    # Loaded before the process group existed: refused at the first sparse
    # step (the first one: the checkpoint is past the warm-up), in the same
    # words, before any communicator is set up.
    step, message, no_comm = res["at_step"]
    assert step == 0 and "saved by a run of 2 ranks" in message and no_comm, res["at_step"]
    # The library's own refusals name their cause once.
    assert res["malformed"].startswith("oktopk: invalid argument: tensor 5: "), res["malformed"]
    assert res["malformed"].count("oktopk:") == 1, res["malformed"]


def test_environment_settings_made_after_the_library_is_loaded_take_effect():
    res = run(workers.env_after_load, 1)[0]
    assert "#curve=" in res["curve"] or "CURVE" in res["curve"], f"OKTOPK_CURVE=1 ignored: {res['curve']}"
    assert "#curve=" not in res["no_curve"], res["no_curve"]
    assert res["ifname"] is not None and '"oktopk-none0"' in res["ifname"], f"OKTOPK_SOCKET_IFNAME ignored: {res['ifname']}"
    assert res["ifname"].count("oktopk:") == 1, res["ifname"]
    assert "oktopk: rank 0 waiting" in res["stall"], f"OKTOPK_STALL_WARN=0.2 ignored: {res['stall']!r}"


def test_concurrent_call_from_another_thread_is_refused():
    # A second thread's call while the first thread's runs is refused with
    # invalid usage (2), its tensor untouched; the calls that ran met in
    # order, so both ranks hold the same results.
    results = run(workers.two_threads_one_comm, 2)
    code, message, untouched = results[0]["refused"]
    assert code == 2 and "another thread" in message and untouched, results[0]["refused"]
    assert results[1]["refused"] is None
    assert results[0]["outputs"] == results[1]["outputs"]


def test_non_finite_gradient_on_one_rank_is_nan_on_every_rank_and_training_goes_on():
    # algorithm="oktopk": its ranks agree on skipping a non-finite step in
    # the library itself.
    steps, bad_step = 6, 3
    results = run(workers.non_finite_step, 2, 1, bad_step, steps)
    for r, res in results.items():
        assert res["non_finite"] == [s == bad_step for s in range(steps)], f"rank {r}: {res['non_finite']}"
        assert res["params_changed"] == [s != bad_step for s in range(steps)], f"rank {r}: GradScaler did not skip exactly step {bad_step}"
        assert res["scales"][bad_step] < res["scales"][bad_step - 1], f"rank {r}: {res['scales']}"
        # 2 warm-up steps, and the skipped step does not count.
        assert res["finite"] and res["sparse_iters"] == steps - 2 - 1, res
    assert results[0]["params"] == results[1]["params"], "ranks ended with different parameters"


@pytest.mark.parametrize("how", ["exit", "stop"])
def test_rank_dead_during_setup_makes_others_raise_within_timeout(how):
    # "stop": the store's host frozen. Before, the survivor's store.wait
    # timed out and then waited for the store's answer to its "stop
    # waiting" under the store's own timeout (torchrun's: 30 minutes).
    from oktopk.store import STORE_GRACE

    timeout = 4.0
    if how == "exit":
        res = run(workers.dead_in_setup, 2, timeout, how, expect_exit=[0, 3])[0]
    else:
        res = run(workers.dead_in_setup, 2, timeout, how, expect_exit=[-signal.SIGKILL, 0])[1]
    assert res["step"] == 2, res
    assert "OkTopkError" in res["error"] or "oktopk:" in res["error"], res
    assert "setup" in res["error"], res
    assert res["seconds"] <= timeout * 1.1 + STORE_GRACE + 1.0, res


def test_unsupported_bucket_dtype_is_refused_on_the_first_step():
    res = run(workers.unsupported_dtype, 1)[0]
    assert res["error"] is not None and "float64" in res["error"] and "float32" in res["error"], res


def test_communicator_dropped_counts_strangers_refused_connections():
    res = run(workers.dropped_count, 1, 3)[0]
    assert res["before"] == 0, res
    assert res["after"] >= 3, f"3 strangers' connections, {res['after']} counted as refused"
    assert res["raised_after_destroy"], "Communicator.dropped after destroy did not raise OkTopkError"


def test_forked_child_cannot_call_the_library():
    res = run(workers.fork_child, 1)[0]
    assert res["child_exit"] == 0, "a forked child's call did not raise OkTopkError naming fork"
    assert res["parent_result"] == [1.0] * 4


def test_rss_does_not_grow_over_hook_calls_after_warm_up():
    # After warm-up every buffer the hook and the library need exists: the
    # residuals, the library's scratch, the hook's staging memory (the
    # groups are laid out in ascending order, as checkpoints of the earlier
    # hook hold them, and DDP lays out the layers' bucket otherwise, see
    # workers.rss_steady, so it is gathered at every step). Later calls
    # reuse them; RSS moves only by the library's collector headroom (a
    # quarter of what it holds) and allocator noise, well under a gradient.
    # What they hold is a residual per bucket, Ok-Topk's region sum (half a
    # gradient at P = 2, with slack), that headroom, and the Go runtime's
    # and ZeroMQ's fixed memory: about 3.5 gradients of this size. Before
    # the library stopped storing acc and bounded its collector's headroom
    # it held 7.5, and RSS still grew by 1.35 gradients after warm-up.
    world, warm, steps = 2, 20, 60
    results = run(workers.rss_steady, world, warm, steps)
    for r, res in results.items():
        grad = res["gradient_kib"]
        held, growth = res["base_kib"] - res["before_kib"], res["peak_kib"] - res["base_kib"]
        assert res["staging_before"], f"rank {r}: the hook never staged a bucket: {res}"
        assert res["staging_after"] == res["staging_before"], f"rank {r}: staging memory was allocated again: {res}"
        assert growth <= 3 * grad // 4, f"rank {r}: RSS grew {growth} KiB over {steps} calls after warm-up (gradient: {grad} KiB): {res}"
        assert held <= 9 * grad // 2, f"rank {r}: the library and the hook hold {held} KiB after warm-up, more than 4.5 gradients ({grad} KiB each): {res}"


def test_error_feedback_is_exact_with_unused_parameters_and_reduced_values():
    # find_unused_parameters=True, a parameter unused on every rank at two
    # steps of three (DDP then keeps its .grad and discards the hook's result
    # for it) and one used on rank 0 only, at every other step. Over the
    # sparse steps, per parameter, the gradients given to the hook summed
    # over the ranks must equal P x what DDP applied plus the residuals left:
    # nothing a rank selected for a discarded parameter may vanish, and with
    # float16, 8-bit or 4-bit values the rounding errors stay in the
    # residuals too.
    world, warmup, steps, value_dtypes = 3, 2, 14, ["float32", "float16", "int8", "int4"]
    runs = run(workers.unused_parameters, world, value_dtypes, warmup, steps)
    for value_dtype in value_dtypes:
        results = {r: runs[r][value_dtype] for r in range(world)}
        assert all(r["globally_unused"] == results[0]["globally_unused"] for r in results.values())
        unused_steps = [u for u in results[0]["globally_unused"] if "sometimes.weight" in u]
        assert len(unused_steps) >= 7, results[0]["globally_unused"]  # the case under test did occur
        for name in results[0]["local"]:
            for r in range(1, world):
                assert (results[r]["applied"][name] == results[0]["applied"][name]).all(), f"{value_dtype} {name}: ranks differ"
            local = sum(results[r]["local"][name].astype("float64") for r in range(world))
            left = sum(results[r]["residual"][name].astype("float64") for r in range(world))
            applied = world * results[0]["applied"][name].astype("float64")
            scale = sum(abs(results[r]["local"][name].astype("float64")).sum() for r in range(world))
            lost = abs(local - applied - left).sum() / scale
            assert lost <= 1e-5, f"{value_dtype} {name}: {lost:.3%} of its gradient mass lost"
            # Not by holding everything back: every parameter, used at some
            # sparse steps, got values through.
            assert (applied != 0).any(), f"{value_dtype} {name}: nothing was ever applied"


@pytest.fixture(scope="module")
def schedule_run(tmp_path_factory):
    """One run of workers.density_schedule on 2 ranks, for the tests below."""
    return run(workers.density_schedule, 2, str(tmp_path_factory.mktemp("schedule")))


def test_density_schedule_is_alike_on_every_rank_and_resumes_exactly(schedule_run):
    # density 0.01, schedule (0.5, 4), warm-up 2: sparse step s = iteration - 2
    # runs at 0.5 * 0.02 ** (s / 4) (on a 2**-30 grid) until s = 4, then 0.01.
    results = schedule_run
    n = results[0]["full"]["n"]  # one bucket holds the whole small model
    want = {it: round(0.5 * 0.02 ** ((it - 2) / 4) * 2**30) / 2**30 if it < 6 else 0.01 for it in range(2, 9)}
    for r in (0, 1):
        full, resumed, no_xi = results[r]["full"], results[r]["resumed"], results[r]["no_xi"]
        for it in range(2, 9):
            density, ks, _, _, _ = full["steps"][it]
            assert density == pytest.approx(want[it], rel=1e-12), (r, it, density)
            assert ks == [math.ceil(density * n)], (r, it, ks, density)
            assert full["steps"][it][:2] == results[1 - r]["full"]["steps"][it][:2], f"ranks differ at {it}"
            assert no_xi["steps"][it][:2] == full["steps"][it][:2]
        for it in range(5, 9):
            assert resumed["steps"][it][:2] == full["steps"][it][:2], f"rank {r}: resumed differs at {it}"
        assert resumed["params"] == full["params"], f"rank {r}: resumed run's parameters differ"


def test_xi_measured_every_other_step_alike_on_every_rank_and_changes_nothing(schedule_run):
    results = schedule_run
    for r in (0, 1):
        full, no_xi = results[r]["full"], results[r]["no_xi"]
        assert all(xi is None for _, _, xi, _, _ in no_xi["steps"].values())
        for it in range(2, 9):
            _, _, xi, xi_step, _ = full["steps"][it]
            assert xi_step == it - (it % 2), (r, it, xi_step)  # sparse steps 0, 2, 4, 6
            assert 0 < xi < math.inf, (r, it, xi)  # k < n: something is left out
            assert (xi, xi_step) == results[1 - r]["full"]["steps"][it][2:4], f"ranks' xi differ at {it}"
        assert full["params"] == no_xi["params"], f"rank {r}: measuring xi changed the training"


def test_bytes_sent_counts_the_xi_measurements(schedule_run):
    # The same training with and without ξ (the test above shows it is the
    # same): the difference in bytes is ξ's ring allreduce of 2n values, of
    # which each of 2 ranks sends half to reduce and half to gather, 2n
    # float32s, at each of the 4 measured steps (sparse steps 0, 2, 4, 6).
    results = schedule_run
    n = results[0]["full"]["n"]  # one bucket holds the whole small model
    for r in (0, 1):
        full, no_xi = results[r]["full"]["steps"], results[r]["no_xi"]["steps"]
        assert full[8][4] - no_xi[8][4] == 4 * 2 * n * 4, (r, full[8][4], no_xi[8][4], n)


def test_adaptive_density_and_tau_prime_follow_the_rules_alike_on_every_rank_and_resume_exactly(tmp_path):
    # density 2**-7, adaptive (2**-7, 2**-4, max_xi 1e-3), warm-up 2, ξ every
    # other sparse step: every measured ξ (k < n) is above 1e-3, so the
    # density doubles after sparse steps 0, 2, 4 and then stays at 2**-4.
    # τ′ starts at 8 and follows the agreed drift by the rules.
    from oktopk.adaptive import DRIFT_HIGH, DRIFT_LOW

    results = run(workers.adaptive, 2, str(tmp_path))
    n = results[0]["full"]["n"]  # one bucket holds the whole small model
    for r in (0, 1):
        full, resumed = results[r]["full"]["steps"], results[r]["resumed"]["steps"]
        tau_prime = 8
        for it in range(2, 12):
            s = it - 2
            density, tp, ks, adaptations, inputs = full[it]
            assert density == 2.0 ** -(7 - min((s + 1) // 2, 3)), (r, it, density)
            assert ks == [math.ceil(density * n)], (r, it, ks, density)
            assert tp == tau_prime, (r, it, tp, tau_prime)
            assert adaptations == s // 2 + 1, (r, it, adaptations)  # after each even sparse step
            xi, drift = inputs
            assert 1e-3 < xi < math.inf and 0 <= drift < math.inf, (r, it, inputs)
            if s % 2 == 0:  # the adaptation after this step sets the next step's τ′
                tau_prime = max(1, tau_prime // 2) if drift > DRIFT_HIGH else min(8, 2 * tau_prime) if drift < DRIFT_LOW else tau_prime
            assert full[it] == results[1 - r]["full"]["steps"][it], f"ranks differ at {it}"
        for it in range(7, 12):
            assert resumed[it] == full[it], f"rank {r}: resumed differs at {it}"
        assert results[r]["resumed"]["params"] == results[r]["full"]["params"], f"rank {r}: resumed run's parameters differ"


def test_adaptive_is_refused_with_a_density_schedule_or_bad_bounds():
    with pytest.raises(ValueError, match="both set the density"):
        OkTopkState(adaptive=(0.001, 0.1), density_schedule=(0.5, 4))
    with pytest.raises(ValueError, match="densities"):
        OkTopkState(adaptive=(0.1, 0.01))
    # Training starts at density: one outside the bounds was clamped, silently.
    with pytest.raises(ValueError, match=r"density 0.5 is outside adaptive's bounds \[0.001, 0.1\]"):
        OkTopkState(density=0.5, adaptive=(0.001, 0.1))
    assert OkTopkState(adaptive=(0.001, 0.1)).measure_xi_every == 50
    assert OkTopkState(adaptive=(0.001, 0.1), measure_xi_every=7).measure_xi_every == 7


def test_cpu_buckets_are_reduced_in_place_in_ddps_rebuilt_layout():
    # The hook keeps each group's residual in the order DDP's rebuilt bucket
    # lays its parameters out, so a CPU bucket goes to the library as it is:
    # no staging memory is ever allocated. Laid out in ascending parameter
    # order (the reverse of the order gradients become ready in a
    # sequential model), every bucket of two or more parameters was copied
    # out and back at every step.
    results = run(workers.in_place, 2, 4)
    for r, res in results.items():
        seen = {k: v for k, v in res.items() if k != "params"}
        assert res["groups"] >= 2 and res["largest_group"] >= 2, f"rank {r}: no bucket of several parameters to lay out: {seen}"
        assert res["calls"] == 4 * res["groups"], f"rank {r}: {seen}"
        assert res["staging"] == {}, f"rank {r}: the hook copied a CPU bucket into staging memory: {seen}"
    assert results[0]["params"] == results[1]["params"], "ranks ended with different parameters"


def test_a_checkpoint_with_a_changed_field_or_byte_is_refused_at_load():
    # Before, a checkpoint whose "rank" was edited loaded, its quantized
    # residuals still another rank's.
    import copy

    import torch
    from oktopk.quantized import QuantizedGroup

    state = OkTopkState(density=0.1)
    group = state._quantized[5] = QuantizedGroup((0, 1), (100, 28), 2, 0, "cpu")
    group.residual.copy_(torch.randn(group.padded, generator=torch.Generator().manual_seed(1)))
    saved = state.state_dict()
    intact = OkTopkState(density=0.1)
    intact.load_state_dict(copy.deepcopy(saved))
    assert torch.equal(intact._quantized[5].residual, group.residual)
    corrupted = copy.deepcopy(saved)
    corrupted["quantized"][5]["residual"].view(torch.int32)[3] ^= 1  # one bit of one residual value
    unsigned = {k: v for k, v in saved.items() if k != "checksum"}  # dropping the checksum is no way around it
    for changed in (dict(saved, rank=1), dict(saved, iter=7), corrupted, unsigned):
        with pytest.raises(ValueError, match="fails its checksum"):
            OkTopkState(density=0.1).load_state_dict(changed)
    # A pickled state (its settings beside the checkpoint) is checked alike.
    pickled = pickle.loads(pickle.dumps(state))
    assert torch.equal(pickled._quantized[5].residual, group.residual)
    with pytest.raises(ValueError, match="fails its checksum"):
        OkTopkState.__new__(OkTopkState).__setstate__(dict(state.__getstate__(), warmup_iters=5))
    for s in (state, intact, pickled):
        s.close()


def test_a_checkpoint_of_another_layout_version_is_refused_naming_both_versions():
    # Signed, so the checksum holds: only its layout's version differs (or
    # is missing, as in a checkpoint saved before versions were recorded).
    from oktopk.checkpoint import VERSION
    from oktopk.settings import with_checksum

    state = OkTopkState(density=0.1)
    saved = {k: v for k, v in state.state_dict().items() if k != "checksum"}
    assert saved["version"] == VERSION
    older = {k: v for k, v in saved.items() if k != "version"}
    for other, named in ((dict(saved, version=VERSION + 1), VERSION + 1), (older, None)):
        with pytest.raises(ValueError, match=f"layout version {named!r}, and this oktopk reads version {VERSION}"):
            OkTopkState(density=0.1).load_state_dict(with_checksum(other))
    pickled = {k: v for k, v in state.__getstate__().items() if k != "checksum"}
    with pytest.raises(ValueError, match="layout version"):
        OkTopkState.__new__(OkTopkState).__setstate__(with_checksum(dict(pickled, version=VERSION + 1)))
    state.close()


@pytest.mark.parametrize(
    "optimizer,dense_compression,device_path,nan_step",
    [("SGD", None, False, 6), ("SGD", None, True, 6), ("AdamW", "quantized", None, 22)],
    ids=["sparse_to_native", "sparse_to_native_device_path", "quantized_to_native"],
)
def test_a_nan_on_one_rank_at_the_switch_to_native_keeps_every_residual_on_every_rank(optimizer, dense_compression, device_path, nan_step):
    # Before: every rank folded what it held into a sum that came out NaN,
    # and the skipped step lost it (quantized groups 2 -> 0).
    results = run(workers.nan_at_switch, 2, optimizer, dense_compression, device_path, nan_step)
    for r, res in results.items():
        steps = res["steps"]
        before, at, after = steps[nan_step - 1], steps[nan_step], steps[nan_step + 1]
        assert before["path"] != "native" and at["path"] == "native" and after["path"] == "native", (r, [s["path"] for s in steps])
        assert not at["finite"] and before["finite"] and after["finite"], r
        held = before["quantized"] if dense_compression == "quantized" else before["tensors"]
        assert held, f"rank {r} held no residual before the switch: the test checks nothing"
        # Bitwise what it was before the skipped step, on every rank.
        assert at["tensors"] == before["tensors"], r
        assert at["residual_groups"] == before["residual_groups"], r
        assert at["quantized"] == before["quantized"], r
        # The next (finite) native step folds it all.
        assert after["quantized"] == {} and after["residual_groups"] == [], r
    assert results[0]["params"] == results[1]["params"]


def test_repr_names_only_the_settings_that_differ_from_their_defaults():
    states = [OkTopkState(), OkTopkState(density=0.05, sparse_margin=0.2, momentum_correction=False),
              OkTopkState(algorithm="oktopk", dense_compression=None)]
    try:
        assert repr(states[0]) == "OkTopkState()"
        assert repr(states[1]) == "OkTopkState(density=0.05, choice=Choice(sparse_margin=0.2), momentum=Momentum(correction=False))"
        assert repr(states[2]) == "OkTopkState(algorithm='oktopk')"  # the measured choice's own settings mean nothing then
    finally:
        for s in states:
            s.close()


def test_a_nan_in_one_bucket_of_a_quantized_step_keeps_every_quantized_residual_on_every_rank():
    # The campaign's nan-one-group finding on the quantized path: the
    # NaN's group comes back NaN on every rank and the step is skipped,
    # but the other groups' quantized allreduces completed and replaced
    # their residuals; the skipped step lost what they sent. Now they are
    # taken back before the next step, bitwise.
    nan_step = 9
    results = run(workers.nan_at_switch, 2, "AdamW", "quantized", None, nan_step)
    for r, res in results.items():
        steps = res["steps"]
        before, at, after = steps[nan_step - 1], steps[nan_step], steps[nan_step + 1]
        assert before["path"] == at["path"] == after["path"] == "quantized", (r, [s["path"] for s in steps])
        assert before["finite"] and not at["finite"] and after["finite"], r
        assert len(before["quantized"]) >= 2, f"rank {r} held {len(before['quantized'])} quantized group(s): the test checks too little"
        assert at["quantized"] == before["quantized"], f"rank {r}: a quantized residual changed across the skipped step"
        assert after["quantized"] != at["quantized"], f"rank {r}: the next step moved nothing"
    assert results[0]["params"] == results[1]["params"]


def test_sparse_false_measures_the_4_bit_path_under_sgd_and_takes_no_sparse_step():
    # sparse=False: under SGD the measured choice runs between native and
    # dense_compression's 4-bit path as it does under Adam; sparse is never
    # probed, even where it would be fastest. The 4-bit probe (steps 2-5) is
    # a quarter of the timed warm-up step: chosen with no native probe, and
    # kept at the recheck, 2 x recheck_every steps later (a clear win's).
    # The correction has nothing waiting to correct.
    world = 2
    results = run(workers.no_sparse_choice, world)
    paths = results[0]["paths"]
    warmup = 2
    assert "sparse" not in paths and paths[:warmup] == ["native"] * warmup, paths
    # 4-bit from the probe on; the recheck's native probe 16 steps after
    # the decision (at 4).
    assert paths[warmup:warmup + 20] == ["quantized"] * 20 and paths[warmup + 20:warmup + 24] == ["native"] * 4, paths
    choice = results[0]["choice"]
    assert choice["candidate"] == "quantized" and choice["path"] == "quantized" and choice["steps"]["sparse"] == 0, choice
    for r in range(world):
        assert results[r]["paths"] == paths and results[r]["choice"]["candidate"] == "quantized"
        assert results[r]["quantized_bytes"] > 0 and not results[r]["communicator"]  # no library communicator: nothing sparse
        assert all(i is True for i in results[r]["idle"][1:]), results[r]["idle"]
        assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[r]["params"])), f"rank {r}"


def test_the_momentum_correction_hands_the_gradient_through_on_4_bit_steps():
    # A 4-bit step sends every value every step: nothing waits to arrive
    # as a burst, so the correction has no work there and the step is error
    # feedback on the gradient under the optimizer's own momentum. The run
    # with the correction on is then bitwise the run with it off (weight
    # decay included), and the correction was idle on every 4-bit step.
    world = 2
    results = run(workers.quantized_momentum, world)
    for r in range(world):
        on, off = results[r]["on"], results[r]["off"]
        assert on["quantized_bytes"] > 0 and on["quantized_bytes"] == off["quantized_bytes"]
        # Active from the optimizer's first step (step 0 has none yet);
        # idle on DDP's native second step and every 4-bit step after it.
        assert on["idle"][1:] == [True] * (len(on["idle"]) - 1), on["idle"]
        assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"])), f"rank {r}"
    assert all(torch.equal(a, b) for a, b in zip(results[0]["on"]["params"], results[1]["on"]["params"]))


@pytest.mark.parametrize("warmup_compression", ["quantized", "bf16", "fp16"])
def test_a_compressed_warm_up_is_bf16_then_native_for_ddps_two_steps_then_compressed_and_loses_nothing(warmup_compression):
    world, native, warmup = 2, 1, 5
    results = run(workers.compressed_warmup, world, warmup_compression)
    steps = results[0]["steps"]
    assert results[0]["sparse_iters"] == len(steps) - warmup
    for r in range(1, world):  # every rank applies the same update
        for s, (mine, theirs) in enumerate(zip(steps, results[r]["steps"])):
            assert torch.equal(mine["hook"], theirs["hook"]), (r, s)
    n = steps[0]["exact"].numel()
    scale = max(s["exact"].abs().max().item() for s in steps)
    # DDP's first step (its provisional layout, where no residual is kept)
    # goes in bfloat16, exactly as bf16_compress_hook sends it.
    assert torch.equal(steps[0]["hook"], steps[0]["bf16"])
    assert not torch.equal(steps[0]["hook"], steps[0]["exact"])
    for s, step in enumerate(steps[1:], start=1):
        error = (step["hook"] - step["exact"]).abs().max().item()
        if native < s < warmup:  # compressed: a few bits a value
            assert error > 1e-4 * scale, (s, error)
            if warmup_compression in ("bf16", "fp16"):  # exactly as torch's own hook sends it
                assert torch.equal(step["hook"], step[warmup_compression]), s
        elif s != warmup or warmup_compression != "quantized":  # the float32 allreduce; Ok-Topk at density 1
            assert error <= 1e-6 * scale, (s, error)
        # (the first sparse step also sends what the quantized residuals held: below)
    quantized_bytes = [s["quantized_bytes"] for s in steps]
    if warmup_compression == "quantized":
        # 4 bits per value and a scale per block of 32: each warm-up step's
        # frames are about an eighth of float32's 2n(P-1)/P bytes.
        per_step = [quantized_bytes[s] - quantized_bytes[s - 1] for s in range(native + 2, warmup)]
        assert quantized_bytes[native] == 0 and quantized_bytes[native + 1] > 0, quantized_bytes
        assert all(0 < b < 2 * 4 * n * (world - 1) / world / 4 for b in per_step), per_step
        assert steps[warmup - 1]["quantized_groups"] > 0
        # The first sparse step folds what the residuals held: no group holds
        # one after it, and the updates from the native step on sum to the
        # gradients' average (density 1 sends everything).
        assert [s["quantized_groups"] for s in steps[warmup:]] == [0] * (len(steps) - warmup)
        total = sum(s["hook"].double() for s in steps[native : warmup + 1])
        exact = sum(s["exact"].double() for s in steps[native : warmup + 1])
        assert (total - exact).abs().max().item() <= 1e-5 * scale, (total - exact).abs().max().item()
    else:
        assert quantized_bytes == [0] * len(steps)  # 16 bits keep no residual: their rounding is lost, as torch's hooks lose it
