"""bench/frameworks_report.py OUT: the table of bench/frameworks.sh's runs
in OUT. For each model, method and order: the slowest rank's time of each
step after the hook's 2-step warm-up (a synchronous step waits for it), as
median, minimum and maximum, each rank's median, and the loss at the last
step (rank 0's). Markdown on standard output, the rows also in
OUT/frameworks.csv."""

import csv
import glob
import os
import re
import statistics
import sys

WARMUP = 2  # the hook's dense warm-up steps (oktopk's default), left out of both methods' times
STEP = re.compile(r"^rank (\d+) step (\d+)(?: loss ([\d.]+))? (\d+) ms$")
TRAINER_LOSS = re.compile(r"'loss': '?([\d.]+)'?")
ACCURACY = re.compile(r"^accuracy ([\d.]+) on (\d+) test images$")


def read(name):
    """{rank: {step: ms}}, rank 0's last loss, and the accuracy line, from
    the run's output (rank 0's standard output: NAME.out; each rank's
    standard error and the others' output: NAME.out.r<rank>.log)."""
    times, losses, accuracy = {}, [], None
    for path in [name + ".out", *sorted(glob.glob(name + ".out.r*.log"))]:
        for line in open(path, errors="replace"):
            line = line.strip()
            m = STEP.match(line)
            if m:
                rank, step, loss, ms = int(m[1]), int(m[2]), m[3], int(m[4])
                times.setdefault(rank, {})[step] = ms
                if rank == 0 and loss is not None:
                    losses.append(float(loss))
                continue
            m = TRAINER_LOSS.search(line)
            if m and "train_loss" not in line:
                losses.append(float(m[1]))
            m = ACCURACY.match(line)
            if m:
                accuracy = float(m[1])
    return times, (losses[-1] if losses else None), accuracy


def main(out):
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "*-*-*-first.out"))):
        name = path[: -len(".out")]
        model, method, order = os.path.basename(name).split("-", 2)
        times, loss, accuracy = read(name)
        if not times:
            continue
        steps = sorted(set.intersection(*(set(t) for t in times.values())))
        timed = [s for s in steps if s > WARMUP]
        slowest = [max(times[r][s] for r in times) for s in timed]
        if not slowest:
            continue
        rows.append({"model": model, "method": method, "order": order, "ranks": len(times), "steps_timed": len(timed),
                     "slowest_median_ms": statistics.median(slowest), "slowest_min_ms": min(slowest), "slowest_max_ms": max(slowest),
                     "rank_medians_ms": " ".join(str(round(statistics.median(times[r][s] for s in timed))) for r in sorted(times)),
                     "last_loss": "" if loss is None else f"{loss:.4f}", "accuracy": "" if accuracy is None else f"{accuracy:.2f}"})
    if not rows:
        sys.exit(f"no runs in {out}")
    with open(os.path.join(out, "frameworks.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("| model | order | method | slowest rank's step, median (min–max) ms | each rank's median ms | plain ÷ hook | loss at the last step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        plain = [p for p in rows if (p["model"], p["order"], p["method"]) == (r["model"], r["order"], "plain")]
        ratio = f"{plain[0]['slowest_median_ms'] / r['slowest_median_ms']:.2f}" if plain and r["method"] == "hook" else ""
        print(f"| {r['model']} | {r['order']} | {r['method']} | {r['slowest_median_ms']:.0f} ({r['slowest_min_ms']}–{r['slowest_max_ms']}) "
              f"| {r['rank_medians_ms']} | {ratio} | {r['last_loss']} |")


if __name__ == "__main__":
    main(sys.argv[1])
