"""The import-layers contract: every import inside ``dduf_plus`` points down (or sideways within a floor).

    base (errors, _version, dtype_names, assignments, sizes) < storage < format < refs, remote < torchkit <
    packing < loading < top (cli, serve, fs, compat, inspection, the package root)

Imports under ``if TYPE_CHECKING:`` are not counted (they never run). Lazy imports inside functions are: a
lazy import that points up is still a layer pointing up, and two modules that import each other only inside
functions are still a circle. Two more checks: no import cycles (module level and lazy alike), and no module
imports a ``_private`` name from another (a shared piece is a public name of the module that owns it)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dduf_plus"

# Floors, bottom first. A module belongs to the first prefix that matches it.
FLOORS: list[tuple[int, tuple[str, ...]]] = [
    (0, ("dduf_plus.errors", "dduf_plus._version", "dduf_plus.dtype_names", "dduf_plus.assignments",
         "dduf_plus.sizes")),
    (1, ("dduf_plus.storage",)),  # reading and storing bytes: sources, HTTP client, caches, confinement, zstd
    (2, ("dduf_plus.format",)),  # describing and checking bytes: ZIP, safetensors, index, rules, writer
    (3, ("dduf_plus.refs", "dduf_plus.remote")),
    (4, ("dduf_plus.torchkit",)),  # torch helpers packing and loading share: meta models, tensor streams
    (5, ("dduf_plus.packing",)),
    (6, ("dduf_plus.loading",)),
    (7, ("dduf_plus.cli", "dduf_plus.serve", "dduf_plus.fs", "dduf_plus.compat", "dduf_plus.inspection",
         "dduf_plus.catalogue", "dduf_plus.hub")),
]
ROOT = "dduf_plus"  # the package root re-exports everything lazily


def floor_of(module: str) -> int:
    if module == ROOT:
        return 99
    for level, prefixes in FLOORS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module}: not on any floor; add it to FLOORS in tests/test_layers.py")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, name: str | None = None) -> list[tuple[str, int, bool]]:
    """(imported dduf_plus module, line, at module level) for every import in ``path`` that runs."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other, top)
                continue
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target == ROOT or target.startswith(ROOT + "."):
                    if child.module is None or target == ROOT:  # "from . import spec": each name is a module
                        for alias in child.names:
                            sub = f"{target}.{alias.name}"
                            found.append((sub if (PACKAGE.parent / sub.replace(".", "/")).exists()
                                          or (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists()
                                          else target, child.lineno, top))
                    else:
                        found.append((target, child.lineno, top))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == ROOT or alias.name.startswith(ROOT + "."):
                        found.append((alias.name, child.lineno, top))
            nested = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, nested)

    visit(tree, True)
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_on_a_floor() -> None:
    for path in MODULES:
        floor_of(module_name(path))


def upward_imports(modules: list[tuple[Path, str]]) -> list[str]:
    upward = []
    for path, importer in modules:
        for target, line, _ in imports_of(path, importer):
            if floor_of(target) > floor_of(importer):
                upward.append(f"{path.name}:{line}: {importer} -> {target}")
    return upward


def test_imports_point_down() -> None:
    upward = upward_imports([(p, module_name(p)) for p in MODULES])
    assert not upward, "imports that point up a floor:\n" + "\n".join(upward)


# No circle and no private import is allowed; these stay empty (the planted examples below use them).
ALLOWED_CYCLES: set[frozenset[str]] = set()
ALLOWED_PRIVATE: set[str] = set()


def import_graph(modules: list[tuple[Path, str]], *, lazy: bool = True) -> dict[str, set[str]]:
    """importer -> the dduf_plus modules it imports (with ``lazy``, imports inside functions count too)."""
    return {importer: {t for t, _, top in imports_of(path, importer) if (lazy or top) and t != importer}
            for path, importer in modules}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path per circle found by a depth-first walk (a module importing its own package is no circle: the
    package's ``__init__`` runs first)."""
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1 and not (nxt == ROOT or node.startswith(nxt + ".")):
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [])
    return [c for c in cycles if frozenset(c) not in ALLOWED_CYCLES]


def _target(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(modules: list[tuple[Path, str]]) -> list[str]:
    """``from dduf_plus.x import _name`` in a module other than ``x``, and ``x._name`` through a module imported
    as a name (``from ..storage import zst as _zst``: ``_zst._free_bytes``)."""
    found = []
    for path, importer in modules:
        if importer in ALLOWED_PRIVATE:
            continue
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases: dict[str, str] = {}  # local name -> the dduf_plus module it is bound to
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _target(node, package)
            if target == importer or not (target == ROOT or target.startswith(ROOT + ".")):
                continue
            found += [f"{path.name}:{node.lineno}: {importer} imports {target}.{alias.name}"
                      for alias in node.names if _is_private(alias.name)]
            aliases.update({alias.asname or alias.name: f"{target}.{alias.name}" for alias in node.names})
        found += [f"{path.name}:{node.lineno}: {importer} uses {aliases[node.value.id]}.{node.attr}"
                  for node in ast.walk(tree) if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in aliases and _is_private(node.attr)]
    return found


ALL = [(p, module_name(p)) for p in MODULES]


def test_no_import_cycles() -> None:
    cycles = import_cycles(import_graph(ALL))
    assert not cycles, "import cycles (imports inside functions count):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_names_across_modules() -> None:
    found = private_imports(ALL)
    assert not found, "private names imported from another module (make them public there):\n" + "\n".join(found)


def _plant(root: Path, files: dict[str, str]) -> list[tuple[Path, str]]:
    """A made-up ``dduf_plus`` subpackage under ``root``: (path, module name) of each file."""
    out = []
    for name, text in files.items():
        path = root / f"{name}.py"
        path.write_text(text)
        out.append((path, f"dduf_plus.probe.{name}"))
    return out


def test_a_planted_lazy_cycle_is_found(tmp_path: Path) -> None:
    """Two modules that import each other only inside functions: the circle the old module-level check missed."""
    planted = _plant(tmp_path, {"a": "from .b import f\n", "b": "def f():\n    from .a import g\n"})
    assert import_cycles(import_graph(planted)) == [["dduf_plus.probe.a", "dduf_plus.probe.b", "dduf_plus.probe.a"]]
    assert import_cycles(import_graph(planted, lazy=False)) == []
    planted = _plant(tmp_path, {"b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import g\n"})
    assert import_cycles(import_graph(planted + [(tmp_path / "a.py", "dduf_plus.probe.a")])) == []


def test_a_planted_private_import_is_found(tmp_path: Path) -> None:
    """``from .a import _helper`` (lazy or not) is found; a public name, a dunder and a module's own names are not."""
    planted = _plant(tmp_path, {"a": "_helper = 1\nfrom .a import _helper as again\n",
                                "b": "from .a import helper, __all__\ndef f():\n    from ..probe.a import _helper\n",
                                "c": "from .. import probe as p\nfrom ..probe import a\nx = a._helper, a.__doc__, p._x\n"})
    assert private_imports(planted) == ["b.py:3: dduf_plus.probe.b imports dduf_plus.probe.a._helper",
                                        "c.py:3: dduf_plus.probe.c uses dduf_plus.probe.a._helper",
                                        "c.py:3: dduf_plus.probe.c uses dduf_plus.probe._x"]


def test_the_contract_can_fail(tmp_path: Path) -> None:
    """The checker itself: an upward lazy import in a made-up format module is found; the same import
    under ``if TYPE_CHECKING:`` is not."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..loading import pipeline\n")
    assert upward_imports([(probe, "dduf_plus.format.probe")]) == [
        "probe.py:2: dduf_plus.format.probe -> dduf_plus.loading"]
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..loading import pipeline\n")
    assert upward_imports([(probe, "dduf_plus.format.probe")]) == []


def test_no_module_shadows_the_standard_library():
    """``dduf_plus/inspect.py`` used to shadow ``inspect`` for anything run from inside the package folder."""
    import sys

    shadows = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                     if p.stem in sys.stdlib_module_names)
    assert not shadows, shadows


def test_module_loggers_are_named_after_their_module():
    """``logging.getLogger(__name__)``: each module logs under its own name below ``dduf_plus`` (a handler or
    level set on ``dduf_plus`` still sees them all), never all of them as the bare ``dduf_plus``."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            call = node.value if isinstance(node, ast.Assign) else None
            if (isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "getLogger" and call.args
                    and isinstance(call.args[0], ast.Constant) and call.args[0].value != name):
                wrong.append(f"{name}:{node.lineno} getLogger({call.args[0].value!r})")
    assert not wrong, wrong
