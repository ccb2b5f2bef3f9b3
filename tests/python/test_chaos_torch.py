"""A fast slice of the PyTorch plugin's fault campaign (tests/chaos_torch/:
`make chaos-torch` runs it all, `make chaos-torch-smoke` the slice that
`make test` runs): the plan is seeded and covers every kind and setting,
the judge flags each way a job can fail, and four real faults (a mismatch,
a corrupted DeMo checkpoint, a NaN, a killed rank) over real gloo ranks
are caught as the plugin promises."""

import copy
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "chaos_torch"))

import campaign  # noqa: E402
import repro  # noqa: E402
from test_ddp import run  # noqa: E402


def assert_fixed(*cases):
    """The repro script's cases (tests/chaos_torch/repro.py) on 2 gloo ranks
    forked as the other tests' are: every case fixed on every rank."""
    results = run(repro.rank_results, 2, list(cases))
    for rank in (0, 1):
        for name, fixed, saw in results[rank]:
            assert fixed, f"{name} reproduced on rank {rank}: {saw}"
        assert [name for name, _, _ in results[rank]] == list(cases), results[rank]


def test_the_plan_is_seeded_replayable_and_covers_every_kind_and_setting():
    jobs = campaign.plan(7, 200)
    assert jobs == campaign.plan(7, 200)
    assert jobs != campaign.plan(8, 200)
    assert sum(len(j["faults"]) for j in jobs) >= 200
    assert {j["kind"] for j in jobs} == set(campaign.JOB_WEIGHTS)
    assert {j["setting"] for j in jobs if j["kind"] == "mismatch-setting"} == {name for name, _, _ in campaign.SETTINGS}
    assert {j["setting"] for j in jobs if j["kind"] == "mismatch-demo"} == {name for name, _ in campaign.DEMO_SETTINGS}
    assert all(j["world"] == 2 for j in jobs if j["kind"] == "resume")
    # A job replays alone: its spec is the same whatever else is selected.
    assert [j for j in jobs if j["id"] == 12] == [jobs[12]]
    smoke = campaign.smoke_plan(1)
    assert {j["kind"] for j in smoke} == set(campaign.JOB_WEIGHTS)


def _kill_job():
    return {"id": 0, "kind": "sigkill", "type": "fault_run", "world": 2, "faults": ["sigkill"], "cfg": {"front": "ddp", "state": {}},
            "fault": {"signal": "sigkill", "victim": 1, "step": 3, "delay": 0.0}}


def _run(results, **kw):
    run = {"results": results, "codes": [None, None], "fault_time": 100.0, "elapsed": 1.0, "hung": [], "eof": [], "victim": 1,
           "logs": [], "fault_landed": True}
    run.update(kw)
    return run


def test_the_judge_flags_hangs_silence_unnamed_errors_and_changed_state():
    mass = {"tensors": {"1": "a"}, "quantized": {}, "residual_groups": ["1"], "momentum": "m"}
    ok_error = {"type": "RuntimeError", "mro": ["OkTopkError", "RuntimeError"], "msg": "OkTopkError: oktopk: remote peer failed",
                "step": 3, "t": 100.5, "seconds": 0.5}
    survivor = {"error": ok_error, "failing_path": "sparse", "before_failure": {"mass": mass, "params": "p"},
                "after_failure": {"mass": mass, "params": "p"}}
    (o,), _ = campaign.judge(_kill_job(), _run({0: survivor}))
    assert not campaign.failed(o) and o["detection"] == 0.5
    (o,), _ = campaign.judge(_kill_job(), _run({0: dict(survivor, error=None)}))
    assert o["silent"], "a survivor that never noticed the dead peer"
    (o,), _ = campaign.judge(_kill_job(), _run({0: dict(survivor, error=dict(ok_error, msg="KeyError: 3", mro=["KeyError"]))}))
    assert o["unnamed"]
    moved = dict(mass, momentum="other")
    (o,), _ = campaign.judge(_kill_job(), _run({0: dict(survivor, after_failure={"mass": moved, "params": "p"})}))
    assert o["changed"], "velocities changed by a failed step"
    (o,), _ = campaign.judge(_kill_job(), _run({}, hung=[0]))
    assert o["hang"]

    nan = {"id": 1, "kind": "nan", "type": "fault_run", "world": 2, "faults": ["nan"], "cfg": {"front": "ddp", "state": {}},
           "inject": {"rank": 0, "step": 4, "value": "nan"}}
    rank = {"error": None, "finite": {"3": True, "4": False, "5": True}, "paths": {"4": "sparse"}, "mass_before": mass, "mass_after": mass,
            "params": "p", "inject_seconds": 0.01}
    (o,), _ = campaign.judge(nan, _run({0: rank, 1: rank}, victim=None))
    assert not campaign.failed(o)
    dropped = dict(mass, residual_groups=[])
    (o,), _ = campaign.judge(nan, _run({0: rank, 1: dict(rank, mass_after=dropped)}, victim=None))
    assert o["changed"], "a group no longer folded: its residual would be lost"
    (o,), _ = campaign.judge(nan, _run({0: rank, 1: dict(rank, finite={"3": True, "4": True, "5": True})}, victim=None))
    assert o["silent"], "the poisoned step was finite on one rank"
    (o,), _ = campaign.judge(nan, _run({0: rank, 1: dict(rank, params="q")}, victim=None))
    assert o["silent"]

    resume = {"id": 2, "kind": "resume", "type": "resume", "world": 2, "faults": ["resume"], "cuts": [5], "cfg": {"front": "ddp", "state": {}}}
    whole = {"params": "p", "mass": mass, "paths": {"5": "sparse", "6": "sparse"}}
    res = {"whole": whole, "choice_at": {}, "warmup": 2, "error": None,
           "resumed": {"5": {"error": None, "params": "p", "mass": mass, "paths": {"5": "sparse", "6": "sparse"}}}}
    (o,), _ = campaign.judge(resume, _run({0: res}, victim=None))
    assert not campaign.failed(o)
    other = copy.deepcopy(res)
    other["resumed"]["5"]["paths"]["6"] = "native"
    (o,), _ = campaign.judge(resume, _run({0: other}, victim=None))
    assert o["silent"]

    # An elastic job: rank 1 killed in step 7, checkpoints every 3 steps,
    # one restart, resumed after step 6.
    import subprocess

    elastic = {"id": 3, "kind": "elastic", "type": "elastic", "world": 2, "faults": ["elastic-kill"], "restarts": 1, "resumed": 6,
               "cfg": {"front": "elastic", "state": {"density": 0.05, "algorithm": "oktopk"}}}
    whole = {r: {"attempt": 0, "resumed": None, "params": f"p{r}", "bytes_sent": 9} for r in (0, 1)}
    resumed = {r: {"attempt": 1, "resumed": 6, "params": f"p{r}", "bytes_sent": 5} for r in (0, 1)}
    done = subprocess.CompletedProcess([], 0, "", "")

    def elastic_run(proc=done, ranks=resumed):
        return {"elastic": True, "proc": proc, "ranks": ranks, "whole": whole, "elapsed": 9.0}

    (o,), extra = campaign.judge(elastic, elastic_run())
    assert not campaign.failed(o) and extra == [("elastic seconds", 9.0)]
    (o,), _ = campaign.judge(elastic, elastic_run(proc=None, ranks={}))
    assert o["hang"], "no end within the bound"
    (o,), _ = campaign.judge(elastic, elastic_run(proc=subprocess.CompletedProcess([], 1, "", "agent gave up")))
    assert o["crash"]
    (o,), _ = campaign.judge(elastic, elastic_run(ranks={0: resumed[0]}))
    assert o["crash"], "a rank wrote no record"
    (o,), _ = campaign.judge(elastic, elastic_run(ranks={0: resumed[0], 1: dict(resumed[1], params="q")}))
    assert o["silent"], "parameters not the uninterrupted run's"
    (o,), _ = campaign.judge(elastic, elastic_run(ranks={r: dict(res, resumed=3) for r, res in resumed.items()}))
    assert o["silent"], "resumed from an older checkpoint than every rank saved"
    (o,), _ = campaign.judge(elastic, elastic_run(ranks={r: dict(res, attempt=2) for r, res in resumed.items()}))
    assert o["silent"], "restarted more often than the kills"


def test_a_slice_of_real_faults_is_caught(tmp_path):
    demo = {"front": "demo", "model": "small", "schedule": "none",
            "state": {"lr": 0.01, "weight_decay": 0.1, "topk": 8, "chunk": 16, "timeout": 2.0}}
    ddp = {"front": "ddp", "optimizer": "sgdm", "model": "small", "schedule": "none",
           "state": {"density": 0.05, "timeout": 2.0, "algorithm": "oktopk"}}
    jobs = [
        {"kind": "mismatch-setting", "type": "mismatch", "cfg": ddp, "setting": "density", "values": [0.05, 0.1], "steps": 3, "pg_timeout": 60.0,
         "faults": ["mismatch-setting"]},
        {"kind": "corrupt", "type": "corrupt", "cfg": demo, "steps": 4, "seed": 3, "corruptions": [{"how": "file"}, {"how": "field"}],
         "faults": ["corrupt-file", "corrupt-field"]},
        {"kind": "nan", "type": "fault_run", "cfg": ddp, "steps": 7, "inject": {"rank": 1, "step": 4, "value": "nan"}, "faults": ["nan"]},
        {"kind": "sigkill", "type": "fault_run", "cfg": ddp, "steps": 44, "progress": True, "faults": ["sigkill"],
         "fault": {"signal": "sigkill", "victim": 1, "step": 4, "delay": 0.01}},
    ]
    custom = tmp_path / "jobs.jsonl"
    custom.write_text("".join(json.dumps(dict(j, world=2, pg_timeout=j.get("pg_timeout", 3.0))) + "\n" for j in jobs))
    out = tmp_path / "report.md"
    code = campaign.main(["--custom", str(custom), "--out", str(out), "--logs", str(tmp_path / "logs")])
    report = out.read_text()
    assert code == 0, report
    for row in ("| sigkill | 1 | 0 | 0 | 0 | 0 | 0 |", "| nan | 1 | 0 | 0 | 0 | 0 | 0 |", "| mismatch-setting | 1 | 0 | 0 | 0 | 0 | 0 |",
                "| corrupt-file | 1 | 0 | 0 | 0 | 0 | 0 |", "| **total** | 5 | 0 | 0 | 0 | 0 | 0 |"):
        assert row in report, report


def test_a_checkpoint_can_be_taken_where_the_library_holds_no_state_yet():
    """The campaign's no-state finding, fixed: state_dict() after every
    step of a named dense algorithm, and after a NaN at the first sparse
    step (named algorithm and the measured choice), on 2 real gloo ranks."""
    assert_fixed("no-state")


def test_runs_resumed_in_the_warm_up_or_before_a_switch_to_native_take_the_whole_runs_paths_and_parameters():
    """The campaign's warmup-timing, warmup-adam and switch-fold findings,
    fixed, on 2 real gloo ranks: resumed from the end of the warm-up and
    from before its last step on a slow link, from the end of the warm-up
    under AdamW, and just before the switch from sparse to native that
    folds the residuals, the run takes the uninterrupted run's paths and
    ends with its parameters, bitwise."""
    assert_fixed("warmup-timing", "warmup-adam", "switch-fold")


def test_a_nan_in_one_ddp_bucket_leaves_every_residual_and_velocity_as_before_the_step():
    """The campaign's nan-one-group finding, fixed for the DDP hook, on 2
    real gloo ranks: a NaN in one bucket of several skips that bucket's
    call on every rank and the script skips the optimizer step; the other
    buckets' calls and velocity steps are taken back, so no library state
    and no velocity changes across the step (tests/python/
    test_nan_one_group.py checks it bitwise, with the run without the
    batch; test_fsdp.py and test_ddp.py check FSDP2's modules and the
    quantized path)."""
    assert_fixed("nan-one-group")
