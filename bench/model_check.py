"""The step-time model (oktopk.plan) against every call and step time
measured on the emulated cluster (results/): writes results/model_check.csv,
one row per measured figure, predicted beside measured.

    PYTHONPATH=plugins/pytorch python bench/model_check.py [--write results/model_check.csv]

The emulated cluster is P ranks on one machine of 2 cores, each rank in its
own network namespace, its link limited by tc tbf in both directions at the
rate (bench/cluster.sh). As a plan.Cluster: one rank per node (every rank
has its own link); the wire is the link's, and hides under backward as
DDP's buckets allow (overlap 1: waiting on tbf costs the cores nothing);
the cores' work is paid in full (the ranks' computation, selection and
TCP stacks share the 2 cores), with contention c = max(1, P / 2)
multiplying it:

- time per byte on the wire: the tbf rate ÷ WIRE_EFFICIENCY (the library's
  own link measurements at 200 Mbit/s, results/bench.md's log: 43.9 ns/B
  median, 0.91 of the rate); latency LATENCY × c;
- on the cores, per byte sent HOST_SECONDS_PER_BYTE × c (the TCP stack and
  copies, which loopback shows alone) and a memory pass
  PASS_SECONDS_PER_BYTE × c.

The three host constants were fitted once to the 115 call times below
(the most calls within 15%), then left alone. Compute is calibrated, not
predicted:

- DDP matrix rows (results/ddp_matrix.csv): the same method's loopback step
  in the same matrix, which holds its compute and all its host work; the
  cluster is then the wire alone (no host constants: they are measured).
- training runs: the model's plain-DDP loopback step, loopback allreduce
  included (subtracting the model's own loopback allreduce leaves the
  MLPs a negative compute: the host constants fitted to the calls
  overstate a loopback step's), plus the host constants' work of the
  run's path.

At P = 8, where no loopback run exists, twice P = 4's (the same work per
rank on half the cores' share). The step rows' predictions are then not
fitted.
"""

import argparse
import csv
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "plugins", "pytorch"))

from oktopk import Warmup, choice, paths, plan  # noqa: E402
from oktopk.engine import warmup_path  # noqa: E402

CORES = 2
WIRE_EFFICIENCY = 0.91
HOST_SECONDS_PER_BYTE = 1e-9
LATENCY = 400e-6
PASS_SECONDS_PER_BYTE = 0.15e-9
RATES = {"200mbit": 200e6 / 8, "1gbit": 1e9 / 8, "loopback": math.inf}
RESULTS = os.path.join(ROOT, "results")

# Model sizes of the training runs (bench/ddp_e2e.py, bench/ddp_step.py).
# (The models' figures: params from their csv; the loopback DDP step that
# calibrates compute, file and value.)
LOOPBACK_DDP_MS = {  # (model, P) -> (ms, where)
    ("mlp17", 4): (399.3, "ddp_matrix.md, mlp 17.09M loopback plain DDP"),
    ("mlp4", 4): (106.9, "ddp_matrix.md, mlp 4.90M loopback plain DDP"),
    ("cnn", 4): (19.9, "ddp_matrix.md, cnn 0.10M loopback plain DDP"),
    ("charlm", 4): (331.7, "text_loopback.csv, plain DDP (median of text_loopback 331.7, "
                           "text_adam_default 293.8, text_loopback_long 401.1)"),
}


def emulated(P, link, compute=0.0, host_measured=False):
    """The emulated cluster of P ranks on ``link`` as a plan.Cluster. The
    wire is the link's; the cores' work (the TCP stacks and copies per byte,
    the passes) is the host's, shared by the P ranks and paid in full. With
    ``host_measured`` the host's work is in ``compute`` (a loopback step
    of the same method): the cluster is the wire alone."""
    c = max(1.0, P / CORES)
    rate = RATES[link]
    if host_measured:
        wire = plan.Link(rate * WIRE_EFFICIENCY, 0.0)
        return plan.Cluster(ranks=P, ranks_per_node=1, inter=wire, intra=wire, pass_seconds_per_byte=0.0,
                            compute_seconds=compute, overlap=1.0, shared_cores=True)
    lk = plan.Link(rate * WIRE_EFFICIENCY, LATENCY * c)
    return plan.Cluster(ranks=P, ranks_per_node=1, inter=lk, intra=lk, pass_seconds_per_byte=PASS_SECONDS_PER_BYTE * c,
                        compute_seconds=compute, overlap=1.0, host_seconds_per_byte=HOST_SECONDS_PER_BYTE * c,
                        shared_cores=True)


def model_key(params):
    return {99178: "cnn", 4900362: "mlp4", 17088522: "mlp17", 1890688: "charlm"}.get(params) or \
        ("mlp4" if abs(params - 4.9e6) < 1e5 else None)


def loopback_steps():
    """(params, method) -> the median over repeats of each method's
    loopback step in results/ddp_matrix.csv (ms): its compute and host work
    on this machine, with no link to wait for."""
    steps = {}
    for r in csv.DictReader(open(os.path.join(RESULTS, "ddp_matrix.csv"))):
        if r["link"] == "loopback" and r["P"] == "4":
            steps.setdefault((int(r["params"]), r["method"]), []).append(float(r["median_ms"]))
    return {key: statistics.median(v) for key, v in steps.items()}


LOOPBACK_STEPS = loopback_steps()


def matrix_host_seconds(n, method, path, P):
    """A DDP matrix row's compute and host work: the same method's loopback
    step in the matrix (the default hook on its sparse path: the hook with
    Ok-Topk fixed, which runs that path on loopback too); at P = 8 twice
    P = 4's, as compute_seconds."""
    source = "oktopk_oktopk" if (method, path) == ("oktopk", "oktopk") else method
    return LOOPBACK_STEPS[(n, source)] / 1e3 * from_p4(P)


def from_p4(P):
    """A P = 4 loopback step's factor at P ranks: the same work per rank on
    the cores' share, 1 / max(1, P / CORES) of them."""
    return max(1.0, P / CORES) / max(1.0, 4 / CORES)


def compute_seconds(model, P):
    ms, _ = LOOPBACK_DDP_MS[(model, 4)]
    return ms / 1e3 * from_p4(P)


def predict_call_row(r):
    """Predicted ms of a bench.csv row (one call, every rank timed)."""
    c = emulated(int(r["P"]), r["link"])
    alg = "dense_ring" if r["method"] == "torch_gloo_allreduce" else r["method"]
    s, _, _ = plan.predict_call(c, alg, int(r["n"]), density=float(r["density"]), tau=int(r["tau"]),
                                tau_prime=int(r["tau_prime"]))
    return s * 1e3


def path_step(c, path, n, density, powersgd_values, momentum_correction=False, rounding=None):
    kw = dict(density=density, momentum_correction=momentum_correction, rounding=rounding)
    if path == "powersgd":
        kw["powersgd_elements_total"] = powersgd_values
    return plan.step(c, path, n, **kw).seconds


# Every training run in this table was measured while a clear win was a
# probe at most half the timed warm-up step; oktopk.choice.CLEAR_WIN is 0.6
# since 2026-12-07. A run is modelled with the rule it ran under.
CLEAR_WIN_OF_THESE_RUNS = 0.5


def run_mean(steps, warmup_s, warmup, native, chosen_path_s, default_hook, candidate_s=None):
    """Mean step over a run of ``steps``: ``warmup`` warm-up steps taking
    ``warmup_s`` in all, then the method; the hook's defaults add their
    probes (oktopk.choice, under CLEAR_WIN_OF_THESE_RUNS)."""
    if not default_hook:
        return (warmup_s + (steps - warmup) * chosen_path_s) / steps
    cand = candidate_s
    t, s = warmup_s, warmup
    t, s = t + choice.PROBE_STEPS * cand, s + choice.PROBE_STEPS
    if cand > CLEAR_WIN_OF_THESE_RUNS * native:  # not a clear win: probe native too
        t, s = t + choice.PROBE_STEPS * native, s + choice.PROBE_STEPS
    chosen = cand if cand <= (1 - choice.DEFAULT_MARGIN) * native else native
    other = native if chosen is cand else cand
    rest = steps - s
    rechecks = rest // (choice.DEFAULT_RECHECK_EVERY + choice.PROBE_STEPS)
    t += rechecks * choice.PROBE_STEPS * other + (rest - rechecks * choice.PROBE_STEPS) * chosen
    return t / steps


# The step model's path for each path a warm-up step takes (oktopk.paths).
WARMUP_PATHS = {choice.NATIVE: "dense", choice.BF16: "bf16", choice.QUANTIZED: "quantized"}


def warmup_seconds(c, method, warmup, n, rounding=None):
    """The warm-up's ``warmup`` steps in all: native ones, or for a method
    ending ``_q`` (``warmup_compression="quantized"``) the paths
    ``oktopk.engine.warmup_path`` gives each step (DDP's first in bfloat16,
    its second native, the rest in 4 bits)."""
    settings = Warmup(iters=warmup, compression=choice.QUANTIZED if method.endswith("_q") else None)
    return sum(path_step(c, WARMUP_PATHS[warmup_path(settings, i)], n, 1.0, 0, rounding=rounding) for i in range(warmup))


def predict_step_row(r):
    """Predicted ms of a step row: ddp_matrix (steps after the choice) or a
    training run's mean step (ms_per_step, warm-up and probes included)."""
    P, n, density = int(r["P"]), int(r["n"]), float(r["density"])
    model = model_key(n)
    if r["kind"] == "step":
        c = emulated(P, r["link"], matrix_host_seconds(n, r["method"], r["path"], P), host_measured=True)
    else:
        c = emulated(P, r["link"], compute_seconds(model, P))
    path = r["path"]
    pv = float(r["powersgd_values"] or 0)
    rounding = "tensors" if r["source"] in TENSOR_ROUNDING_SOURCES else None
    chosen = path_step(c, path, n, density, pv, r.get("correction") == "1", rounding)
    if r["kind"] == "step":
        return chosen * 1e3
    native = path_step(c, "dense", n, 1.0, 0)
    warmup = int(r["warmup"])
    return run_mean(int(r["steps"]), warmup_seconds(c, r["method"], warmup, n, rounding), warmup, native, chosen,
                    r["default_hook"] == "1", chosen) * 1e3


def bench_rows():
    out = []
    for sub, link, tau, tau_prime in (("", "200mbit", 16, 8), ("auto/200mbit", "200mbit", 8, 4),
                                      ("auto/1gbit", "1gbit", 8, 4), ("auto/rerun/200mbit", "200mbit", 8, 4),
                                      ("auto/rerun/1gbit", "1gbit", 8, 4)):
        path = os.path.join(RESULTS, sub, "bench.csv")
        for r in csv.DictReader(open(path)):
            out.append(dict(kind="call", source=os.path.join("results", sub, "bench.csv"), model="synthetic",
                            P=r["P"], n=r["n"], link=link, method=r["algorithm"], path=r["algorithm"],
                            density=r["density"], tau=tau, tau_prime=tau_prime, steps="", warmup="",
                            default_hook="0", powersgd_values="", correction="0", measured_ms=float(r["median_ms"])))
    return out


def rabenseifner_rows():
    """The calls of results/rabenseifner_ab.csv measured with the current
    code (Rabenseifner after its first-piece wait, the ring and gloo in the
    same runs; results/bench.md)."""
    out = []
    for r in csv.DictReader(open(os.path.join(RESULTS, "rabenseifner_ab.csv"))):
        if r["code"] != "after":
            continue
        out.append(dict(kind="call", source=f"results/rabenseifner_ab.csv#{r['round']}", model="synthetic", P=r["P"],
                        n=r["n"], link="200mbit", method=r["algorithm"], path=r["algorithm"], density=r["density"],
                        tau=16, tau_prime=8, steps="", warmup="", default_hook="0", powersgd_values="", correction="0",
                        measured_ms=float(r["median_ms"])))
    return out


def ddp_matrix_rows():
    groups = {}
    for r in csv.DictReader(open(os.path.join(RESULTS, "ddp_matrix.csv"))):
        if r["link"] == "loopback":  # the loopback runs calibrate compute
            continue
        groups.setdefault((r["model"], r["params"], r["P"], r["link"], r["method"]), []).append(r)
    out = []
    for (model, params, P, link, method), rs in sorted(groups.items()):
        paths = {x["path"] for x in rs}
        path = {"ddp": "dense", "allreduce_hook": "dense", "oktopk_oktopk": "oktopk", "oktopk_topka": "topka"}.get(method)
        if method == "oktopk":  # the default hook: the path it ran after its choice
            if len(paths) != 1 or paths.pop() not in ("sparse", "native"):
                continue
            path = "oktopk" if {x["path"] for x in rs} == {"sparse"} else "dense"
        out.append(dict(kind="step", source="results/ddp_matrix.csv", model=model, P=P, n=params, link=link,
                        method=method, path=path, density="0.01", tau=64, tau_prime=32, steps="", warmup="",
                        default_hook="0", powersgd_values="", correction="0",
                        measured_ms=statistics.median(float(x["median_ms"]) for x in rs)))
    return out


# The training runs on the emulated cluster (results/bench.md names each
# run's link): file -> link.
RUNS = {"tta": "200mbit", "tta_200mbit_p4": "200mbit", "tta_200mbit_p4_rep2": "200mbit", "sgd_200mbit_p4": "200mbit",
        "sgd_200mbit_p4_rep2": "200mbit", "sgd_200mbit_p4_wmask": "200mbit", "sgd_200mbit_p4_wmask_rep2": "200mbit",
        "sgd_200mbit_p4_onepass": "200mbit", "sgd_200mbit_p4_onepass_rep2": "200mbit", "sgd_200mbit_p4_scratch": "200mbit",
        "sgd_200mbit_p4_scratch_rep2": "200mbit", "text": "200mbit", "text_rep2": "200mbit", "text_adam_bf16": "200mbit",
        "text_adam_quantized": "200mbit", "text_adam_quantized_rerun": "200mbit", "text_adam_rep2": "200mbit",
        "text_demo": "200mbit", "text_demo_rep2": "200mbit", "text_adam_quantized_same_run": "200mbit"}
# The results measured while the 4-bit path rounded with tensor operations
# on the CPU too (before the library's one-pass rounding): their 4-bit steps
# are priced with those passes (plan.QUANTIZED_PASSES).
TENSOR_ROUNDING_SOURCES = frozenset(f"results/{name}.csv" for name in RUNS) | {"results/ddp_matrix.csv"}
# The runs measured since the hook corrects SGD's momentum (oktopk.momentum):
# their sparse methods carry it, but for those ending _nomc.
CORRECTED_RUNS = frozenset(name for name in RUNS if name.startswith("sgd_200mbit"))


def run_rows():
    out = []
    for name, link in RUNS.items():
        for r in csv.DictReader(open(os.path.join(RESULTS, name + ".csv"))):
            m, P = r["method"], int(r["P"])
            adam = r["model"] == "charlm"
            default_hook = "0"
            if m == "ddp":
                path = "dense"
            elif m == "fp16":
                path = "bf16"
            elif m.startswith("powersgd"):
                path = "powersgd"
            elif m == "demo":
                path = "demo"
            elif m == "oktopk_quantized":
                path, default_hook = "quantized", "1"
            elif m == "oktopk" and adam and float(r["bytes_per_step"]) > 0.5 * int(r["params"]) * 4 * 2 * (P - 1) / P / 4:
                path, default_hook = "bf16", "1"  # the defaults under AdamW: bf16 measured against float32
            elif m == "oktopk_auto":
                path = "auto"
            elif m == "oktopk_sched":
                continue  # a density schedule: not a step model input
            elif m.startswith("oktopk"):
                path = "oktopk"
                default_hook = "1" if not adam else "0"
            else:
                continue
            pv = ""
            if path == "powersgd":
                pv = float(r["bytes_per_step"]) / (4 * 2 * (P - 1) / P)
            out.append(dict(kind="run", source=f"results/{name}.csv", model=r["model"], P=P, n=r["params"], link=link,
                            method=m, path=path, density=r["density"] if path not in ("dense", "bf16", "powersgd",
                                                                                      "quantized", "demo") else "0.01",
                            tau=64, tau_prime=32, steps=r["final_step"], warmup=r["warmup_steps"],
                            default_hook=default_hook, powersgd_values=pv,
                            correction="1" if (name in CORRECTED_RUNS and path == "oktopk" and not adam
                                               and not m.endswith("_nomc")) else "0",
                            measured_ms=float(r["ms_per_step"])))
    return out


FIELDS = ["kind", "source", "model", "P", "n", "link", "method", "path", "density", "tau", "tau_prime", "steps",
          "warmup", "default_hook", "powersgd_values", "correction", "measured_ms", "predicted_ms", "ratio"]


def predict(r):
    return predict_call_row(r) if r["kind"] == "call" else predict_step_row(r)


def table():
    rows = bench_rows() + rabenseifner_rows() + ddp_matrix_rows() + run_rows()
    out = []
    for r in rows:
        s = {k: ("" if v is None else str(v)) for k, v in r.items()}
        p = predict(s)
        s["measured_ms"] = f"{r['measured_ms']:.2f}"
        s["predicted_ms"] = f"{p:.2f}"
        s["ratio"] = f"{p / r['measured_ms']:.3f}"
        out.append(s)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", help="write the table here (results/model_check.csv)")
    args = ap.parse_args()
    rows = table()
    if args.write:
        with open(args.write, "w", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            w.writeheader()
            w.writerows(rows)
    for kind in ("call", "step", "run"):
        rs = [float(r["ratio"]) for r in rows if r["kind"] == kind]
        if rs:
            within = sum(abs(x - 1) <= 0.15 for x in rs)
            print(f"{kind}: {within} of {len(rs)} within 15%; ratio median {statistics.median(rs):.2f}, "
                  f"range {min(rs):.2f}-{max(rs):.2f}")
    rs = [float(r["ratio"]) for r in rows]
    print(f"all: {sum(abs(x - 1) <= 0.15 for x in rs)} of {len(rs)} within 15%")
    pairs, wrong = ordering(rows)
    print(f"ordering: of {pairs} pairs of rows of one table, model, P and link measured more than 15% apart, "
          f"the model orders {pairs - len(wrong)} as measured; inverted outside the call rows: "
          + (", ".join(f"{a} and {b} ({source})" for kind, source, a, b in wrong if kind != "call") or "none"))


def ordering(rows):
    """(pairs, the pairs ordered wrongly as (kind, source, method, method)):
    pairs of rows measured in one configuration (same table, model, P, n and
    link) more than 15% apart, which the plan and the hook's choice use the
    model to order."""
    groups = {}
    for r in rows:
        groups.setdefault((r["kind"], r["source"], r["model"], r["P"], r["n"], r["link"]), []).append(r)
    pairs, wrong = 0, []
    for key, rs in groups.items():
        for i, a in enumerate(rs):
            for b in rs[i + 1 :]:
                ma, mb = float(a["measured_ms"]), float(b["measured_ms"])
                if max(ma, mb) <= 1.15 * min(ma, mb):
                    continue
                pairs += 1
                if (ma < mb) != (float(a["predicted_ms"]) < float(b["predicted_ms"])):
                    wrong.append((key[0], key[1], a["method"], b["method"]))
    return pairs, wrong


if __name__ == "__main__":
    main()
