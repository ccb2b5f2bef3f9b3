"""The same bits before and after a change of the plugin: record, per step,
the digests of every rank's gradients, parameters and gradient mass
(residuals, thresholds, quantized residuals, velocities, DeMo's momentum)
over a fixed set of runs, then compare two recordings.

    python tests/chaos_torch/bits.py record before.json     # on the old code
    python tests/chaos_torch/bits.py record after.json      # on the new code
    python tests/chaos_torch/bits.py compare before.json after.json

The runs (2 ranks, gloo, the fault campaign's worker and models): DDP with
SGD under a named algorithm and under the measured choice; SGD with
momentum (the correction) with "waited" masking; AdamW on bf16 and on the
4-bit path; FSDP2 over replicas (the campaign's HSDP: each rank its own
shard group, the hook across the replicas) under SGD with momentum and
under AdamW's 4-bit path; DeMo; and resumes cut in the warm-up, in a probe,
before a switch of path and on a steady path, whose resumed runs' final
digests are recorded too. The measured choice's runs follow the
campaign's steered schedules (each path's steps slowed by plain sleeps),
so every decision is the same on every recording. Horovod is not among
them (its own virtualenv and launcher).

``compare`` names, per run, the first step and rank where a digest differs
and exits 1 if any does. A recording compared with itself made twice on
the same code is the check that the runs are deterministic.
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import campaign  # noqa: E402

T = campaign.PLUGIN_TIMEOUT


def _ddp(optimizer, schedule="none", **state):
    return {"front": "ddp", "optimizer": optimizer, "model": "small", "schedule": schedule,
            "state": {"density": 0.05, "timeout": T, **state}}


def _fsdp(optimizer, schedule="none", **state):
    return dict(_ddp(optimizer, schedule, **state), front="fsdp")


DEMO = {"front": "demo", "model": "small", "schedule": "none",
        "state": {"lr": 0.01, "weight_decay": 0.1, "topk": 8, "chunk": 16, "timeout": T}}

# name -> (config, steps). The measured choice's schedules take 38
# (sparse-then-native) or 26 (native-then-candidate) steps after the warm-up.
RUNS = {
    "ddp-sgd-oktopk": (_ddp("sgd", algorithm="oktopk", tau=2, tau_prime=3), 10),
    "ddp-sgd-choice": (_ddp("sgd", "sparse-then-native", recheck_every=8), 40),
    "ddp-sgdm-waited-masking": (_ddp("sgdm", algorithm="oktopk", momentum_masking="waited"), 10),
    "ddp-sgdm-choice": (_ddp("sgdm", "native-then-candidate", recheck_every=8), 28),
    "ddp-adamw-bf16": (_ddp("adamw", "sparse-then-native", recheck_every=8, dense_compression="bf16"), 40),
    "ddp-adamw-quantized": (_ddp("adamw", "sparse-then-native", recheck_every=8, dense_compression="quantized"), 40),
    "hsdp-sgdm-oktopk": (_fsdp("sgdm", algorithm="oktopk"), 10),
    "hsdp-adamw-quantized": (_fsdp("adamw", "sparse-then-native", recheck_every=8, dense_compression="quantized"), 40),
    "demo": (DEMO, 8),
}
# name -> (run, cuts): a checkpoint after each cut's step, loaded into a
# fresh run that goes on to the end. The choice's: in the warm-up, in the
# sparse probe, before the switch to native (s 20, which folds the
# residuals) and on the steady native path.
RESUMES = {
    "resume-ddp-sgdm-choice": ("ddp-sgdm-choice", [1, 5, 14]),
    "resume-ddp-sgd-choice": ("ddp-sgd-choice", [3, 22, 30]),
    "resume-ddp-adamw-quantized": ("ddp-adamw-quantized", [1, 4, 22]),
    "resume-hsdp-sgdm-oktopk": ("hsdp-sgdm-oktopk", [3, 7]),
    "resume-demo": ("demo", [2, 5]),
}


def jobs():
    out = []
    for name, (cfg, steps) in RUNS.items():
        out.append((name, {"kind": "record", "type": "record", "cfg": cfg, "steps": steps, "faults": []}))
    for name, (run, cuts) in RESUMES.items():
        cfg, steps = RUNS[run]
        out.append((name, {"kind": "resume", "type": "resume", "cfg": cfg, "steps": steps, "cuts": cuts, "faults": []}))
    for n, (_, job) in enumerate(out):
        job.update(id=n, world=2, pg_timeout=campaign.PG_TIMEOUT)
    return out


def _digests(result):
    """What a run's result holds to compare: per step for a record, the
    whole run's and each resumed run's end for a resume."""
    if "steps" in result:
        return result["steps"]
    return {"whole": {k: result["whole"].get(k) for k in ("params", "mass", "paths")},
            "resumed": {cut: {k: r.get(k) for k in ("params", "mass", "paths", "error")} for cut, r in result["resumed"].items()}}


def record(path, python):
    logs = tempfile.mkdtemp(prefix="oktopk-bits-")
    sessions = campaign.Sessions(python, logs, tempfile.mkdtemp(prefix="oktopk-bits-work-"))
    recorded, failed = {}, []
    try:
        for name, job in jobs():
            run = campaign.run_job(sessions, job)
            results = run.get("results", {})
            errors = [res.get("harness_error") or (res.get("error") or {}).get("msg") for res in results.values()]
            if run.get("harness") or len(results) < 2 or any(errors):
                failed.append(f"{name}: {run.get('harness') or errors or run.get('codes')} (logs {logs})")
            recorded[name] = {str(r): _digests(res) for r, res in sorted(results.items()) if "harness_error" not in res}
            print(f"{name}: recorded", flush=True)
    finally:
        sessions.close()
    with open(path, "w") as f:
        json.dump(recorded, f, indent=1, sort_keys=True)
    for line in failed:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


def first_difference(a, b):
    """The first place two recordings of one run differ: (where, a's, b's),
    or None."""
    for rank in sorted(set(a) | set(b)):
        ra, rb = a.get(rank), b.get(rank)
        if isinstance(ra, list) and isinstance(rb, list):
            for step, (sa, sb) in enumerate(zip(ra, rb)):
                for key in sorted(set(sa) | set(sb)):
                    if sa.get(key) != sb.get(key):
                        return f"rank {rank}, step {step}, {key}", sa.get(key), sb.get(key)
            if len(ra) != len(rb):
                return f"rank {rank}, steps", len(ra), len(rb)
        elif ra != rb:
            return f"rank {rank}", ra, rb
    return None


def compare(path_a, path_b):
    a, b = (json.load(open(p)) for p in (path_a, path_b))
    differ = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {path_a if name in a else path_b}")
            differ += 1
            continue
        found = first_difference(a[name], b[name])
        if found is None:
            print(f"{name}: the same bits")
        else:
            differ += 1
            where, x, y = found
            print(f"{name}: differs first at {where}: {str(x)[:120]} against {str(y)[:120]}")
    print(f"{len(set(a) | set(b)) - differ} of {len(set(a) | set(b))} runs the same bits")
    return 1 if differ else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("record", help="run every recorded run and write the digests")
    r.add_argument("out")
    r.add_argument("--python", default=sys.executable)
    c = sub.add_parser("compare", help="compare two recordings")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args(argv)
    if args.what == "record":
        return record(args.out, args.python)
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
