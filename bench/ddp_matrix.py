"""Report make bench-ddp: from bench/ddp_step.py's ``step,`` rows (every
repeat), write OUTDIR/ddp_matrix.csv (the rows), OUTDIR/ddp_matrix.md (per
model, link and rank count: each method's median over the repeats of its
median slowest-rank step, with the repeats' range, and the default hook
against plain DDP and against the best of the fixed paths) and replace the
section of OUTDIR/bench.md.

    python bench/ddp_matrix.py ROWS OUTDIR
"""

import csv
import os
import re
import statistics
import sys

from ddp_step import HEADER

SECTION = "## DDP step matrix (make bench-ddp)"
COMMAND = "make bench-ddp  (bench/ddp_matrix.sh: bench/ddp_step.py on bench/cluster.sh, repeats in shuffled order)"
LINK_ORDER = {"loopback": 0, "1gbit": 1, "200mbit": 2}


def read_rows(path):
    rows = []
    with open(path) as f:
        for line in f:
            if line.startswith("step,"):
                rows.append(dict(zip(HEADER.split(","), line.strip().split(",")[1:])))
    return rows


def run_steps(ddp_row):
    """A run's steps, from plain DDP's row (every step native): the
    default hook's rows count native and sparse steps only, not those of
    its other paths (the 4-bit early steps)."""
    return int(ddp_row["native_steps"]) + int(ddp_row["sparse_steps"])


def table(rows):
    configs = {}
    for r in rows:
        configs.setdefault((r["model"], int(r["params"]), int(r["P"]), r["link"]), {}).setdefault(r["method"], []).append(r)
    lines = [
        "| model | params | P | link | repeats | plain DDP ms | default hook ms | ×DDP | best fixed path | ×best | hook chose | explored | bytes/step vs DDP | others (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for (model, params, p, link), methods in sorted(configs.items(), key=lambda kv: (kv[0][2], LINK_ORDER.get(kv[0][3], 9), kv[0][1])):
        med = {m: statistics.median(float(r["median_ms"]) for r in rs) for m, rs in methods.items()}
        spread = {m: (min(float(r["median_ms"]) for r in rs), max(float(r["median_ms"]) for r in rs)) for m, rs in methods.items()}
        if "ddp" not in med or "oktopk" not in med:
            continue
        fixed = {m: v for m, v in med.items() if m == "ddp" or m.startswith("oktopk_")}
        best = min(fixed, key=fixed.get)
        chose = sorted({r["path"] for r in methods["oktopk"]})
        explored = statistics.median(int(r["explored_steps"]) for r in methods["oktopk"])
        steps = run_steps(methods["ddp"][0])
        bytes_ratio = statistics.median(float(r["bytes_per_step"]) for r in methods["oktopk"]) / statistics.median(
            float(r["bytes_per_step"]) for r in methods["ddp"])
        others = ", ".join(f"{m} {med[m]:.1f} [{spread[m][0]:.1f}–{spread[m][1]:.1f}]" for m in sorted(med) if m not in ("ddp", "oktopk"))

        def cell(m):
            return f"{med[m]:.1f} [{spread[m][0]:.1f}–{spread[m][1]:.1f}]"

        lines.append(
            f"| {model} | {params / 1e6:.2f}M | {p} | {link} | {len(methods['oktopk'])} | {cell('ddp')} | {cell('oktopk')} | {med['oktopk'] / med['ddp']:.2f} | "
            f"{best} {med[best]:.1f} | {med['oktopk'] / med[best]:.2f} | {'/'.join(chose)} | {explored:.0f} of {steps} | "
            f"{bytes_ratio:.3f} | {others} |"
        )
        summary.append((model, params, p, link, med["ddp"], med["oktopk"], best, med[best]))
    return lines, summary


def main():
    rows_path, outdir = sys.argv[1], sys.argv[2]
    rows = read_rows(rows_path)
    if not rows:
        raise SystemExit(f"ddp_matrix.py: no step rows in {rows_path}")
    with open(os.path.join(outdir, "ddp_matrix.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=HEADER.split(","))
        w.writeheader()
        w.writerows(rows)
    lines, _ = table(rows)
    # Which steps each link's medians cover (a matrix can merge runs).
    windows = {}
    for r in rows:
        if r["method"] == "ddp":
            windows.setdefault((int(r.get("skip") or 12), run_steps(r)), set()).add(r["link"])  # rows written before the column: 12
    window = "; ".join(f"steps {skip}-{steps} of {steps}" + (f" ({', '.join(sorted(links))})" if len(windows) > 1 else "")
                       for (skip, steps), links in sorted(windows.items()))
    text = "\n".join([
        SECTION,
        "",
        f"Per configuration, each method's median over the repeats (their number in the repeats column) of its median slowest-rank step (ms, {window}: "
        "after the warm-up, the default hook's first probes and the confirmation of a switch), with the repeats' range in brackets. ×DDP: the default hook's step over plain "
        "DDP's; ×best: over the fastest of plain DDP and the fixed sparse algorithms. Explored: the default hook's steps on the path it "
        "did not choose (its first probe; with recheck_every=200 the next probe is past these steps). Bytes/step: what one rank sent "
        "per step over the whole run (warm-up and probes included), over plain DDP's. P ranks share 2 cores.",
        "",
        f"Command: `{COMMAND}`",
        "",
        *lines,
        "",
    ])
    with open(os.path.join(outdir, "ddp_matrix.md"), "w") as f:
        f.write(text)
    bench = os.path.join(outdir, "bench.md")
    old = open(bench).read() if os.path.exists(bench) else ""
    pattern = re.compile(re.escape(SECTION) + r".*?(?=\n## |\Z)", re.S)
    new = pattern.sub(lambda _: text.rstrip("\n") + "\n", old) if SECTION in old else old.rstrip("\n") + "\n\n" + text
    with open(bench, "w") as f:
        f.write(new)
    print(text)


if __name__ == "__main__":
    main()
