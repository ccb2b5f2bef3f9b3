"""make demo's report: plain DDP and the default hook side by side, from
bench/ddp_e2e.py's lines (bench/demo.sh), and OUTDIR/demo.png.

    python bench/demo_report.py ROWS OUTDIR MODE RATE TARGET
"""

import os
import sys

from tta_report import CURVE_HEADER, HEADER


def main():
    rows_path, outdir, mode, rate, target = sys.argv[1:6]
    rows, curve, choice = {}, [], None
    with open(rows_path) as f:
        for line in f:
            kind, _, rest = line.strip().partition(",")
            if kind == "row":
                r = dict(zip(HEADER.split(","), rest.split(",")))
                rows[r["method"]] = r
            elif kind == "curve":
                curve.append(rest)
            elif kind == "choice":
                choice = rest.split(",", 6)  # the reason, last, may hold commas
    if set(rows) != {"ddp", "oktopk"}:
        raise SystemExit(f"demo_report.py: want a row for ddp and for oktopk in {rows_path}, got {sorted(rows)}")
    ddp, hook = rows["ddp"], rows["oktopk"]

    def mb(r):
        return float(r["run_bytes"]) / int(r["final_step"]) / 1e6

    def to_target(method, level):
        """The first evaluation at or above level: its seconds and step."""
        for c in curve:
            m, step, seconds, acc, _ = c.split(",")
            if m == method and float(acc) >= level:
                return f"{float(seconds):.1f} s (step {step})"
        return "not reached"

    lines = [
        f"{'':28}{'plain DDP':>22}{'oktopk hook, defaults':>26}",
        f"{'ms per step':28}{float(ddp['ms_per_step']):>22.1f}{float(hook['ms_per_step']):>26.1f}",
        f"{'MB sent per step per rank':28}{mb(ddp):>22.2f}{mb(hook):>26.2f}",
        *(f"{f'time to {level:g}% accuracy':28}{to_target('ddp', level):>22}{to_target('oktopk', level):>26}"
          for level in (float(target) - 5, float(target))),
        f"{'final accuracy %':28}{float(ddp['final_accuracy']):>22.2f}{float(hook['final_accuracy']):>26.2f}",
    ]
    print("\n".join(lines))
    speed = float(ddp["ms_per_step"]) / float(hook["ms_per_step"])
    if choice is not None:
        _, path, native_ms, sparse_ms, native_steps, sparse_steps, reason = choice
        print(f"\nThe hook measured both paths and chose {path}: {reason}. Steps: {native_steps} native (gloo's allreduce, "
              f"the dense warm-up not counted), {sparse_steps} sparse.")
    if mode == "netns":
        print(f"On {rate} links the hook's steps are {speed:.1f}x as fast as plain DDP's.")
    else:
        print("This ran on loopback, a fast link: sparse saves too little here, so the hook keeps the framework's own "
              "allreduce (it never makes a step slower by choosing sparse; it costs what any DDP comm hook does). "
              "To see a slow link, run `make demo` as root: the ranks then run in network namespaces with each link "
              "limited to DEMO_RATE (1gbit by default), as `make bench` does.")
    with open(os.path.join(outdir, "demo_curve.csv"), "w") as f:
        f.write(CURVE_HEADER + "\n" + "".join(c + "\n" for c in curve))
    try:
        from plot import tta

        tta(os.path.join(outdir, "demo_curve.csv"), os.path.join(outdir, "demo.png"), float(target))
        print(f"Accuracy against training seconds: {os.path.join(outdir, 'demo.png')}")
    except ImportError as e:  # matplotlib is in the venv; a bare python lacks it
        print(f"(no plot: {e})")


if __name__ == "__main__":
    main()
