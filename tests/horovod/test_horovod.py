"""The Horovod integration under real `horovodrun --gloo` on localhost:
Horovod's own processes, Horovod's collectives for the rendezvous, and
liboktopk's ZeroMQ transport for the gradients."""

import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "plugins", "pytorch"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "plugins", "horovod"))
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def horovodrun(np, worker, *args, timeout=400):
    """Run workers.py's ``worker`` on ``np`` ranks under horovodrun and
    return what each rank wrote (its folder removed after)."""
    out = tempfile.mkdtemp(prefix="oktopk-hvd-")
    try:
        cmd = [HOROVODRUN, "--gloo", "-np", str(np), "-H", f"localhost:{np}", sys.executable, os.path.join(HERE, "workers.py"), worker, out,
               *map(str, args)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, f"horovodrun exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        results = {}
        for r in range(np):
            with open(os.path.join(out, f"rank{r}.pkl"), "rb") as f:
                results[r] = pickle.load(f)
        return results
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.parametrize("np,bucket_bytes", [(2, None), (4, None), (2, 1)])
def test_density_one_matches_horovod_average(np, bucket_bytes):
    # Same average summed in another order: float32 rounding only. The
    # tolerance is relative to each parameter's largest gradient entry.
    # bucket_bytes=1: a bucket per parameter, reduced in its own gradient.
    results = horovodrun(np, "density_one", *(["5", bucket_bytes] if bucket_bytes else []))
    for r, res in results.items():
        assert res["worst_relative_diff"] <= 1e-5, f"rank {r}: {res['worst_relative_diff']}"
        assert res["bytes_sent"] > 0, "no traffic went through oktopk"
        assert res["horovod_reductions"] == 0, f"rank {r}: {res['horovod_reductions']} gradient reductions went through Horovod"
    # Ranks started from different seeds; hvd.broadcast_parameters made them one model.
    assert len(set(results[0]["after_broadcast"])) == 1
    # Every rank holds the same reduced gradients, bit for bit.
    assert all(res["grad_digests"] == results[0]["grad_digests"] for res in results.values())


# 2 ranks: at 4 the same training is tests/python's DDP test of the digits
# CNN (the same model, data, epochs and bound), and Horovod's 4-rank path is
# checked exactly by test_density_one_matches_horovod_average.
@pytest.mark.accuracy
@pytest.mark.parametrize("np", [2])
def test_sparse_cnn_within_one_point_of_dense_and_ranks_agree(np):
    epochs = 30
    common = ["--epochs", epochs, "--init-seed", 7]  # per-rank init: the broadcast must unify it
    dense = horovodrun(np, "train_cnn", *common)
    sparse = horovodrun(np, "train_cnn", *common, "--oktopk", "--algorithm", "oktopk", "--density", "0.01")
    for res in (dense, sparse):
        assert all(r["params"] == res[0]["params"] for r in res.values()), "ranks ended with different parameters"
    acc_dense, acc_sparse = dense[0]["accuracy"], sparse[0]["accuracy"]
    print(f"digits CNN under horovodrun -np {np}, {epochs} epochs: dense {acc_dense:.2f}%, oktopk 1% {acc_sparse:.2f}%")
    assert acc_sparse >= acc_dense - 1.0, (acc_dense, acc_sparse)


def test_fp16_allreduce_with_oktopk_sends_float16_values():
    # The example's --fp16-allreduce --oktopk: the same training with float16
    # values sends fewer bytes (6 instead of 8 per pair), and the ranks agree.
    common = ["--epochs", 2, "--oktopk", "--algorithm", "oktopk", "--density", "0.01"]
    f32 = horovodrun(2, "train_cnn", *common)
    f16 = horovodrun(2, "train_cnn", *common, "--fp16-allreduce")
    assert all(r["params"] == f16[0]["params"] for r in f16.values()), "ranks ended with different parameters"
    ratio = f16[0]["bytes_sent"] / f32[0]["bytes_sent"]
    print(f"digits CNN, horovodrun -np 2, 2 epochs, Ok-Topk 1%: float16 values sent {ratio:.3f}x the bytes of float32 ones")
    assert ratio < 0.85, ratio


def test_nan_on_one_rank_is_a_skipped_step_on_every_rank_and_every_residual_stays_as_before():
    results = horovodrun(2, "nan_on_one_rank")
    for r, res in results.items():
        assert res["finite"] == [True, True, False, True, True], f"rank {r}: {res['finite']}"
        assert res["params"] == results[0]["params"], "ranks ended with different parameters"
        # The other buckets' calls completed; they are taken back, so every
        # residual and threshold is what it was before the skipped step.
        assert res["buckets"] >= 2 and res["held"] >= 2, (r, res["buckets"], res["held"])
        assert res["unchanged"], f"rank {r}: a residual changed across the skipped step"
        assert res["steps_counted"] == 4, f"rank {r}: {res['steps_counted']} steps counted of 5, one of them void"


def autohook_run(tmp_path, *script_args, env=None):
    """tests/horovod/launched_hvd_train.py, unchanged, under horovodrun -np 2
    with ``python -m oktopk.autohook``: horovodrun's result and each rank's
    record."""
    import json

    out = tmp_path / "out"
    out.mkdir(parents=True)
    root = os.path.join(HERE, "..", "..")
    cmd = [HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-m", "oktopk.autohook",
           os.path.join(HERE, "launched_hvd_train.py"), "--out", str(out), *script_args]
    path = os.pathsep.join([os.path.join(root, "plugins", "pytorch"), os.path.join(root, "plugins", "horovod")])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **(env or {})))
    ranks = {int(f[4:-5]): json.load(open(out / f)) for f in os.listdir(out)}
    return proc, ranks


def test_the_zero_line_launcher_gives_an_unchanged_horovod_scripts_optimizer_oktopks_compression(tmp_path):
    proc, ranks = autohook_run(tmp_path, env={"OKTOPK_DENSITY": "0.05"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(ranks) == [0, 1], proc.stdout[-3000:]
    for r, res in ranks.items():
        assert res["bytes_sent"] is not None and res["bytes_sent"] > 0, res  # the library's calls, counted by the optimizer
    assert ranks[0]["params"] == ranks[1]["params"]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "Compression.oktopk(density=0.05) is on" in line]
    assert len(said) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # rank 0 only, once
    proc, ranks = autohook_run(tmp_path / "fp16", "--fp16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(res["bytes_sent"] is None for res in ranks.values()), ranks  # Horovod's own optimizer, untouched
    assert "has compression=" in proc.stdout + proc.stderr and "left as it is" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    # A setting Horovod's optimizer cannot honour (a dense warm-up) is
    # refused where the script builds one, by name.
    proc, _ = autohook_run(tmp_path / "refused", env={"OKTOPK_WARMUP_ITERS": "5"})
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert "refused for hvd.DistributedOptimizer" in said and "warmup" in said, said[-3000:]


def test_under_horovods_elastic_mode_a_killed_rank_shrinks_the_job_and_a_new_one_grows_it_back(tmp_path):
    # horovodrun --min-np 1 --max-np 2 on this machine under two host names
    # (a failed worker blacklists its whole host for a second or two), rank
    # 1 SIGKILLed in step 5: the survivor's library call fails naming the
    # lost rank, raised as HorovodInternalError; hvd.elastic.run restores
    # the last commit and goes on alone, and once the host is back a new
    # rank 1 joins. Each reset starts a new engine over the ranks as they
    # are; the residuals of the commit before the kill no longer go with
    # the parameters (commits were made at another size since) and are
    # dropped, once, and said.
    ranks = _elastic_run(tmp_path, 5, min_np=1, names=2, extra=["--step-seconds", "0.3", "--until-size", "2"])
    assert ranks[0]["resets"] == [1, 2], ranks  # shrunk to the survivor, grown back to two
    assert ranks[0]["digest"] == ranks[1]["digest"], ranks  # the new rank took the survivor's parameters
    for r, res in ranks.items():
        assert res["step"] >= 12 and res["bytes_sent"] > 0, res
        assert res["last_restart"] == "dropped" and res["dropped"] == 1, (r, res)


def _local_host_names(count):
    """``count`` distinct names of this machine that Horovod runs on without
    ssh (each resolves to one of its IPv4 addresses): a failed worker
    blacklists its host name for a while, so a job that must get back to
    its size at once needs a name to spare."""
    import socket

    import psutil

    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    names = []
    for name in ["localhost", "127.0.0.1", socket.gethostname(), *sorted(local)]:
        try:
            if name not in names and socket.gethostbyname(name) in local:
                names.append(name)
        except OSError:
            pass
    assert len(names) >= count, f"this machine has only these names Horovod takes as local: {names}"
    return names[:count]


def _elastic_run(tmp_path, kill_at, min_np=2, names=3, extra=()):
    """elastic_train.py on 2 ranks under horovodrun --min-np MIN_NP
    --max-np 2, the machine under NAMES host names, 12 steps (and EXTRA
    arguments), rank 1 killed in step KILL_AT (-1: never): each rank's
    record."""
    import json

    tmp_path.mkdir(exist_ok=True)
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\n" + "".join(f"echo {name}:1\n" for name in _local_host_names(names)))
    discover.chmod(0o755)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    root = os.path.join(HERE, "..", "..")
    cmd = [HOROVODRUN, "--gloo", "-np", "2", "--min-np", str(min_np), "--max-np", "2", "--host-discovery-script", str(discover),
           "--blacklist-cooldown-range", "1", "2", "--network-interface", "lo", sys.executable,
           os.path.join(HERE, "elastic_train.py"), "--out", str(out), "--ckpt", str(ckpt), "--kill-at", str(kill_at), "--steps", "12",
           *extra]
    path = os.pathsep.join([os.path.join(root, "plugins", "pytorch"), os.path.join(root, "plugins", "horovod")])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, start_new_session=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path))
    said = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, said
    ranks = {int(f[4:-5]): json.load(open(out / f)) for f in os.listdir(out)}
    assert sorted(ranks) == [0, 1], said
    return ranks


def test_under_horovods_elastic_mode_at_a_fixed_size_a_killed_rank_resumes_bitwise(tmp_path):
    # horovodrun --min-np 2 --max-np 2 with three names of this machine:
    # rank 1 SIGKILLed in step 5, before its backward. The survivor's call
    # fails naming the lost rank; hvd.elastic.run restores the commit of
    # step 5, a new rank 1 starts on a name not blacklisted and finds its
    # own state of that commit in checkpoint_dir, and both load their
    # residuals ("loaded"): the run ends with the parameters of the same
    # run uninterrupted, bit for bit.
    whole = _elastic_run(tmp_path / "whole", -1)
    killed = _elastic_run(tmp_path / "killed", 5)
    assert killed[0]["resets"] == [2], killed  # the survivor reset once, to the same size
    for r in (0, 1):
        assert killed[r]["last_restart"] == "loaded" and killed[r]["dropped"] == 0, (r, killed[r])
        assert killed[r]["step"] == 12 and killed[r]["bytes_sent"] > 0, killed[r]
        assert whole[r]["resets"] == [] and whole[r]["step"] == 12, whole[r]
        assert killed[r]["digest"] == whole[0]["digest"], (r, killed[r]["digest"], whole[0]["digest"])


def test_sparse_gradients_need_sparse_as_dense():
    results = horovodrun(2, "sparse_embedding")
    for r, res in results.items():
        assert res[True]["error"] is None, f"rank {r}: {res[True]['error']}"
        assert res[True]["max_diff"] <= 1e-6, f"rank {r}: {res[True]['max_diff']}"
        assert res[True]["digest"] == results[0][True]["digest"], "ranks reduced the embedding gradient differently"
        assert res[False]["error"] is not None and "sparse_as_dense=True" in res[False]["error"]


def test_plain_horovod_optimizer_refuses_oktopk_compression():
    results = horovodrun(2, "plain_horovod_refuses")
    for res in results.values():
        assert res["error"] is not None, "hvd.DistributedOptimizer ran with the oktopk compressor"
        assert "oktopk_horovod.DistributedOptimizer" in res["error"]


def test_auto_counts_the_algorithm_of_every_call_alike_on_every_rank():
    steps = 6
    results = horovodrun(3, "auto_counts", steps)
    counts = results[0]["counts"]
    assert counts and "auto" not in counts and set(counts) <= set(results[0]["algorithms"]), counts
    assert sum(counts.values()) == steps * results[0]["buckets"], counts
    for r, res in results.items():
        assert res["counts"] == counts, f"rank {r} counted {res['counts']}, rank 0 {counts}"
        assert res["digest"] == results[0]["digest"], f"rank {r} ended with another model"
    print(f"auto under Horovod, 3 ranks, {results[0]['buckets']} buckets: {counts}")


@pytest.mark.parametrize(
    "kwargs",
    [dict(density=0.0), dict(density=1.5), dict(algorithm="nope"), dict(tau=0), dict(tau_prime=-1), dict(timeout=0),
     dict(value_dtype="float64"), dict(value_dtype="float16", algorithm="sparcml"), dict(value_dtype="float16", algorithm="gtopk"),
     dict(stochastic_rounding=True), dict(momentum_correction=1), dict(momentum_correction="yes")],
)
def test_bad_settings_raise_value_error(kwargs):
    import oktopk_horovod

    with pytest.raises(ValueError):
        oktopk_horovod.Compression.oktopk(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(density=True), dict(tau=True), dict(timeout=10**9), dict(tau_prime=2**31), dict(adaptive=(0.1, 0.01)),
     dict(adaptive=(0.001, 0.1), density_schedule=(0.5, 4)), dict(measure_xi_every=0)],
)
def test_settings_are_checked_as_the_ddp_state_checks_them(kwargs):
    # One validator for both plugins: whatever OkTopkState refuses,
    # Compression.oktopk refuses with the same message (it took True as a
    # density, and bounds the DDP state refused).
    import oktopk_horovod
    from oktopk import OkTopkState

    with pytest.raises(ValueError) as ddp:
        OkTopkState(**kwargs)
    with pytest.raises(ValueError) as hvd:
        oktopk_horovod.Compression.oktopk(**kwargs)
    assert str(hvd.value) == str(ddp.value)


@pytest.mark.parametrize("algorithm", [None, "auto", "oktopk", "topka", "gtopk", "dense_ring"], ids=lambda a: f"algorithm={a}")
@pytest.mark.parametrize(
    "name,value",
    [("density", 0), ("tau", 0), ("tau_prime", -1), ("timeout", 0), ("value_dtype", "float64"), ("stochastic_rounding", 1),
     ("density_schedule", (0.5,)), ("measure_xi_every", 0), ("adaptive", (0.1, 0.01)), ("sparse_margin", 1.0), ("sparse_margin", True),
     ("recheck_every", 1), ("recheck_every", 8.0), ("device_path", "yes"), ("momentum_correction", "yes")],
    ids=repr,
)
def test_every_bad_setting_is_refused_whatever_the_algorithm(algorithm, name, value):
    import oktopk_horovod

    with pytest.raises(ValueError, match=name):
        oktopk_horovod.Compression.oktopk(algorithm=algorithm, **{name: value})


@pytest.mark.parametrize("name,values", [("density", ("0.1", "0.05")), ("algorithm", ("None", "'oktopk'")), ("demo_topk", ("32", "8"))],
                         ids=lambda x: repr(x))
def test_a_setting_that_differs_across_ranks_fails_every_rank_within_seconds_naming_it(name, values):
    results = horovodrun(2, "settings_mismatch", name, *values, timeout=120)
    setting = "topk" if name == "demo_topk" else name
    for r, res in results.items():
        assert res["error"] is not None and res["seconds"] <= 5.0, (r, res)
        assert f"settings differ across ranks: {setting}: rank 0 has {values[0]}, rank 1 has {values[1]}" in res["error"], (r, res)


def test_other_compressions_are_plain_horovod():
    import horovod.torch as hvd
    import torch

    import oktopk_horovod

    assert oktopk_horovod.Compression.fp16 is hvd.Compression.fp16
    model = torch.nn.Linear(2, 2)
    hvd.init()  # a single process: size 1
    opt = oktopk_horovod.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    assert type(opt).__module__.startswith("horovod"), type(opt)


def test_oktopk_state_of_another_rank_or_world_size_is_refused_at_load(tmp_path):
    ckpt = str(tmp_path)
    for r, res in horovodrun(2, "state_of_another_rank_or_size", ckpt).items():
        assert res["error"] is not None, f"rank {r} accepted rank {1 - r}'s state"
        assert f"belongs to rank {1 - r}" in res["error"] and f"this process is rank {r} of 2" in res["error"], res["error"]
    res = horovodrun(1, "state_of_another_rank_or_size", ckpt)[0]
    assert res["error"] is not None and "saved by a run of 2 ranks, and this run has 1" in res["error"], res["error"]


def test_density_schedule_alike_on_every_rank_resumes_exactly_and_measures_xi(tmp_path):
    # density 0.01, schedule (0.5, 4): optimizer step s runs at
    # 0.5 * 0.02 ** (s / 4) (on a 2**-30 grid) until s = 4, then 0.01; every
    # other step measures xi.
    results = horovodrun(2, "density_schedule", str(tmp_path))
    n = results[0]["full"]["n"]  # one bucket holds the whole small model
    for r in (0, 1):
        full, resumed = results[r]["full"], results[r]["resumed"]
        for s in range(7):
            want = round(0.5 * 0.02 ** (s / 4) * 2**30) / 2**30 if s < 4 else 0.01
            density, ks, xi, xi_step = full["steps"][s]
            assert density == pytest.approx(want, rel=1e-12), (r, s, density)
            assert ks == [math.ceil(density * n)], (r, s, ks)
            assert full["steps"][s] == results[1 - r]["full"]["steps"][s], f"ranks differ at step {s}"
            assert xi_step == s - s % 2 and 0 < xi < math.inf, (r, s, xi, xi_step)
        for s in range(3, 7):
            assert resumed["steps"][s][:2] == full["steps"][s][:2], f"rank {r}: resumed differs at step {s}"
        assert resumed["params"] == full["params"], f"rank {r}: resumed run's parameters differ"


def test_adaptive_density_and_tau_prime_alike_on_every_rank_and_resume_exactly(tmp_path):
    # density 2**-7, adaptive (2**-7, 2**-4, max_xi 1e-3), ξ every other
    # step: every measured ξ (k < n) is above 1e-3, so the density doubles
    # after steps 0, 2, 4 and then stays at 2**-4; τ′ starts at 8 and
    # follows the agreed drift by the rules.
    from oktopk.adaptive import DRIFT_HIGH, DRIFT_LOW

    results = horovodrun(2, "adaptive", str(tmp_path))
    n = results[0]["full"]["n"]  # one bucket holds the whole small model
    for r in (0, 1):
        full, resumed = results[r]["full"]["steps"], results[r]["resumed"]["steps"]
        tau_prime = 8
        for s in range(8):
            density, tp, ks, adaptations, (xi, drift) = full[s]
            assert density == 2.0 ** -(7 - min((s + 1) // 2, 3)), (r, s, density)
            assert ks == [math.ceil(density * n)], (r, s, ks)
            assert tp == tau_prime, (r, s, tp, tau_prime)
            assert adaptations == s // 2 + 1 and 1e-3 < xi < math.inf and 0 <= drift < math.inf, (r, s, full[s])
            if s % 2 == 0:
                tau_prime = max(1, tau_prime // 2) if drift > DRIFT_HIGH else min(8, 2 * tau_prime) if drift < DRIFT_LOW else tau_prime
            assert full[s] == results[1 - r]["full"]["steps"][s], f"ranks differ at step {s}"
        for s in range(5, 8):
            assert resumed[s] == full[s], f"rank {r}: resumed differs at step {s}"
        assert results[r]["resumed"]["params"] == results[r]["full"]["params"], f"rank {r}: resumed run's parameters differ"


def test_default_choice_alike_on_every_rank_keeps_mass_and_resumes(tmp_path):
    # Compression.oktopk()'s default: Horovod's allreduce or sparse, chosen
    # from step times that differ per rank (injected, workers.choice_cost):
    # after step 20 rank 0 alone would keep sparse and rank 1 alone would
    # not; the agreed (slowest) figures decide, alike on both.
    results = horovodrun(2, "choice", str(tmp_path))
    full = [results[r]["full"] for r in (0, 1)]
    assert full[0]["paths"] == full[1]["paths"] and full[0]["choice"] == full[1]["choice"]
    paths = [full[0]["paths"][s] for s in range(44)]
    # Probes (4 sparse, then 4 native: no warm-up step was timed), sparse
    # chosen at 8 (confirmed at 12) and again at 20, native at 32 (confirmed
    # at 36), a sparse probe at 40.
    assert paths == ["sparse"] * 4 + ["native"] * 4 + ["sparse"] * 8 + ["native"] * 4 + ["sparse"] * 8 + ["native"] * 12 + ["sparse"] * 4, paths
    assert sum(full[0]["counts"].values()) == 24 * 1 and not {"dense_ring", "dense_rabenseifner"} & set(full[0]["counts"])
    # Once native is chosen (step 32) the idle communicator is released; the
    # sparse probe at 40 makes a new one; while sparse was chosen, the native
    # probe (16-19, 28-31) kept it.
    for r in (0, 1):
        alive = [full[r]["alive"][s] for s in range(44)]
        assert alive == [True] * 32 + [False] * 8 + [True] * 4, alive
    # Mass: the local gradients summed over the ranks equal P x the averages
    # applied plus the residuals left, through every switch.
    for i in range(len(full[0]["local"])):
        local = full[0]["local"][i] + full[1]["local"][i]
        left = full[0]["residual"][i] + full[1]["residual"][i]
        lost = abs(local - 2 * full[0]["applied"][i] - left).sum() / abs(local).sum()
        assert lost <= 1e-5, f"parameter {i}: {lost:.3%} of its gradient mass lost"
    # Resumed after step 29 (inside the native probe of steps 28-31): the
    # same paths and decisions, and the same final model.
    # "auto" (the sparse path) chooses by the link it measured at its first
    # call: the communicator made again at 40, and the resumed run's, keep it.
    for r in (0, 1):
        links = full[r]["links"]
        assert links[0] is not None and None in links.values() and all(v in (None, links[0]) for v in links.values()), links
        assert links[40] == links[0] and all(results[r]["resumed"]["links"][s] == links[0] for s in (30, 40, 43)), results[r]["resumed"]["links"]
    for r in (0, 1):
        resumed = results[r]["resumed"]
        assert resumed["paths"] == {s: full[r]["paths"][s] for s in range(30, 44)}
        assert resumed["choice"]["decisions"] == full[r]["choice"]["decisions"] and resumed["params"] == full[r]["params"]


def test_default_under_adam_keeps_horovods_allreduce_and_a_named_algorithm_warns():
    # Sparse gradients under Adam ended far above dense in every
    # measurement (results/text.md): Compression.oktopk() keeps Horovod's
    # allreduce for every step, agreed before the first sparse probe, and
    # the model equals plain Horovod's bit for bit (the average over 2
    # ranks is exact either way). A named algorithm sends sparse, warning once.
    results = horovodrun(2, "adam_family")
    for r, res in results.items():
        assert res["paths"] == ["native"] * 12 and res["sparse_calls"] == 0, res["paths"]
        assert res["choice"]["kept_dense_for"] == "Adam" and res["equal_to_horovod"]
        assert res["early_checkpoint_tensors"] == 0  # saved before any sparse step, which no bucket state exists for
        assert len(res["warnings"]) == 1 and "Adam" in res["warnings"][0], res["warnings"]


def test_device_path_equals_staging_path_and_resumes_on_it(tmp_path):
    # The device path (selection and residual where the gradients are,
    # pairs across; forced on CPU gradients here) gives the staging path's
    # parameters and checkpoints bit for bit, with float16 values, and its
    # checkpoint resumes on the staging path.
    results = horovodrun(2, "device_path", str(tmp_path))
    for r, res in results.items():
        assert len(set(res["digests"])) == 1, f"rank {r}: {res['digests']}"
        assert res["same_checkpoint"], f"rank {r}: the library states differ"
        assert 0 < res["bytes"] <= 3 * 8 * res["pairs"], res


def test_demo_under_horovodrun_keeps_ranks_bitwise_identical_without_horovods_allreduce():
    results = horovodrun(2, "demo", 5)
    for r, res in results.items():
        assert res["digests"] == results[0]["digests"], f"rank {r} diverged"
        assert res["moved"] and res["steps"] == 5 and res["bytes_sent"] > 0
        assert res["horovod_reductions"] == 0, f"rank {r}: {res['horovod_reductions']} reductions went through Horovod"
        assert res["agreement_gathers"] == 4, f"rank {r}: the settings' agreement is one gather a step: {res}"


@pytest.mark.parametrize("nesterov", ["0", "1"])
def test_momentum_correction_at_density_one_equals_horovods_sgd_with_momentum(nesterov):
    # Each rank's velocity step is what is reduced; at density 1 their
    # average is the dense momentum, and the gradient handed to the
    # optimizer makes its own momentum (weight decay riding it) land on it:
    # plain Horovod's SGD within float32 rounding.
    results = horovodrun(2, "momentum_density_one", nesterov)
    for r, res in results.items():
        assert res["corrected"] == res["params"], f"rank {r}: {res}"
        assert res["worst"] <= 1e-5, f"rank {r}: {res['worst']}"
    assert results[0]["digest"] == results[1]["digest"]


@pytest.mark.parametrize("nesterov", ["0", "1"])
def test_a_native_step_with_nothing_held_is_plain_horovod_bitwise_and_corrects_nothing(nesterov):
    # Once the measured choice keeps native and a native step has folded
    # every residual in, a step's average is the gradients' own: the
    # correction hands it through (no pass over it), and the run goes on
    # as plain Horovod's SGD with momentum would from the same state, bit
    # for bit, momentum buffers included.
    results = horovodrun(2, "native_hands_through", nesterov)
    for r, res in results.items():
        assert "sparse" in res["paths"], f"rank {r}: the run never held a residual: {res['paths']}"
        assert res["same"] == [True] * 4, f"rank {r}: {res}"
        assert res["worked"] == [], f"rank {r}: the correction worked on native steps {res['worked']}"
    assert results[0]["params"] == results[1]["params"]


def test_oktopk_state_with_a_changed_field_is_refused_at_load():
    import horovod.torch as hvd
    import torch

    import oktopk_horovod

    hvd.init()  # a single process: size 1
    model = torch.nn.Linear(4, 2)
    opt = oktopk_horovod.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                              compression=oktopk_horovod.Compression.oktopk(algorithm="oktopk"))
    saved = opt.oktopk_state_dict()
    opt.load_oktopk_state_dict(dict(saved))  # intact: accepted
    for changed in (dict(saved, rank=1), dict(saved, step=9)):
        with pytest.raises(ValueError, match="fails its checksum"):
            opt.load_oktopk_state_dict(changed)
    # Signed again, so only the layout's version differs: refused, named.
    from oktopk.settings import with_checksum

    other = {k: v for k, v in saved.items() if k != "checksum"} | {"version": saved["version"] + 1}
    with pytest.raises(ValueError, match="oktopk_horovod checkpoint has layout version"):
        opt.load_oktopk_state_dict(with_checksum(other))
    opt.close()


def test_compression_carries_one_settings_object_and_refuses_what_horovod_cannot_honour():
    # Compression.oktopk builds the oktopk.Settings the DDP hook and FSDP2
    # run by: from its flat keywords, or given whole; a setting Horovod's
    # optimizer cannot honour is refused, saying why, never ignored.
    import oktopk
    import oktopk_horovod

    flat = oktopk_horovod.Compression.oktopk(density=0.05, algorithm="oktopk", tau_prime=8, momentum_correction=False)
    assert isinstance(flat.settings, oktopk.Settings)
    assert (flat.settings.density, flat.settings.algorithm, flat.settings.wire.tau_prime, flat.settings.momentum.correction) == \
        (0.05, "oktopk", 8, False)
    assert (flat.density, flat.tau_prime, flat.momentum_correction) == (0.05, 8, False)
    whole = oktopk_horovod.Compression.oktopk(settings=oktopk.Settings(density=0.05, algorithm="oktopk", wire=oktopk.Wire(tau_prime=8),
                                                                         momentum=oktopk.Momentum(correction=False)))
    assert whole.settings == flat.settings
    # No compressed dense path under Horovod: the default means Horovod's allreduce.
    assert oktopk_horovod.Compression.oktopk().settings.choice.dense_compression is None
    for settings, name in ((oktopk.Settings(warmup=oktopk.Warmup(iters=5)), "warmup_iters"),
                           (oktopk.Settings(choice=oktopk.Choice(dense_compression="bf16")), "dense_compression"),
                           (oktopk.Settings(momentum=oktopk.Momentum(masking="waited")), "momentum_masking"),
                           (oktopk.Settings(momentum=oktopk.Momentum(local_clip_norm=1.0)), "local_clip_norm"),
                           (oktopk.Settings(wire=oktopk.Wire(grads_as_bucket_views=False)), "grads_as_bucket_views")):
        with pytest.raises(ValueError, match=f"cannot honour: {name}="):
            oktopk_horovod.Compression.oktopk(settings=settings)
    with pytest.raises(ValueError, match="either settings= or the flat keywords"):
        oktopk_horovod.Compression.oktopk(density=0.05, settings=oktopk.Settings())


def test_an_oktopk_state_saved_by_the_previous_layout_loads():
    # The checkpoint layout Horovod's optimizer has always saved (version 1)
    # is the engine's fixed groups' layout: one saved before, signed, loads.
    import horovod.torch as hvd
    import torch

    import oktopk_horovod
    from oktopk.settings import with_checksum

    hvd.init()  # a single process: size 1
    model = torch.nn.Linear(4, 2)
    opt = oktopk_horovod.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                              named_parameters=model.named_parameters(), compression=oktopk_horovod.Compression.oktopk())
    # As the optimizer before the engine saved it: its fields, by name.
    earlier = with_checksum({"version": 1, "link": None, "rank": 0, "world_size": 1, "tensors": {}, "step": 7,
                             "density_schedule": None, "adaptive": None,
                             "choice": {**opt.engine.groups_state_dict()["choice"], "path": "native"},
                             "residual_ids": [], "momentum": opt.engine.groups_state_dict()["momentum"]})
    opt.load_oktopk_state_dict(earlier)
    assert opt.sparse_step == 7 and opt.engine.path == "native"
    assert set(opt.oktopk_state_dict()) == set(earlier)
    opt.close()
