"""The engine's boundary (oktopk.engine): only the engine's own modules
read its private attributes. The adapters (the DDP hook, the FSDP2
registration, the framework integrations, the launcher) and Horovod's
plugin go through its public methods, and Horovod's plugin imports only
what oktopk exports."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLUGIN = os.path.join(ROOT, "plugins", "pytorch", "oktopk")
HOROVOD = os.path.join(ROOT, "plugins", "horovod", "oktopk_horovod")

# At most this many reads of the engine's private attributes from outside
# its modules (264 before the engine was made).
MOST_OUTSIDE = 10


def engine_privates():
    from oktopk.engine import Engine

    return {name for name in Engine.__slots__ if name.startswith("_")}


def private_reads(path, privates):
    """(line, text) of each ``x._name`` in the file where ``_name`` is one of
    ``privates`` and ``x`` is not ``self``: an object's own attributes of the
    same name (Horovod's optimizer keeps some) are its own business."""
    tree = ast.parse(open(path).read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in privates:
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            out.append((node.lineno, ast.unparse(node)))
    return out


def outside_modules():
    from oktopk.engine import ENGINE_MODULES

    files = [os.path.join(PLUGIN, f) for f in sorted(os.listdir(PLUGIN)) if f.endswith(".py") and f[:-3] not in ENGINE_MODULES]
    files += [os.path.join(HOROVOD, f) for f in sorted(os.listdir(HOROVOD)) if f.endswith(".py")]
    return files


def test_the_engines_privates_stay_inside_it():
    privates = engine_privates()
    found = {os.path.relpath(f, ROOT): private_reads(f, privates) for f in outside_modules()}
    found = {f: reads for f, reads in found.items() if reads}
    total = sum(len(reads) for reads in found.values())
    assert total <= MOST_OUTSIDE, f"{total} reads of the engine's private attributes outside it: {found}"


def test_the_count_sees_a_read():
    # The counter itself: a read through another name counts, self's does not.
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("def f(state):\n    return state._layout, self._layout\n")
    try:
        assert [text for _, text in private_reads(f.name, {"_layout"})] == ["state._layout"]
    finally:
        os.unlink(f.name)


@pytest.mark.parametrize("module", ["hook", "fsdp", "integrations", "autohook", "run"])
def test_adapters_are_outside_the_engine(module):
    from oktopk.engine import ENGINE_MODULES

    assert module not in ENGINE_MODULES
