"""make demo's report: plain DDP and the default hook side by side, from
bench/ddp_e2e.py's lines (bench/demo.sh), and OUTDIR/demo.png.

    python bench/demo_report.py ROWS OUTDIR MODE RATE TARGET
"""

import os
import re
import sys

from tta_report import CURVE_HEADER, HEADER

# A path's field in ddp_e2e.py's choice line: NAME:VALUE, VALUE a number or
# None, never with a space (so the reason's "exploring: no decision yet"
# is no such field).
PATH_FIELD = re.compile(r"([A-Za-z0-9_]+):(\S+)")
# What each step on a path sent, where the name alone does not say it.
PATH_NOTES = {"native": "gloo's allreduce"}


def _none_or(convert, text):
    return None if text == "None" else convert(text)


def parse_choice(line):
    """ddp_e2e.py's ``choice,`` line as a dict: method, path (the chosen
    one, None before the first decision), candidate, ms_per_step and steps
    ({path: value} in the line's order; ms None for a path never timed),
    reason. The line is

        choice,METHOD,PATH,CANDIDATE,P:MS,...,P:STEPS,...,REASON

    with a P:MS and a P:STEPS field for every path of oktopk.choice's
    summary()["steps"], whichever and however many they are, then the
    reason, free text that may hold commas: so the fields are read by name,
    and the reason is all that follows the steps. ValueError for a line
    not in that format."""
    kind, *fields = line.rstrip("\n").split(",")
    if kind != "choice" or len(fields) < 3:
        raise ValueError(f"not a choice line: {line!r}")
    method, path, candidate = fields[:3]
    rest = fields[3:]
    # The ms group ends where a path's name comes round again: the first
    # steps field (the reason comes only after the whole steps group).
    ms_fields = {}
    for field in rest:
        match = PATH_FIELD.fullmatch(field)
        if match is None or match[1] in ms_fields:
            break
        ms_fields[match[1]] = match[2]
    names = list(ms_fields)
    steps_fields = [PATH_FIELD.fullmatch(field) for field in rest[len(names):2 * len(names)]]
    if [m and m[1] for m in steps_fields] != names:
        raise ValueError(f"choice line: want a steps field for each of the paths {names}, in their order: {line!r}")
    try:
        ms_per_step = {name: _none_or(float, value) for name, value in ms_fields.items()}
        steps = {m[1]: int(m[2]) for m in steps_fields}
    except ValueError as e:
        raise ValueError(f"choice line: a path's ms or steps is not a number ({e}): {line!r}") from None
    return {
        "method": method,
        "path": _none_or(str, path),
        "candidate": _none_or(str, candidate),
        "ms_per_step": ms_per_step,
        "steps": steps,
        "reason": ",".join(rest[2 * len(names):]),
    }


def _and_join(items):
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def choice_sentence(choice):
    """What the hook measured and chose and why, and the steps each path
    ran, from parse_choice's dict: a path never timed (ms None) or never
    run (0 steps) is left out rather than shown as None or 0."""
    timed = [f"{ms:.1f} ms on {path}" for path, ms in choice["ms_per_step"].items() if ms is not None]
    if choice["path"] is None:
        head = "The hook had made no decision yet"
    elif timed:
        head = f"The hook timed a step at {_and_join(timed)}, and chose {choice['path']}"
    else:
        head = f"The hook chose {choice['path']}"
    reason = choice["reason"].strip()
    sentence = f"{head}: {reason}" + ("" if reason.endswith(".") else ".")
    ran = [f"{steps} {path}" + (f" ({PATH_NOTES[path]})" if path in PATH_NOTES else "")
           for path, steps in choice["steps"].items() if steps]
    if ran:
        return sentence + f" Steps after the dense warm-up: {', '.join(ran)}."
    return sentence + " No steps ran after the dense warm-up."


def read_demo_out(rows_path):
    """demo.out's rows ({method: row}), curve lines and choice (parse_choice's
    dict, or None where the hook printed none)."""
    rows, curve, choice = {}, [], None
    with open(rows_path) as f:
        for line in f:
            line = line.strip()
            kind, _, rest = line.partition(",")
            if kind == "row":
                r = dict(zip(HEADER.split(","), rest.split(",")))
                rows[r["method"]] = r
            elif kind == "curve":
                curve.append(rest)
            elif kind == "choice":
                choice = parse_choice(line)
    if set(rows) != {"ddp", "oktopk"}:
        raise SystemExit(f"demo_report.py: want a row for ddp and for oktopk in {rows_path}, got {sorted(rows)}")
    return rows, curve, choice


def report(rows, curve, choice, mode, rate, target):
    """The side-by-side table and what it means, as printed."""
    ddp, hook = rows["ddp"], rows["oktopk"]

    def mb(r):
        return float(r["run_bytes"]) / int(r["final_step"]) / 1e6

    def first_at(method, level):
        """The first evaluation at or above level: (seconds, step), or None."""
        for c in curve:
            m, step, seconds, acc, _ = c.split(",")
            if m == method and float(acc) >= level:
                return float(seconds), int(step)
        return None

    def to_target(method, level):
        at = first_at(method, level)
        return "not reached" if at is None else f"{at[0]:.1f} s (step {at[1]})"

    def stopped(r):
        return int(r["final_step"]) < int(r["steps"])

    lines = [
        f"{'':28}{'plain DDP':>22}{'oktopk hook, defaults':>26}",
        f"{'ms per step':28}{float(ddp['ms_per_step']):>22.1f}{float(hook['ms_per_step']):>26.1f}",
        f"{'MB sent per step per rank':28}{mb(ddp):>22.2f}{mb(hook):>26.2f}",
        *(f"{f'time to {level:g}% accuracy':28}{to_target('ddp', level):>22}{to_target('oktopk', level):>26}"
          for level in (float(target) - 5, float(target))),
        f"{'accuracy at the end %':28}{float(ddp['final_accuracy']):>22.2f}{float(hook['final_accuracy']):>26.2f}",
    ]
    if stopped(ddp) or stopped(hook):
        lines.append(f"(a run ends at its first evaluation at or above {float(target):g}%, or after {ddp['steps']} steps)")
    dense_at, hook_at = first_at("ddp", float(target)), first_at("oktopk", float(target))
    if dense_at is not None and hook_at is not None:
        ratio = dense_at[0] / hook_at[0]
        verdict = f"{ratio:.1f}x sooner than" if ratio >= 1.05 else ("level with" if ratio > 1 / 1.05 else f"{1 / ratio:.1f}x later than")
        lines += ["", f"The hook reached {float(target):g}% accuracy {verdict} plain DDP: {hook_at[0]:.1f} s of training "
                      f"against {dense_at[0]:.1f} s ({hook_at[1]} steps against {dense_at[1]})."]
    elif dense_at is not None:
        lines += ["", f"The hook did not reach {float(target):g}% in {hook['final_step']} steps; plain DDP did in {dense_at[0]:.1f} s."]
    if choice is not None:
        lines += ["", choice_sentence(choice)]
    speed = float(ddp["ms_per_step"]) / float(hook["ms_per_step"])
    if mode == "netns":
        lines.append(f"On {rate} links the hook's steps are {speed:.1f}x as fast as plain DDP's.")
    else:
        lines.append("This ran on loopback, a fast link: sparse saves too little here, so the hook keeps the "
                     "framework's own allreduce (it never makes a step slower by choosing sparse; it costs what any "
                     "DDP comm hook does). To see a slow link, run `make demo` as root: the ranks then run in network "
                     "namespaces with each link limited to DEMO_RATE (200mbit by default), as `make bench` does.")
    return "\n".join(lines)


def main():
    rows_path, outdir, mode, rate, target = sys.argv[1:6]
    rows, curve, choice = read_demo_out(rows_path)
    print(report(rows, curve, choice, mode, rate, target))
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
