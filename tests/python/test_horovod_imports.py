"""Horovod's plugin is an adapter of oktopk's public API: it imports only
the names ``oktopk`` exports (``oktopk.__all__``), never one of its
modules, so nothing inside the engine can change under it unseen."""

import ast
import os

import oktopk

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOROVOD = os.path.join(ROOT, "plugins", "horovod", "oktopk_horovod")


def oktopk_uses(path):
    """(line, what) of every import of oktopk and every ``oktopk.<name>``
    read in the file."""
    tree = ast.parse(open(path).read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "oktopk":
            out.append((node.lineno, f"from {node.module} import " + ", ".join(a.name for a in node.names)))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] == "oktopk"]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "oktopk":
            out.append((node.lineno, f"oktopk.{node.attr}"))
    return out


def internal(use):
    """Whether an import or read reaches past oktopk's exported names."""
    if use.startswith("import "):
        return use != "import oktopk"
    if use.startswith("from "):
        module, names = use[len("from "):].split(" import ")
        return module != "oktopk" or any(name not in oktopk.__all__ for name in names.split(", "))
    return use.split(".", 1)[1] not in oktopk.__all__


def test_horovods_plugin_uses_only_oktopks_exported_names():
    found = {}
    for f in sorted(os.listdir(HOROVOD)):
        if f.endswith(".py"):
            uses = [(line, use) for line, use in oktopk_uses(os.path.join(HOROVOD, f)) if internal(use)]
            if uses:
                found[f] = uses
    assert not found, f"Horovod's plugin reaches oktopk's internals: {found}"


def test_the_check_sees_an_internal_import():
    assert internal("from oktopk.choice import NATIVE") and internal("from oktopk import _lib") and internal("oktopk.settings")
    assert not internal("from oktopk import Settings, Engine") and not internal("import oktopk") and not internal("oktopk.DeMo")


def test_every_exported_name_is_there():
    for name in oktopk.__all__:
        assert getattr(oktopk, name) is not None, name
