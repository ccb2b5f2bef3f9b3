"""The ctypes binding's copies of include/oktopk.h agree with the header.

_lib.py copies the header's structures and constants by hand. A field added,
removed or retyped on one side only would make the other read the wrong
bytes, silently, so every copy is compared here with the header itself: the
field and constant names come from parsing the header, and the C compiler,
given a small program that includes it, says every offset, size and value.
"""

import ast
import ctypes
import importlib.util
import os
import re
import shlex
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADER = os.path.join(ROOT, "include", "oktopk.h")
PLUGINS = os.path.join(ROOT, "plugins")
BINDING = os.path.join(PLUGINS, "pytorch", "oktopk", "_lib.py")

# Every structure the header declares, with the _lib.py class that copies it
# (None: the binding has no copy, for the reason given).
STRUCTS = {
    "oktopk_config_t": "Config",
    "oktopk_stats_t": "Stats",
    "oktopk_link_model_t": "LinkModel",
    "oktopk_call_options_t": "CallOptions",
    "oktopk_selection_plan_t": "SelectionPlan",
    "oktopk_selection_rules_t": "SelectionRules",
    "oktopk_selected_t": "Selected",
    "oktopk_unique_id_t": None,  # the binding connects by oktopk_comm_bind/_connect, never by a unique id
}

# Fields whose C name cannot be a Python attribute: (struct, C name) to the
# name the binding gives the field.
FIELD_RENAMES = {("oktopk_selection_rules_t", "raise"): "raise_"}

# The header's constants, each named by its enum (the typedef's name) or,
# for a #define, by its own name: those _lib.py copies, under the C name
# less its oktopk prefix in upper snake case (oktopkInvalidArgument:
# INVALID_ARGUMENT, OKTOPK_CALL_DENSITY: CALL_DENSITY) ...
COPIED_CONSTANTS = {
    "oktopk_result_t",
    "oktopk_dtype_t",
    "OKTOPK_STOCHASTIC_ROUNDING",
    "OKTOPK_CALL_DENSITY",
    "OKTOPK_CALL_MEASURE_XI",
    "OKTOPK_CALL_TAU_PRIME",
    "OKTOPK_CALL_SPARSE_ONLY",
    "OKTOPK_CALL_UNDOABLE",
}
# ... and those it has no copy of, with the reason it needs none.
UNCOPIED_CONSTANTS = {
    "oktopk_algorithm_t": "algorithms() numbers the algorithms by the loaded library's own names",
    "OKTOPK_VERSION_MAJOR": "library_version() asks the loaded library",
    "OKTOPK_VERSION_MINOR": "library_version() asks the loaded library",
    "OKTOPK_VERSION_PATCH": "library_version() asks the loaded library",
    "OKTOPK_VERSION_CODE": "library_version() asks the loaded library",
    "OKTOPK_UNIQUE_ID_BYTES": "the binding never makes a unique id",
}


def _load_binding():
    # By its path rather than as oktopk._lib: the package's __init__ imports
    # torch, which the binding itself does not need, and this check should
    # run (and run fast) wherever the binding's file can be read.
    spec = importlib.util.spec_from_file_location("oktopk_binding_under_check", BINDING)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


binding = _load_binding()


# ---- the header, parsed: names only; the compiler gives every number ----

def _header_code():
    """The header without comments, its continued lines joined."""
    with open(HEADER) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return text.replace("\\\n", " ")


def _parse_field(struct, declaration):
    """(name, form) of one member declaration: form is "pointer", "array"
    or "plain". Anything else (bit-fields, several declarators, function
    pointers, nested bodies) is refused rather than misread."""
    declaration = " ".join(declaration.split())
    m = re.fullmatch(r"(?P<type>[A-Za-z_][\w ]*?)(?P<stars>[ *]+)(?P<name>[A-Za-z_]\w*) ?(?P<array>\[[^\]]+\])?", declaration)
    if m is None or "{" in declaration:
        raise AssertionError(f"{struct}: cannot read the member declaration {declaration!r}")
    if m["array"]:
        return m["name"], "array"
    return m["name"], "pointer" if "*" in m["stars"] else "plain"


def parse_header():
    """{struct: [(field, form), ...]} in declaration order, {enum:
    [member, ...]} and [macro, ...] (object-like #defines with a value)."""
    code = _header_code()
    structs = {}
    for m in re.finditer(r"\btypedef\s+struct\s*\w*\s*\{(?P<body>[^{}]*)\}\s*(?P<name>\w+)\s*;", code):
        declarations = [d for d in m["body"].split(";") if d.strip()]
        structs[m["name"]] = [_parse_field(m["name"], d) for d in declarations]
    # A struct written in another form would be missed above: count them all.
    assert len(re.findall(r"\bstruct\b[^;{]*\{", code)) == len(structs), "a struct not of the form typedef struct {...} name;"
    enums = {}
    for m in re.finditer(r"\btypedef\s+enum\s*\w*\s*\{(?P<body>[^{}]*)\}\s*(?P<name>\w+)\s*;", code):
        enums[m["name"]] = [item.split("=")[0].strip() for item in m["body"].split(",") if item.strip()]
    assert len(re.findall(r"\benum\b[^;{]*\{", code)) == len(enums), "an enum not of the form typedef enum {...} name;"
    macros = [m[1] for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(?![\w(])[ \t]*(\S[^\n]*)?$", code, flags=re.M)
              if m[2]]
    return structs, enums, macros


HEADER_STRUCTS, HEADER_ENUMS, HEADER_MACROS = parse_header()


def _c_program():
    """A C program that prints, from the compiler's own view of the header,
    each struct's size and alignment, each field's offset, size and kind,
    and each constant's value."""
    lines = [
        "#include <stdio.h>",
        '#include "oktopk.h"',
        # The kinds a binding must not confuse even at equal sizes.
        "#define KIND(x) _Generic((x), _Bool: \"uint\", char: \"char\", signed char: \"int\", unsigned char: \"uint\", \\",
        "  short: \"int\", unsigned short: \"uint\", int: \"int\", unsigned int: \"uint\", long: \"int\", \\",
        "  unsigned long: \"uint\", long long: \"int\", unsigned long long: \"uint\", float: \"float\", double: \"float\", \\",
        "  long double: \"float\", default: \"aggregate\")",
        "int main(void) {",
    ]
    for struct, fields in HEADER_STRUCTS.items():
        lines.append(f'  printf("struct {struct} %zu %zu\\n", sizeof({struct}), _Alignof({struct}));')
        for name, form in fields:
            member = f"((({struct} *)0)->{name})"
            prefix = "array of " if form == "array" else ""
            kind = {"pointer": '"pointer"', "array": f"KIND({member}[0])", "plain": f"KIND({member})"}[form]
            lines.append(f'  printf("field {struct} {name} %zu %zu {prefix}%s\\n", offsetof({struct}, {name}), '
                         f"sizeof({member}), {kind});")
    constants = [(enum, member) for enum, members in HEADER_ENUMS.items() for member in members]
    constants += [(macro, macro) for macro in HEADER_MACROS]
    for family, name in constants:
        lines.append(f'  printf("const {family} {name} %lld\\n", (long long)({name}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The compiler's view: {struct: (size, alignment)}, {struct: [(field,
    offset, size, kind), ...]}, {name: (family, value)}."""
    work = tmp_path_factory.mktemp("abi")
    source, program = work / "layout.c", work / "layout"
    source.write_text(_c_program())
    cc = shlex.split(os.environ.get("CC", "cc"))
    build = subprocess.run(cc + ["-std=c11", "-Wall", "-Werror", "-I", os.path.dirname(HEADER), str(source), "-o",
                                 str(program)], capture_output=True, text=True)
    assert build.returncode == 0, f"the layout program did not compile:\n{build.stderr}"
    out = subprocess.run([str(program)], capture_output=True, text=True, check=True).stdout
    sizes, fields, constants = {}, {struct: [] for struct in HEADER_STRUCTS}, {}
    for line in out.splitlines():
        what, rest = line.split(" ", 1)
        if what == "struct":
            struct, size, align = rest.split()
            sizes[struct] = (int(size), int(align))
        elif what == "field":
            struct, name, offset, size, kind = rest.split(" ", 4)
            fields[struct].append((name, int(offset), int(size), kind))
        else:
            family, name, value = rest.split()
            constants[name] = (family, int(value))
    return sizes, fields, constants


# ---- the binding's side ----

def _ctypes_kind(t):
    """A ctypes type's kind, in the C program's words."""
    if issubclass(t, ctypes.Array):
        return "array of " + _ctypes_kind(t._type_)
    if issubclass(t, (ctypes._Pointer, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_wchar_p)):
        return "pointer"
    if issubclass(t, (ctypes.Structure, ctypes.Union)):
        return "aggregate"
    code = t._type_
    if code == "c":
        return "char"
    if code in "fdg":
        return "float"
    if code == "?":
        return "uint"
    return "int" if code.islower() else "uint"


def binding_layout(cls):
    """[(field, offset, size, kind), ...] of a ctypes structure, as laid out."""
    return [(name, getattr(cls, name).offset, getattr(cls, name).size, _ctypes_kind(t)) for name, t, *_ in cls._fields_]


def _python_name(c_name):
    """The binding's name for a copied constant: oktopkNonFinite is
    NON_FINITE, OKTOPK_FLOAT16 is FLOAT16."""
    if c_name.startswith("OKTOPK_"):
        return c_name[len("OKTOPK_"):]
    assert c_name.startswith("oktopk"), c_name
    return re.sub(r"(?<!^)(?=[A-Z])", "_", c_name[len("oktopk"):]).upper()


def _plugin_ctypes_classes():
    """(file, class) of every class under plugins/ that declares ctypes
    fields or derives from a ctypes Structure or Union, at any depth."""
    found = []
    for folder, subfolders, files in os.walk(PLUGINS):
        # A wheel's build leaves copies of the sources (build/, *.egg-info):
        # the sources are what is checked.
        subfolders[:] = [d for d in subfolders if d not in ("build", "dist") and not d.endswith(".egg-info")]
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if not isinstance(node, ast.ClassDef):
                    continue
                bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
                assigned = {t.id for s in node.body if isinstance(s, ast.Assign) for t in s.targets
                            if isinstance(t, ast.Name)}
                if bases & {"Structure", "Union", "BigEndianStructure", "LittleEndianStructure"} or "_fields_" in assigned:
                    found.append((os.path.relpath(path, ROOT), node.name))
    return found


# ---- the checks ----

def test_every_header_struct_is_in_the_table():
    not_in_table = sorted(set(HEADER_STRUCTS) - set(STRUCTS))
    not_in_header = sorted(set(STRUCTS) - set(HEADER_STRUCTS))
    assert (not_in_table, not_in_header) == ([], [])


def test_every_ctypes_structure_of_the_plugins_is_a_header_struct_in_the_table():
    """The binding holds every ctypes structure (none elsewhere under
    plugins/, where no check would see it), and each copies a header struct."""
    binding_file = os.path.relpath(BINDING, ROOT)
    found = _plugin_ctypes_classes()
    assert [(file, cls) for file, cls in found if file != binding_file] == []
    assert sorted(cls for _, cls in found) == sorted(cls for cls in STRUCTS.values() if cls is not None)
    for cls in STRUCTS.values():
        if cls is not None:
            assert issubclass(getattr(binding, cls), ctypes.Structure), cls


@pytest.mark.parametrize("struct", sorted(s for s, cls in STRUCTS.items() if cls is not None))
def test_struct_layout_matches_the_header(compiled, struct):
    """Same fields in the same order, at the same offsets, of the same sizes
    and kinds (signed, unsigned, floating, pointer); same struct size and
    alignment."""
    sizes, fields, _ = compiled
    cls = getattr(binding, STRUCTS[struct])
    expected = [(FIELD_RENAMES.get((struct, name), name), offset, size, kind) for name, offset, size, kind in fields[struct]]
    assert binding_layout(cls) == expected
    assert (ctypes.sizeof(cls), ctypes.alignment(cls)) == sizes[struct]


def test_every_header_constant_is_copied_or_said_not_to_be(compiled):
    _, _, constants = compiled
    families = {family for family, _ in constants.values()}
    tables = COPIED_CONSTANTS | set(UNCOPIED_CONSTANTS)
    assert sorted(COPIED_CONSTANTS & set(UNCOPIED_CONSTANTS)) == []
    not_in_tables, not_in_header = sorted(families - tables), sorted(tables - families)
    assert (not_in_tables, not_in_header) == ([], [])


def test_copied_constants_have_the_header_values(compiled):
    _, _, constants = compiled
    copied = {_python_name(name): value for name, (family, value) in constants.items() if family in COPIED_CONSTANTS}
    assert {name: getattr(binding, name, None) for name in copied} == copied


def test_binding_has_no_integer_constant_the_header_does_not_give(compiled):
    """Every upper-case integer of _lib.py is a header copy: one made up in
    Python, or left over after the header dropped it, would be unchecked."""
    _, _, constants = compiled
    copied = {_python_name(name) for name, (family, _) in constants.items() if family in COPIED_CONSTANTS}
    integers = {name for name, value in vars(binding).items() if name.isupper() and type(value) is int}
    assert sorted(integers - copied) == []
