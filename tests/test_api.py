"""The public API is what it says: the lazy export tables, ``__all__`` and the ``TYPE_CHECKING`` blocks name the
same objects, every export resolves, ``import dduf_plus`` stays torch-free, and the wheel ships ``py.typed``."""

from __future__ import annotations

import ast
import importlib
import importlib.resources
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import dduf_plus

ROOT = Path(__file__).resolve().parent.parent
LAZY_PACKAGES = ["dduf_plus", "dduf_plus.loading"]


def _tree(package: str) -> ast.Module:
    path = ROOT / package.replace(".", "/") / "__init__.py"
    return ast.parse(path.read_text(encoding="utf-8"))


def _absolute(package: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - node.level + 1]  # level 1 is the package itself (this is its __init__)
    return ".".join(base + ([node.module] if node.module else []))


def _lazy_table(package: str) -> dict[str, str]:
    """``_LAZY`` as written, with module names made absolute."""
    for node in _tree(package).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "_LAZY":
            table = ast.literal_eval(node.value)
            return {name: mod if mod.startswith("dduf_plus") else f"{package}.{mod}" for name, mod in table.items()}
    raise AssertionError(f"{package}: no _LAZY table")


def _type_checking_imports(package: str) -> dict[str, str]:
    """name -> absolute module for every import under ``if TYPE_CHECKING:``; each must be ``X as X``."""
    found: dict[str, str] = {}
    for node in _tree(package).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom), f"{package}: only `from x import y as y` under TYPE_CHECKING"
                for alias in stmt.names:
                    assert alias.asname == alias.name, (
                        f"{package}: write `{alias.name} as {alias.name}` (an explicit re-export)")
                    assert alias.name not in found, f"{package}: {alias.name} imported twice"
                    found[alias.name] = _absolute(package, stmt)
    return found


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_lazy_table_type_checking_block_and_all_agree(package: str) -> None:
    lazy = _lazy_table(package)
    assert _type_checking_imports(package) == lazy
    extra = {"__version__"} if package == "dduf_plus" else set()
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(set(lazy) | extra)
    assert len(module.__all__) == len(set(module.__all__))


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_export_resolves_to_its_module(package: str) -> None:
    module = importlib.import_module(package)
    for name, where in _lazy_table(package).items():
        value = getattr(module, name)
        assert value is getattr(importlib.import_module(where), name), name
        assert name in dir(module)
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


def test_refs_all_is_what_it_imports() -> None:
    imported = {alias.asname or alias.name for node in _tree("dduf_plus.refs").body
                if isinstance(node, ast.ImportFrom) and node.level == 1 for alias in node.names}
    refs = importlib.import_module("dduf_plus.refs")
    assert sorted(refs.__all__) == sorted(imported)
    for name in refs.__all__:
        assert getattr(refs, name) is not None


def test_cli_pack_and_the_exported_pack_are_one() -> None:
    from dduf_plus.packing import pack

    assert dduf_plus.pack is pack
    assert issubclass(dduf_plus.DDUFEntryNotFoundError, dduf_plus.DDUFError)
    assert issubclass(dduf_plus.DDUFEntryNotFoundError, KeyError)


def test_import_and_format_exports_import_no_torch() -> None:
    code = (
        "import sys, dduf_plus, dduf_plus.loading, dduf_plus.refs\n"
        "assert 'torch' not in sys.modules, 'import dduf_plus'\n"
        "from dduf_plus import (DDUFArchive, DDUFWriter, pack_folder, validate, ValidationReport, DDUFError,\n"
        "    DDUFEntryNotFoundError)\n"
        "heavy = sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_py_typed_is_installed() -> None:
    assert importlib.resources.files("dduf_plus").joinpath("py.typed").is_file()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the test extra's tomli
        import tomli as tomllib
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["dduf_plus"]


def test_py_typed_ships_in_the_wheel(tmp_path: Path) -> None:
    if importlib.util.find_spec("setuptools") is None:  # Python >= 3.12 venvs come without it
        pytest.skip("no setuptools in this environment to build a wheel offline")
    # Built from a copy: setuptools writes build/ and *.egg-info beside pyproject.toml.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "dduf_plus", src / "dduf_plus", ignore=shutil.ignore_patterns("__pycache__"))
    assert (src / "dduf_plus" / "py.typed").is_file()
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("dduf_plus-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "dduf_plus/py.typed" in names
    assert "dduf_plus/loading/__init__.py" in names


@pytest.mark.parametrize("ending", ["close", "abort"])
def test_writer_refuses_entries_once_closed(tmp_path: Path, ending: str) -> None:
    from dduf_plus.errors import DDUFUsageError
    from dduf_plus.format.writer import DDUFWriter

    source = tmp_path / "config.json"
    source.write_bytes(b"{}")
    writer = DDUFWriter(tmp_path / "out.dduf")
    assert writer.add_bytes("model_index.json", b"{}") is None  # records come from .records
    getattr(writer, ending)()
    attempts = [
        lambda: writer.add_bytes("unet/config.json", b"{}"),
        lambda: writer.add_file("unet/config.json", source),
        lambda: writer.add_chunks("unet/config.json", 2, [b"{}"]),
        lambda: writer.hash_ahead([("unet/config.json", source)]),
    ]
    for attempt in attempts:
        with pytest.raises(DDUFUsageError, match=r"'unet/config.json'.*closed"):
            attempt()
    assert writer.close() == writer.path  # closing twice stays harmless
    assert (tmp_path / "out.dduf").exists() == (ending == "close")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_local_dir_refuses_a_tokenizer_file_over_max_local_file(tmp_path: Path, hf_env: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """MAX_LOCAL_FILE is enforced: tokenizer/processor files are copied out of an archive into the cache only
    up to it, checked on the entry's size before any byte is read."""
    from dduf_plus.errors import DDUFLoadError
    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.format.writer import DDUFWriter
    from dduf_plus.loading import files as files_mod

    archive_path = tmp_path / "tok.dduf"
    with DDUFWriter(archive_path) as w:
        w.add_bytes("model_index.json", b'{"_class_name": "X", "tokenizer": ["transformers", "CLIPTokenizer"]}')
        w.add_bytes("tokenizer/tokenizer_config.json", b"{}")
        w.add_bytes("tokenizer/vocab.json", b'{"a": 0}' + b" " * 4000)
    monkeypatch.setattr(files_mod, "MAX_LOCAL_FILE", 1024)
    read: list[str] = []
    with DDUFArchive(archive_path) as archive:
        component = files_mod.ArchiveComponentFiles(archive, "tokenizer")
        monkeypatch.setattr(component, "read_bytes", lambda name: read.append(name) or archive.read_bytes(f"tokenizer/{name}"))
        with pytest.raises(DDUFLoadError, match=r"tokenizer.*vocab\.json is 4008 bytes.*at most 1\.0 KiB"):
            component.local_dir()
        assert "vocab.json" not in read  # refused on its recorded size, never read
        folder = Path(component.local_dir(["tokenizer_config.json"]))
        assert (folder / "tokenizer_config.json").read_bytes() == b"{}"


def test_apply_fp8_storage_casts_exactly_the_recorded_layers() -> None:
    """docs/precision.md documents packing.convert.apply_fp8_storage as API: kept, and tested here."""
    import torch

    from dduf_plus.packing.convert import apply_fp8_storage

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    record = {"storage_dtype": "float8_e4m3fn", "compute_dtype": "float32",
              "layerwise_casting": {"skip_modules_pattern": [r"^1$"]}}
    assert apply_fp8_storage(model, record) is model
    assert model[0].weight.dtype == torch.float8_e4m3fn  # stored fp8
    assert model[1].weight.dtype == torch.float32  # skipped by the recorded pattern
    out = model(torch.ones(2, 4))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert model[0].weight.dtype == torch.float8_e4m3fn  # back to fp8 after the forward


def test_every_cli_command_has_its_module() -> None:
    from dduf_plus.cli import COMMANDS

    for name, (module, _help) in COMMANDS.items():
        assert importlib.util.find_spec(f"dduf_plus.cli.{module}") is not None, name
        assert "def register(" in (ROOT / "dduf_plus" / "cli" / f"{module}.py").read_text(encoding="utf-8"), name
