"""The time-to-accuracy report, from rank 0's output of bench/ddp_e2e.py
(every method's ``row,`` and ``curve,`` lines): OUTDIR/NAME.csv (a row per
method), OUTDIR/NAME_curve.csv (every evaluation) and a markdown table in
OUTDIR/bench.md, replacing the one an earlier run with the same NAME put
there (NAME: ``--name``, ``tta`` by default). Fails, naming
what is wrong, unless there is exactly one row per method asked for with
every field a number (only the to-target columns may be nan, for a method
that never reached the target; with --strict none may).

    python bench/tta_report.py [--strict] [--sched-steps N] [--name NAME] --methods "ddp fp16 ..." ROWS OUTDIR
"""

import argparse
import math
import os
import sys

# The lines bench/ddp_e2e.py's rank 0 prints, after "row," and "curve,".
HEADER = (
    "method,model,P,params,density,warmup_steps,steps,batch_per_rank,lr,target,eval_every,"
    "time_to_target_s,steps_to_target,train_s,final_step,final_accuracy,final_loss,ms_per_step,bytes_per_step,run_bytes"
)
CURVE_HEADER = "method,step,train_s,accuracy,loss"
TITLE = "## Time to accuracy"
NAN_OK = ("time_to_target_s", "steps_to_target")
NAMES = {
    "ddp": "plain DDP (gloo allreduce)",
    "fp16": "fp16_compress_hook",
    "powersgd1": "powerSGD_hook, rank 1",
    "powersgd4": "powerSGD_hook, rank 4",
    "oktopk": "oktopk_hook, defaults (density {density}, the measured choice)",
    "oktopk_nomc": "oktopk_hook, defaults but momentum_correction=False",
    "oktopk_auto": 'oktopk_hook, density {density}, algorithm="auto"',
    "oktopk_sched": "oktopk_hook, density {density}, density_schedule=(0.25, {sched})",
    "oktopk_quantized": 'oktopk_hook, the measured choice, dense_compression="quantized"',
    "oktopk_float32": "oktopk_hook, the measured choice, dense_compression=None",
    "oktopk_forced_bf16": "oktopk_hook, every step after DDP's first two in bfloat16 (forced: warmup_compression=\"bf16\")",
    "oktopk_forced_quantized": "oktopk_hook, every step after DDP's first two in 4 bits (forced: warmup_compression=\"quantized\")",
    "oktopk_nosparse": "oktopk_hook, the measured choice, sparse=False",
    "oktopk_sparse_first": "oktopk_hook, the measured choice, sparse_after=0 (sparse from the first step)",
    "oktopk_tensor_rounding": "oktopk_hook, defaults, the 4-bit path rounding as tensor operations (before the library's one-pass rounding)",
    "demo": "oktopk.optim.DeMo (its exchange over Ok-Topk, no gradient allreduce)",
}


def method_name(method):
    """The table's name of a method (oktopk_wN: N dense warm-up steps;
    oktopk_dN: density N%; ..._nomc: momentum_correction=False)."""
    if method.endswith("_nomc") and method != "oktopk_nomc":
        return method_name(method[: -len("_nomc")]) + ", momentum_correction=False"
    if method.startswith("oktopk_w") and method[len("oktopk_w"):].isdigit():
        return "oktopk_hook, density {density}, warmup_iters=" + method[len("oktopk_w"):]
    if method.startswith("oktopk_d") and method[len("oktopk_d"):].isdigit():
        return NAMES["oktopk"]
    if method.startswith("demo_"):
        return NAMES["demo"] + f', value_dtype="{method[len("demo_"):]}"'
    if method not in NAMES and method.startswith("oktopk_"):
        return "oktopk_hook, density {density}" + f', algorithm="{method[len("oktopk_"):]}"'
    return NAMES[method]


# What each model is trained on and how, for the table's caption.
TRAINING = {
    "charlm": "on real English text (Debian's fortunes; every tenth fortune held out), {batch} windows of bytes per rank per step, "
    "AdamW (peak learning rate {lr}, weight decay 0.01, linear warm-up, cosine decay, gradients clipped to norm 1)",
    "fashion": "on Fashion-MNIST (Debian's dataset-fashion-mnist; its 10,000 test images held out), {batch} images per rank per step, "
    "SGD (momentum 0.9, peak learning rate {lr}, linear warm-up, cosine decay)",
}
DIGITS = "on the digits data, {batch} images per rank per step, SGD (learning rate {lr}, momentum 0.9)"
METRIC = {"charlm": ("held-out loss", "{target} nats per byte or below", "next-byte accuracy %")}
ACCURACY = ("held-out accuracy", "{target}%", "final accuracy %")
COMMAND = {"charlm": "make bench-text", "fashion": "make bench-images"}


def number(s):
    try:
        return float(s)
    except ValueError:
        return None


def check(rows, methods, strict):
    """The rows by method; SystemExit naming the problem otherwise."""
    cols = HEADER.split(",")
    problems, by_method = [], {}
    for fields in rows:
        if len(fields) != len(cols):
            problems.append(f"{fields[0]}: {len(fields)} fields, the header has {len(cols)}")
            continue
        rec = dict(zip(cols, fields))
        for name in cols[2:]:
            v = number(rec[name])
            if v is None or math.isinf(v) or (math.isnan(v) and (strict or name not in NAN_OK)):
                problems.append(f"{rec['method']}: {name} is not a number: {rec[name]!r}")
        if rec["method"] in by_method:
            problems.append(f"{rec['method']}: more than one row")
        by_method[rec["method"]] = rec
    for m in methods:
        if m not in by_method:
            problems.append(f"{m}: no row (the rank logs beside the rows file say why)")
    if problems:
        raise SystemExit("tta_report.py: " + "; ".join(problems))
    return [by_method[m] for m in methods]


def mb(x):
    return f"{float(x) / 1e6:.3f}" if not math.isnan(float(x)) else "nan"


def title(name):
    """The start of the bench.md section of a report named ``name``."""
    return f"{TITLE}: DDP training" if name == "tta" else f"{TITLE}: {name}, DDP training"


def table(recs, sched_steps, mode, rate, name="tta"):
    first = recs[0]
    base = next((float(r["time_to_target_s"]) for r in recs if r["method"] == "ddp"), float("nan"))
    training = TRAINING.get(first["model"], DIGITS).format(batch=first["batch_per_rank"], lr=first["lr"])
    metric, target, accuracy = METRIC.get(first["model"], ACCURACY)
    out = [
        f"{title(name)}, P = {first['P']}, {mode if mode == 'loopback' else f'{mode} ({rate})'}",
        "",
        f"Model {first['model']} ({first['params']} parameters) {training}, the same seed, initialization and data order for every "
        f"method; {metric} evaluated on rank 0 every {first['eval_every']} steps, outside the timed region; budget {first['steps']} steps, "
        f"target {target.format(target=first['target'])} (bench/ddp_e2e.py, `{COMMAND.get(first['model'], 'make bench-e2e')}`). Seconds are training time only, to the first "
        "evaluation that reaches the target; bytes are what one rank sends per step once the method compresses (oktopk: "
        "the library's count; the others: the ring allreduce formula over what they reduce), after its dense warm-up "
        "steps. Every rank shares the machine's cores, so seconds compare methods with each other, not with a cluster.",
        "",
        f"| method | s to target | steps to target | × faster than plain DDP | {accuracy} | final held-out loss | ms per step | MB per step per rank | dense warm-up steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        t = float(r["time_to_target_s"])
        reached = not math.isnan(t)
        speedup = f"{base / t:.1f}" if reached and not math.isnan(base) and t > 0 else "–"
        name = method_name(r["method"]).format(density=r["density"], sched=sched_steps)
        at = "" if int(r["final_step"]) == int(r["steps"]) else f" (step {r['final_step']})"
        out.append(
            f"| {name} | {t:.1f} | {r['steps_to_target']} | {speedup} | {r['final_accuracy']}{at} | {r['final_loss']} | "
            f"{r['ms_per_step']} | {mb(r['bytes_per_step'])} | {r['warmup_steps']} |"
            if reached
            else f"| {name} | not reached | – | – | {r['final_accuracy']}{at} | {r['final_loss']} | {r['ms_per_step']} | "
            f"{mb(r['bytes_per_step'])} | {r['warmup_steps']} |"
        )
    return "\n".join(out) + "\n"


def replace_section(path, section, name="tta"):
    """bench.md with this section in place of an earlier one of the same
    name (or appended)."""
    text = open(path).read() if os.path.exists(path) else ""
    at = text.find("\n" + title(name))
    if at >= 0:
        end = text.find("\n## ", at + 1)
        text = text[:at] + (text[end:] if end >= 0 else "\n")
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n\n" + section if text.strip() else section)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", required=True)
    ap.add_argument("--strict", action="store_true")
    ap.add_argument("--sched-steps", default="50", help="oktopk_sched's decay steps, for its name")
    ap.add_argument("--name", default="tta", help="the files' stem and the section's name")
    ap.add_argument("rows")
    ap.add_argument("outdir")
    args = ap.parse_args()
    methods = args.methods.split()
    rows, curve = [], []
    with open(args.rows) as f:
        for line in f:
            kind, _, rest = line.strip().partition(",")
            if kind == "row":
                rows.append(rest.split(","))
            elif kind == "curve":
                curve.append(rest)
    recs = check(rows, methods, args.strict)
    os.makedirs(args.outdir, exist_ok=True)
    with open(os.path.join(args.outdir, f"{args.name}.csv"), "w") as f:
        f.write(HEADER + "\n")
        for r in recs:
            f.write(",".join(r[c] for c in HEADER.split(",")) + "\n")
    with open(os.path.join(args.outdir, f"{args.name}_curve.csv"), "w") as f:
        f.write(CURVE_HEADER + "\n" + "".join(c + "\n" for c in curve))
    mode, rate = os.environ.get("BENCH_MODE", "netns"), os.environ.get("BENCH_RATE", "200mbit")
    replace_section(os.path.join(args.outdir, "bench.md"), table(recs, args.sched_steps, mode, rate, args.name), args.name)
    print(f"tta_report.py: {len(recs)} methods, all numeric; wrote {args.outdir}/{args.name}.csv, {args.name}_curve.csv and bench.md",
          file=sys.stderr)


if __name__ == "__main__":
    main()
