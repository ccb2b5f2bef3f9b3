"""The figures the README and results/summary.md quote are the results
files' own, and the README's first screen stays a first screen.

Pure text: no torch, no library; it runs in well under a second.

How a quoted figure names its source. An HTML comment on the line just
before a block (a paragraph, a table, a list, up to the next blank line
or the next mark)

    <!-- figures: results/demo_200mbit.txt results/first_hour.md -->
    <!-- figures: results/bench.md@"Time to accuracy: tta_200mbit_p4" -->

says that every figure in that block is read from those files (paths from
the repository's root); FILE@HEADING narrows a markdown file to the
sections whose heading contains HEADING (a big file holds most numbers
somewhere). The test finds each of the block's figures among the numbers
of those files, as the file writes it or rounded from it to the quoted
figure's decimals ("5716" quotes "5716.1"), so a figure changed on one
side only fails it. A figure derived by arithmetic (a ratio, a unit
conversion) is not a file's: quote the file's own. In README.md and
results/summary.md every figure outside code must sit in such a block; in
docs/ a block is checked where it is marked, and make test's time in
docs/launching.md must be.

What a figure is (one rule for both checks). A number token,
``\\d+(?:[.,]\\d+)*``, not preceded by a letter, digit, underscore,
apostrophe or ASCII hyphen, so "FSDP2", "fp16", "PPoPP'22",
"demo_200mbit" and "BSD-3-Clause" hold none (a range is written with an
en dash, "4.1–4.2", and both its ends count); a comma before three digits
groups thousands ("4,659" is 4659). Not
counted: HTML comments, link targets ``](...)``, and a list's own
numbering ("1. " at a line's start). For the sources check, code is not
quoted figures either: inline code spans, fenced and indented code blocks
(commands and settings) are skipped; the first screen's count keeps them.
"make demo" and "make test" hold no digits, so they never count.

Run ``python tests/python/test_docs_figures.py`` to list every figure
that lacks a source, block by block.
"""

import os
import re
import shlex
import sys
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

README = "README.md"
SUMMARY = os.path.join("results", "summary.md")
# Files where every figure outside code must be in a marked block.
COVERED = [README, SUMMARY]
# Files whose marked blocks are checked (and whose links must resolve).
CHECKED = COVERED + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))

ONE_LINE = "model.register_comm_hook(OkTopkState(), oktopk_hook)"
FIRST_SCREEN = 40       # the one line and the small table sit in these lines
FIGURE_WINDOW = 60      # at most MAX_FIGURES figures in these lines
MAX_FIGURES = 15
MAX_LINES = 200

MARK = re.compile(r"<!--\s*figures:\s*(.*?)\s*-->")
COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK_TARGET = re.compile(r"\]\([^)]*\)")
LIST_NUMBER = re.compile(r"^(\s*)\d+\.(?=\s)", re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
FIGURE = re.compile(r"(?<![\w'-])\d+(?:[.,]\d+)*")
THOUSANDS = re.compile(r",(?=\d{3}(?!\d))")


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def normal(token):
    """"4,659" -> "4659"."""
    return THOUSANDS.sub("", token)


def decimals(figure):
    return len(figure.split(".")[1]) if "." in figure else 0


def figures(text):
    """The figures of a piece of markdown (the module's rule), code included."""
    text = COMMENT.sub(" ", text)
    text = LINK_TARGET.sub("]", text)
    text = LIST_NUMBER.sub(r"\1", text)
    return [normal(t) for t in FIGURE.findall(text)]


_held = {}


def section(path, heading):
    """The lines of a markdown file under each heading that contains
    `heading`, down to the next heading of the same or a higher level."""
    out, level, fenced = [], None, False
    for line in read(path).split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"(#+)\s", line)
        if m:
            if heading in line:
                level = len(m.group(1))
            elif level is not None and len(m.group(1)) <= level:
                level = None
        if level is not None:
            out.append(line)
    assert out, f"{path} has no heading containing {heading!r}"
    return "\n".join(out)


def held(source):
    """Every number in a source file, read loosely (anywhere: inside names,
    code and CSV cells too, with and without thousands separators), each
    also rounded to 0-4 decimals: a quoted figure is its source's as the
    source writes it or rounded from it ("5716" quotes "5716.1", "2.40"
    quotes "2.404"; "0.1" quotes "0.10")."""
    if source not in _held:
        path, _, heading = source.partition("@")
        text = section(path, heading) if heading else read(path)
        found = set(re.findall(r"\d+(?:\.\d+)?", text))
        found.update(normal(t) for t in re.findall(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?", text))
        out = set()
        for f in found:
            x = Decimal(f)
            for d in range(0, min(decimals(f), 4) + 1):
                q = Decimal(1).scaleb(-d)
                out.add(str(x.quantize(q, rounding=ROUND_HALF_UP)))
                out.add(str(x.quantize(q, rounding=ROUND_HALF_EVEN)))
        _held[source] = out
    return _held[source]


def prose_lines(text):
    """(line number, line) for each line outside fenced and indented code
    blocks, its inline code spans blanked; code lines come back empty."""
    out, fenced, prev_blank = [], False, True
    in_indented = False
    for i, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append((i, ""))
            continue
        if fenced:
            out.append((i, ""))
            continue
        if not line.strip():
            out.append((i, ""))
            prev_blank = True
            continue
        # An indented code block starts after a blank line with 4 spaces
        # (list items' code: 6 or more here) and runs while lines stay indented.
        indent = len(line) - len(line.lstrip(" "))
        if prev_blank and indent >= 4 and not line.lstrip().startswith(("-", "*", "|")):
            in_indented = True
        elif in_indented and indent < 4:
            in_indented = False
        prev_blank = False
        out.append((i, "" if in_indented else INLINE_CODE.sub(" ", line)))
    return out


def blocks(path):
    """Each marked block of a file: (first line number, its source paths,
    its prose lines as (number, text))."""
    text = read(path)
    lines = text.split("\n")
    prose = dict(prose_lines(text))
    out = []
    for i, line in enumerate(lines):
        m = MARK.search(line)
        if not m:
            continue
        sources = shlex.split(m.group(1))
        body = []
        j = i + 1
        while j < len(lines) and lines[j].strip() and not MARK.search(lines[j]):
            body.append((j + 1, prose[j + 1]))
            j += 1
        out.append((i + 1, sources, body))
    return out


def unsourced(path):
    """Figures of a file's marked blocks that their sources do not hold:
    [(line, figure, sources)]."""
    missing = []
    for start, sources, body in blocks(path):
        found = set()
        for s in sources:
            found |= held(s)
        for n, text in body:
            for fig in figures(text):
                if fig not in found:
                    missing.append((n, fig, " ".join(sources)))
    return missing


def uncovered(path):
    """Figures of a file's prose outside every marked block: [(line, figure)]."""
    marked = {n for _, _, body in blocks(path) for n, _ in body}
    out = []
    for n, text in prose_lines(read(path)):
        if n in marked:
            continue
        for fig in figures(text):
            out.append((n, fig))
    return out


def test_marked_sources_exist():
    for path in CHECKED:
        for start, sources, _ in blocks(path):
            assert sources, f"{path}:{start}: a figures mark names no file"
            for s in sources:
                file, _, heading = s.partition("@")
                assert not os.path.isabs(file) and os.path.isfile(os.path.join(ROOT, file)), f"{path}:{start}: no file {file}"
                if heading:
                    section(file, heading)


def test_quoted_figures_are_the_sources():
    """A figure in a marked block is one its source files hold."""
    missing = [f"{path}:{n}: {fig} is not in {src}" for path in CHECKED for n, fig, src in unsourced(path)]
    assert not missing, "\n".join(missing)


def test_every_figure_has_a_source():
    """README.md and results/summary.md quote no figure without naming the
    results file that holds it."""
    loose = [f"{path}:{n}: {fig} is in no block marked <!-- figures: FILE -->" for path in COVERED for n, fig in uncovered(path)]
    assert not loose, "\n".join(loose)


# Figures restated in docs/ that must be marked: (file, a phrase on their line).
MARKED_IN_DOCS = [
    (os.path.join("docs", "launching.md"), "bash .ci/run` took"),   # make test's wall time
]


def test_docs_restating_results_are_marked():
    for path, phrase in MARKED_IN_DOCS:
        lines = [i for i, line in enumerate(read(path).split("\n"), 1) if phrase in line]
        assert lines, f"{path}: no line holds {phrase!r}"
        marked = {n for _, _, body in blocks(path) for n, _ in body}
        assert set(lines) <= marked, f"{path}:{lines}: not in a block marked <!-- figures: FILE -->"


def test_the_demo_is_described_as_it_runs():
    """What bench/demo.sh runs by default (the MLP's width, the emulated
    link's rate) is what its results file, the README's table and the
    summary's demo bullet describe: the table is read from the demo's own
    output, and the summary names that file."""
    script = read(os.path.join("bench", "demo.sh"))
    width = re.search(r"WIDTH=\$\{DEMO_WIDTH:-(\d+)\}", script).group(1)
    rate = re.search(r"RATE=\$\{DEMO_RATE:-(\d+)mbit\}", script).group(1)
    assert f"width {width}" in read(os.path.join("results", "demo_200mbit.txt"))
    assert f"{rate}mbit" in read(os.path.join("results", "demo_200mbit.txt"))
    readme = read(README)
    assert "<!-- figures: results/demo_200mbit.txt -->\n|" in readme
    assert f"{rate} Mbit/s" in readme.split("\n## ")[0]
    summary = read(SUMMARY)
    demo = summary[summary.index("- **`make demo`**"):]
    demo = demo[:demo.index("\n- ")]
    assert f"width {width}" in demo and f"{rate} Mbit/s" in demo and "results/demo_200mbit.txt" in demo


def test_the_first_screen():
    """The README: the one line within its first 40 lines, a table after it
    that ends them, at most 15 figures in its first 60, at most 200 lines,
    and both commands."""
    text = read(README)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES})"
    at = [i for i, line in enumerate(lines, 1) if ONE_LINE in line]
    assert at and at[0] <= FIRST_SCREEN, f"the one line is at {at} (want within the first {FIRST_SCREEN})"
    table = [i for i, line in enumerate(lines, 1) if line.startswith("|")]
    assert table and table[0] > at[0], "a table of what a user gets follows the one line"
    last = table[0]
    while last + 1 in table:
        last += 1
    assert last <= FIRST_SCREEN, f"the table of what a user gets ends at line {last} (want within {FIRST_SCREEN})"
    count = figures("\n".join(lines[:FIGURE_WINDOW]))
    assert len(count) <= MAX_FIGURES, f"{len(count)} figures in the first {FIGURE_WINDOW} lines: {count}"
    assert "make demo" in text and "make test" in text
    assert "docs/ways-in.md" in "\n".join(lines[:FIRST_SCREEN]), \
        "the FSDP2, Horovod and C equivalents of the one line are a link away, in the first screen"


def slug(heading):
    """GitHub's anchor for a heading."""
    h = heading.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path):
    out, fenced = set(), False
    for line in read(path).split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def test_links_resolve():
    """Every relative link in README.md, docs/ and results/summary.md names
    a file that exists, and a heading of it where it names one."""
    bad = []
    for path in CHECKED:
        text = COMMENT.sub(" ", read(path))
        text = re.sub(r"```.*?```", " ", text, flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), file)) if file else os.path.join(ROOT, path)
            if not os.path.exists(full):
                bad.append(f"{path}: {target}: no such file")
            elif anchor and full.endswith(".md") and anchor not in anchors(os.path.relpath(full, ROOT)):
                bad.append(f"{path}: {target}: no such heading")
    assert not bad, "\n".join(bad)


if __name__ == "__main__":
    for path in CHECKED:
        for n, fig, src in unsourced(path):
            print(f"{path}:{n}: {fig} not in {src}")
    for path in COVERED:
        for n, fig in uncovered(path):
            print(f"{path}:{n}: {fig} unmarked")
    sys.exit(0)
