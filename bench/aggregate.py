"""Combines bench/run.sh's repetitions: one row per (configuration,
algorithm) out of the BENCH_REPS rows that benchrank and gloo_allreduce.py
printed for it (one per repetition, each the medians over its timed calls).

Every column is the median over the repetitions, except: min_ms and max_ms
(the fastest and slowest call of any repetition), rep_min_ms and rep_max_ms
(the spread: the smallest and largest of the repetitions' medians), reps
(how many). Fails, naming them, when a (configuration, algorithm) has
another number of rows than --reps.

    python bench/aggregate.py --reps 3 RUNS_CSV >BENCH_CSV
"""

import argparse
import csv
import math
import statistics
import sys
from collections import defaultdict

KEY = ("algorithm", "P", "n", "density")
DROPPED = ("rep", "position")
INTEGER = {"k", "iters", "words_median", "words_mean", "words_reuse_mean", "formula_words", "lower_bound_words",
           "global_selected", "peak_rss_mib", "base_rss_mib"}


def fmt(column, v):
    if math.isnan(v):
        return "nan"
    if column in INTEGER:
        return f"{v:.0f}"
    if column == "rel_error":
        return f"{v:.3g}"
    if column == "reuse_over_lower_bound":
        return f"{v:.3f}"
    return f"{v:.2f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("runs")
    args = ap.parse_args()
    with open(args.runs) as f:
        reader = csv.DictReader(f)
        columns = reader.fieldnames
        groups = defaultdict(list)
        for row in reader:
            groups[tuple(row[c] for c in KEY)].append(row)
    bad = [f"{dict(zip(KEY, k))}: {len(rows)} rows" for k, rows in groups.items() if len(rows) != args.reps]
    if bad:
        sys.exit("aggregate.py: want %d rows (one per repetition) for each configuration and algorithm:\n  %s"
                 % (args.reps, "\n  ".join(bad)))
    out_cols = []
    for c in columns:
        if c in DROPPED:
            continue
        out_cols.append(c)
        if c == "density":
            out_cols.append("reps")
        if c == "median_ms":
            out_cols += ["rep_min_ms", "rep_max_ms"]
    w = csv.writer(sys.stdout, lineterminator="\n")
    w.writerow(out_cols)
    for key, rows in groups.items():  # first-seen order: the runs' order of configurations
        vals = lambda c: [float(r[c]) for r in rows]  # noqa: E731
        out = []
        for c in out_cols:
            if c in KEY:
                out.append(rows[0][c])
            elif c == "reps":
                out.append(str(len(rows)))
            elif c == "min_ms":
                out.append(fmt(c, min(vals(c))))
            elif c == "max_ms":
                out.append(fmt(c, max(vals(c))))
            elif c == "rep_min_ms":
                out.append(fmt(c, min(vals("median_ms"))))
            elif c == "rep_max_ms":
                out.append(fmt(c, max(vals("median_ms"))))
            else:
                v = vals(c)
                out.append(fmt(c, math.nan if any(math.isnan(x) for x in v) else statistics.median(v)))
        w.writerow(out)


if __name__ == "__main__":
    main()
