#!/usr/bin/env python
"""Every import in the repository is stdlib, first-party, or a distribution pyproject.toml declares.

``python .ci/check_imports.py [REPO]`` walks the ``import`` statements (plus ``importlib.import_module("x")``,
``pytest.importorskip("x")`` and ``__import__("x")`` with a constant name) of every ``.py`` file under the
checked folders, maps each module to the distribution that provides it in the running environment, and fails
(exit 1, one line per problem) when that distribution is not declared for the code that imports it:

- ``dduf_plus/`` and ``examples/``: the core ``dependencies``;
- ``tests/`` and ``fixtures/``: core + the ``test`` extra; ``tests/fuzz/``: core + ``fuzz``;
- ``bench/``: core + ``bench``; ``.ci/``: ``test``.

An import inside ``try: ... except ImportError`` (or ``pytest.importorskip``, or ``if TYPE_CHECKING:``) may use
any distribution that *some* extra declares: the code copes without it. Anything else must be in
``ALLOWED_OPTIONAL`` with the reason. Run it in an environment installed from pyproject.toml (CI's fresh
virtual environment): a module that is not installed there is reported, since nothing declared provides it.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

# Folder (relative to the repository root) -> dependency groups its code may use; the longest prefix wins.
# "core" is [project].dependencies, every other name an extra of [project.optional-dependencies].
GROUPS: dict[str, tuple[str, ...]] = {
    "dduf_plus": ("core",),
    "dduf_plus/serve": ("core", "serve"),  # imported only by `dduf serve`, which names the extra when it is missing
    "examples": ("core",),
    "tests": ("core", "test"),
    "tests/fuzz": ("core", "fuzz"),
    "fixtures": ("core", "test"),
    "bench": ("core", "bench"),
    ".ci": ("test",),
}

# (path glob, module) -> why an import of a distribution outside the file's groups is acceptable there.
ALLOWED_OPTIONAL: dict[tuple[str, str], str] = {
    ("dduf_plus/loading/quant.py", "optimum.quanto"): (
        "quanto extra: only reached after quant._require_quanto(), which turns a missing optimum-quanto "
        "into a DDUFLoadError naming the install command"
    ),
    ("dduf_plus/loading/quant_backends.py", "torchao"): (
        "quant extra: only reached after quant_backends.require_backend('torchao'), which turns a missing torchao "
        "into a DDUFLoadError naming the install command"
    ),
    ("dduf_plus/torchkit/quant_state.py", "torchao"): (
        "quant extra: only reached for a model whose hf_quantizer is torchao's, which cannot exist without torchao"
    ),
    ("dduf_plus/torchkit/quant_state.py", "bitsandbytes"): (
        "quant extra: only reached for a model whose hf_quantizer is bitsandbytes', which cannot exist without it"
    ),
    ("dduf_plus/packing/quantize.py", "torchao"): (
        "quant extra: only reached for --quantize torchao-*, after quantize._require() names the pip command"
    ),
    ("tests/test_quant_save.py", "torchao"): "quant extra, installed by the README's test command",
    ("tests/test_quant_save.py", "bitsandbytes"): "quant extra, installed by the README's test command",
    ("tests/test_quant_backends.py", "torchao"): "quant extra, installed by the README's test command",
    ("tests/test_quant_backends.py", "bitsandbytes"): "quant extra, installed by the README's test command",
}

# Declared, but never imported by name: used at run time by another library.
RUNTIME_ONLY: dict[str, str] = {
    "protobuf": "transformers reads SentencePiece .model tokenizers (T5, Llama) through it",
    "tqdm": "huggingface_hub's progress bars (dduf_plus.format.pack uses huggingface_hub.utils.tqdm)",
    "ruff": "the linter of the README's checks (`ruff check`): a command, not an import",
}

_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
_TRY_NODES = tuple(t for t in (ast.Try, getattr(ast, "TryStar", None)) if t is not None)  # 3.11 except*
_NAME_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


def normalize(name: str) -> str:
    """PEP 503 name: ``Zlib_NG`` and ``zlib-ng`` are the same distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository root, "/"-separated
    line: int
    module: str  # dotted, absolute
    guarded: bool  # inside try/except ImportError, importorskip, or TYPE_CHECKING


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    module: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


# --- pyproject -------------------------------------------------------------------------------------------


def _load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest depends on tomli there
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def declared_groups(pyproject: Path) -> dict[str, set[str]]:
    """{"core": {...}, extra: {...}} of normalized distribution names; ``project[extra]`` self-references
    are expanded."""
    data = _load_toml(pyproject)
    project = data.get("project", {})
    own = normalize(project.get("name", ""))
    raw: dict[str, list[str]] = {"core": list(project.get("dependencies", []))}
    raw.update({k: list(v) for k, v in project.get("optional-dependencies", {}).items()})

    def expand(group: str, seen: frozenset[str]) -> set[str]:
        names: set[str] = set()
        for req in raw.get(group, []):
            m = _NAME_RE.match(req)
            if not m:
                continue
            name = normalize(m.group(1))
            if name == own:  # dduf_plus[quanto]
                for extra in (m.group(2) or "").split(","):
                    extra = extra.strip()
                    if extra and extra not in seen:
                        names |= expand(extra, seen | {extra})
            else:
                names.add(name)
        return names

    return {group: expand(group, frozenset({group})) for group in raw}


# --- imports ---------------------------------------------------------------------------------------------


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        (isinstance(t, ast.Name) and t.id in _IMPORT_ERRORS)
        or (isinstance(t, ast.Attribute) and t.attr in _IMPORT_ERRORS)
        for t in types
    )


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _call_import(node: ast.Call) -> tuple[str, bool] | None:
    """(module, guarded) for import_module("x") / importorskip("x") / __import__("x") with a constant name."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "importorskip", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)) or arg.value.startswith("."):
        return None
    return arg.value, name == "importorskip"


def iter_imports(source: str, path: str) -> Iterator[Import]:
    """The absolute imports of one module's source (relative ones are first-party by construction)."""
    tree = ast.parse(source, filename=path)

    def visit(node: ast.AST, guarded: bool) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, alias.name, guarded)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                yield Import(path, node.lineno, node.module, guarded)
        elif isinstance(node, ast.Call):
            found = _call_import(node)
            if found:
                yield Import(path, node.lineno, found[0], guarded or found[1])
        if isinstance(node, _TRY_NODES):
            body_guarded = guarded or any(_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                yield from visit(child, body_guarded)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                yield from visit(child, guarded)
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from visit(child, True)
            for child in node.orelse:
                yield from visit(child, guarded)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child, guarded)

    # A module-level pytest.importorskip("x") skips the whole file without x: its later imports of x are guarded.
    skipped: set[str] = set()
    pending: list[ast.AST] = list(tree.body)
    while pending:  # module-level code only: a skip inside a function guards nothing else
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Call) and (found := _call_import(node)) and found[1]:
            skipped.add(found[0])
        pending.extend(ast.iter_child_nodes(node))
    for imp in visit(tree, False):
        if not imp.guarded and any(imp.module == m or imp.module.startswith(m + ".") for m in skipped):
            imp = Import(imp.path, imp.line, imp.module, True)
        yield imp


def iter_python_files(repo: Path, roots: Iterable[str]) -> list[Path]:
    """The ``.py`` files under ``roots`` (each once, although ``tests`` and ``tests/fuzz`` overlap)."""
    found: set[Path] = set()
    for root in roots:
        base = repo / root
        if base.is_file() and base.suffix == ".py":
            found.add(base)
        elif base.is_dir():
            for p in base.rglob("*.py"):
                rel = p.relative_to(repo).parts
                # bench/_work holds generated data and the benchmarks' own venvs (git-ignored, not ours)
                if not any(part in ("__pycache__", "node_modules", "_work") or part.startswith(".venv")
                           or part.startswith("venv") for part in rel):
                    found.add(p)
    return sorted(found)


def local_top_level_names(repo: Path, files: Iterable[Path]) -> set[str]:
    """Names importable because their folder is on sys.path (tests/conftest.py, bench/_common.py, ...) or
    because they are a top-level package of the repository (dduf_plus)."""
    names: set[str] = set()
    for p in files:
        folder = p.parent
        if not (folder / "__init__.py").is_file():
            names.add(p.stem)  # a plain module next to scripts
            continue
        while (folder.parent / "__init__.py").is_file():
            folder = folder.parent
        names.add(folder.name)  # the outermost package
    return names


# --- distributions ---------------------------------------------------------------------------------------


class Distributions:
    """Which installed distribution provides a module (namespace packages such as ``google`` or ``optimum`` are
    told apart by the files each distribution owns)."""

    def __init__(self, top_level: Mapping[str, list[str]] | None = None) -> None:
        self.top_level = dict(md.packages_distributions() if top_level is None else top_level)

    def providers(self, module: str) -> set[str]:
        parts = module.split(".")
        dists = {normalize(d) for d in self.top_level.get(parts[0], [])}
        if len(dists) > 1 and len(parts) > 1:
            owning = {d for d in dists if self._owns(d, parts[0], parts[1])}
            dists = owning or dists
        return dists

    @staticmethod
    def _owns(dist: str, top: str, sub: str) -> bool:
        try:
            files = md.distribution(dist).files or []
        except md.PackageNotFoundError:
            return False
        return any(f.parts[:2] == (top, sub) or (len(f.parts) == 2 and f.parts[0] == top and
                                                  f.parts[1].split(".")[0] == sub) for f in files)


# --- the check -------------------------------------------------------------------------------------------


def groups_for(path: str, groups: Mapping[str, tuple[str, ...]]) -> tuple[str, tuple[str, ...]] | None:
    best = None
    for prefix, names in groups.items():
        if (path == prefix or path.startswith(prefix + "/")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, names)
    return best


def check(
    repo: Path,
    *,
    groups: Mapping[str, tuple[str, ...]] = GROUPS,
    allowed_optional: Mapping[tuple[str, str], str] = ALLOWED_OPTIONAL,
    distributions: Distributions | None = None,
) -> list[Problem]:
    """Every problem found under ``repo``'s checked folders (empty: all imports are declared)."""
    repo = Path(repo)
    declared = declared_groups(repo / "pyproject.toml")
    any_extra = set().union(*declared.values())
    dists = distributions or Distributions()
    files = list(iter_python_files(repo, groups))
    local = local_top_level_names(repo, files)
    problems: list[Problem] = []
    for p in files:
        rel = p.relative_to(repo).as_posix()
        prefix, names = groups_for(rel, groups) or ("", ())
        allowed = set().union(*(declared.get(g, set()) for g in names))
        missing_groups = [g for g in names if g not in declared]
        if missing_groups:
            problems.append(Problem(rel, 1, "", f"pyproject.toml has no dependency group {missing_groups} "
                                                f"(check_imports.GROUPS maps {prefix}/ to it)"))
        for imp in iter_imports(p.read_text(encoding="utf-8"), rel):
            top = imp.module.split(".")[0]
            if top in sys.stdlib_module_names or top in local:
                continue
            if any(fnmatch(rel, glob) and (imp.module == mod or imp.module.startswith(mod + "."))
                   for glob, mod in allowed_optional):
                continue
            providers = dists.providers(imp.module)
            where = " + ".join("[project].dependencies" if g == "core" else f"extra {g!r}" for g in names)
            if not providers:
                # Not installed here: fall back to "distribution named like the module" so a declared but
                # uninstalled optional package (an extra nobody installed) is still recognised.
                parts = imp.module.split(".")
                guesses = {normalize(top), normalize(".".join(parts[:2]))}  # optimum.quanto: optimum-quanto
                if guesses & allowed or (imp.guarded and guesses & any_extra):
                    continue
                problems.append(Problem(rel, imp.line, imp.module,
                                        f"imports {imp.module}, which no installed distribution provides and "
                                        f"{where} does not declare"))
                continue
            if providers & allowed or (imp.guarded and providers & any_extra):
                continue
            dist = ", ".join(sorted(providers))
            hint = ""
            if providers & any_extra:  # then it is not guarded
                hint = " (another extra has it, but this import is not guarded by `except ImportError`)"
            problems.append(Problem(rel, imp.line, imp.module,
                                    f"imports {imp.module} (distribution {dist}), which {where} does not "
                                    f"declare{hint}"))
    return problems


def unused_declared(repo: Path, distributions: Distributions | None = None) -> set[str]:
    """Declared distributions that no checked file imports and RUNTIME_ONLY does not explain."""
    repo = Path(repo)
    declared = set().union(*declared_groups(repo / "pyproject.toml").values())
    dists = distributions or Distributions()
    used: set[str] = set()
    for p in iter_python_files(repo, GROUPS):
        for imp in iter_imports(p.read_text(encoding="utf-8"), p.relative_to(repo).as_posix()):
            used |= dists.providers(imp.module) or {normalize(imp.module.split(".")[0])}
    return declared - used - {normalize(n) for n in RUNTIME_ONLY}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    repo = Path(args[0]) if args else Path(__file__).resolve().parents[1]
    dists = Distributions()
    problems = check(repo, distributions=dists)
    for problem in problems:
        print(problem)
    unused = unused_declared(repo, dists)
    if unused:
        print(f"note: declared but never imported (add to RUNTIME_ONLY with the reason): {', '.join(sorted(unused))}")
    if problems:
        print(f"{len(problems)} undeclared import(s): declare them in pyproject.toml", file=sys.stderr)
        return 1
    print("imports: every third-party import is declared in pyproject.toml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
