"""The benchmark's plots, from bench/run.sh's CSV:

- time_vs_p.png: median time per call of every algorithm against P, one
  panel per (n, density), log scale;
- volume_vs_p.png: measured words per rank (mean over the reuse calls)
  against P for the sparse algorithms, with their formulas (dashed) and the
  lower bound 2k(P−1)/P (black), one panel per (n, density);
- with --tta, tta.png from bench/ddp_e2e.sh's curve CSV: held-out accuracy
  against training seconds, one line per method, the target dashed.

    python bench/plot.py results/bench.csv results
    python bench/plot.py --tta results/tta_curve.csv results/tta.png [TARGET]
    python bench/plot.py --tta-loss results/text_curve.csv results/text.png [TARGET]
    python bench/plot.py --adam-sim results/adam_sim.csv results/adam_sim.png
"""

import csv
import math
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def panels(rows):
    """(n, density) → algorithm → sorted [(P, row)]."""
    out = defaultdict(lambda: defaultdict(list))
    for r in rows:
        out[(int(r["n"]), float(r["density"]))][r["algorithm"]].append((int(r["P"]), r))
    for by_alg in out.values():
        for series in by_alg.values():
            series.sort(key=lambda t: t[0])
    return dict(sorted(out.items()))


def grid(count):
    cols = min(count, 2)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, axes.flat


def legend_below(fig, ax):
    """One legend for every panel, under them, so it hides no data."""
    handles, labels = ax.get_legend_handles_labels()
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)


def style(alg):
    if alg == "oktopk":
        return {"color": "tab:red", "linewidth": 2.5, "marker": "o", "zorder": 5}
    if alg == "torch_gloo_allreduce":
        return {"color": "black", "linewidth": 2, "marker": "s"}
    return {"marker": ".", "linewidth": 1.2}


def time_vs_p(data, out):
    fig, axes = grid(len(data))
    for ax, ((n, d), by_alg) in zip(axes, data.items()):
        for alg, series in by_alg.items():
            ax.plot([p for p, _ in series], [float(r["median_ms"]) for _, r in series], label=alg, **style(alg))
        ax.set(title=f"n = 2^{int(math.log2(n))}, density {d:g}", xlabel="P (ranks)", ylabel="median ms per allreduce", yscale="log")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
    legend_below(fig, axes[0])
    fig.savefig(out, dpi=110)
    plt.close(fig)


FORMULA_SHOWN = ("oktopk", "topka", "gtopk", "ssar_split_allgather", "gaussiank")


def volume_vs_p(data, out):
    fig, axes = grid(len(data))
    for ax, ((n, d), by_alg) in zip(axes, data.items()):
        colors = {}
        for alg, series in by_alg.items():
            if alg.startswith("dense") or alg == "torch_gloo_allreduce":
                continue
            ps = [p for p, _ in series]
            (line,) = ax.plot(ps, [float(r["words_reuse_mean"]) for _, r in series], label=f"{alg} (measured)", **style(alg))
            colors[alg] = line.get_color()
            if alg in FORMULA_SHOWN:
                ax.plot(ps, [float(r["formula_words"]) for _, r in series], linestyle="--", color=colors[alg], alpha=0.6, linewidth=1)
        ps = sorted({p for series in by_alg.values() for p, _ in series})
        k = math.ceil(n * d)
        ax.plot(ps, [2 * k * (p - 1) / p for p in ps], color="black", linewidth=2, marker="_", markersize=14, label="lower bound 2k(P−1)/P")
        ax.plot(ps, [4 * k * (p - 1) / p for p in ps], color="gray", linestyle=":", marker="_", markersize=14, label="target 4k(P−1)/P")
        ax.set(title=f"n = 2^{int(math.log2(n))}, density {d:g} (dashed: formulas)", xlabel="P (ranks)", ylabel="words sent per rank per call", yscale="log")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
    legend_below(fig, axes[0])
    fig.savefig(out, dpi=110)
    plt.close(fig)


TTA_STYLE = {
    "ddp": {"color": "black", "linewidth": 2},
    "fp16": {"color": "tab:gray", "linewidth": 1.4},
    "powersgd1": {"color": "tab:blue", "linewidth": 1.4},
    "powersgd4": {"color": "tab:cyan", "linewidth": 1.4},
    "oktopk": {"color": "tab:red", "linewidth": 2.5, "zorder": 5},
    "oktopk_auto": {"color": "tab:orange", "linewidth": 1.6},
    "oktopk_sched": {"color": "tab:purple", "linewidth": 1.6},
}


WARMUP_STYLES = [{"color": "tab:pink", "linestyle": "--"}, {"color": "tab:brown", "linestyle": "--"}, {"color": "tab:olive", "linestyle": "--"}]


def method_styles(methods):
    """Each method's line style: its own, or one of the warm-up variants'."""
    warmups = iter(WARMUP_STYLES * 4)
    return {m: TTA_STYLE.get(m) or (next(warmups) | {"linewidth": 1.4} if m.startswith("oktopk_w") else {"linewidth": 1.4}) for m in methods}


def save(fig, out):
    """Write the figure to ``out`` and say so."""
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"plot.py: wrote {out}", file=sys.stderr)


def tta_loss(curve_csv, out, target=None):
    """Held-out loss against training seconds and against steps, one line
    per method (a language model's curves: lower is better)."""
    by_method = defaultdict(list)
    for r in load(curve_csv):
        by_method[r["method"]].append((int(r["step"]), float(r["train_s"]), float(r["loss"])))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    styles = method_styles(by_method)
    for ax, x, label in ((axes[0], 1, "training seconds"), (axes[1], 0, "steps")):
        for method, series in by_method.items():
            series.sort()
            ax.plot([p[x] for p in series], [p[2] for p in series], marker=".", label=method, **styles[method])
        if target is not None:
            ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:g}")
        lows = [p[2] for series in by_method.values() for p in series]
        ax.set(xlabel=label, ylabel="held-out loss (nats per byte)", ylim=(min(lows) - 0.05, min(max(lows), min(lows) + 1.5)))
        ax.grid(True, alpha=0.3)
    axes[0].set_title("held-out loss against training time (evaluation excluded)")
    axes[1].set_title("held-out loss against steps")
    axes[1].legend(fontsize=8, loc="upper right")
    save(fig, out)


def adam_sim(csv_path, out):
    """bench/adam_sim.py's curves: held-out loss against steps, one line per
    variant, density and step budget (budgets differ: the cosine decay ends
    at each run's budget)."""
    by_run = defaultdict(list)
    for r in load(csv_path):
        by_run[(r["variant"], r["density"], r["step_budget"])].append((int(r["step"]), float(r["held_out_loss"])))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for (variant, density, budget), series in sorted(by_run.items()):
        series.sort()
        dense = variant.startswith("dense")
        ax.plot([s for s, _ in series[1:]], [v for _, v in series[1:]], marker=".", linewidth=2.2 if dense else 1.1,
                color="black" if dense else None, label=f"{variant} (density {density}, {budget} steps)")
    ax.set(xlabel="steps", ylabel="held-out loss (nats per byte)", title="bench/adam_sim.py: Adam variants on sparse gradients, P = 4 simulated")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    save(fig, out)


def tta(curve_csv, out, target=None):
    """Accuracy against training seconds, one line per method: the whole
    run, and beside it the approach to the target, enlarged."""
    by_method = defaultdict(list)
    for r in load(curve_csv):
        by_method[r["method"]].append((float(r["train_s"]), float(r["accuracy"])))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    styles = method_styles(by_method)
    for ax in axes:
        for method, series in by_method.items():
            series.sort()
            ax.plot([t for t, _ in series], [a for _, a in series], marker=".", label=method, **styles[method])
        if target is not None:
            ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:g}%")
        ax.set(xlabel="training seconds", ylabel="accuracy %")
        ax.grid(True, alpha=0.3)
    axes[0].set_title("held-out accuracy against training time (evaluation excluded)")
    if target is not None:
        # Up to a little past the last method's first time at the target.
        firsts = [min(t for t, a in series if a >= target) for series in by_method.values() if any(a >= target for _, a in series)]
        if firsts:
            axes[1].set_xlim(0, 1.3 * max(firsts))
        axes[1].set_ylim(target - 12, 100)
    axes[1].set_title("the approach to the target, enlarged")
    axes[0].legend(fontsize=8, loc="lower right")
    save(fig, out)


def main():
    if sys.argv[1] == "--adam-sim":
        adam_sim(sys.argv[2], sys.argv[3])
        return
    if sys.argv[1] == "--tta-loss":
        tta_loss(sys.argv[2], sys.argv[3], float(sys.argv[4]) if len(sys.argv) > 4 else None)
        return
    if sys.argv[1] == "--tta":
        tta(sys.argv[2], sys.argv[3], float(sys.argv[4]) if len(sys.argv) > 4 else None)
        return
    csv_path, outdir = sys.argv[1], sys.argv[2]
    os.makedirs(outdir, exist_ok=True)
    data = panels(load(csv_path))
    time_vs_p(data, os.path.join(outdir, "time_vs_p.png"))
    volume_vs_p(data, os.path.join(outdir, "volume_vs_p.png"))
    print(f"plot.py: wrote {outdir}/time_vs_p.png and {outdir}/volume_vs_p.png", file=sys.stderr)


if __name__ == "__main__":
    main()
