"""Shared test setup: offline Hub, the committed fixture pipelines, archives packed from them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "fixtures" / "pipelines"
HOSTILE = ROOT / "fixtures" / "hostile"
FIXTURE_NAMES = ("tiny-sd", "tiny-sd-finetune", "tiny-dit")


@pytest.fixture(scope="session")
def pipelines_dir() -> Path:
    return PIPELINES


@pytest.fixture(scope="session")
def bnb_sd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD pipeline whose UNet bitsandbytes runs in 4 bits on every CPU path (tests/bnb_shapes.py)."""
    from bnb_shapes import build_bnb_ready_sd

    return build_bnb_ready_sd(PIPELINES / "tiny-sd", tmp_path_factory.mktemp("bnb-sd") / "tiny-sd-64")


@pytest.fixture(scope="session")
def packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each fixture pipeline packed once per session with dduf_plus: {name: archive path}."""
    from dduf_plus.format.pack import pack_folder

    out = tmp_path_factory.mktemp("packed")
    return {name: pack_folder(PIPELINES / name, out / f"{name}.dduf", quiet=True).path for name in FIXTURE_NAMES}


# --- shared by the partial-model, reference and interop tests -------------------------------------------
@pytest.fixture
def hf_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty fake Hugging Face cache and a private dduf_plus cache; offline."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "dduf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def npm_checker_dir() -> Path | None:
    """Where ``@huggingface/dduf`` is installed (``.ci/run`` puts it in .ci/node), or None."""
    for candidate in (os.environ.get("DDUF_NPM_CHECKER_DIR"), ROOT / ".ci" / "node"):
        if candidate and (Path(candidate) / "node_modules" / "@huggingface" / "dduf").is_dir():
            return Path(candidate)
    return None


_NODE_CHECK = """
const {checkDDUF} = require("@huggingface/dduf");
const fs = require("fs");
(async () => {
  const blob = new Blob([fs.readFileSync(process.argv[1])]);
  const names = [];
  for await (const e of checkDDUF(blob)) names.push(e.name);
  console.log(JSON.stringify(names));
})().catch(e => { console.error(String((e && e.message) || e)); process.exit(1); });
"""


def npm_available() -> bool:
    return shutil.which("node") is not None and npm_checker_dir() is not None


def npm_check(archive: Path) -> subprocess.CompletedProcess | None:
    """Run the npm ``@huggingface/dduf`` checker on ``archive`` (stdout: the JSON list of entry names), or
    None when node or the package is absent."""
    if not npm_available():
        return None
    return subprocess.run(["node", "-e", _NODE_CHECK, str(archive)], capture_output=True, text=True,
                          cwd=npm_checker_dir(), timeout=120)


def load_make_hostile():
    """fixtures/hostile/make_hostile.py as a module (its archive builders are the tests' too); loaded once."""
    import importlib.util
    import sys

    module = sys.modules.get("make_hostile")
    if module is None:
        module_spec = importlib.util.spec_from_file_location("make_hostile", HOSTILE / "make_hostile.py")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules["make_hostile"] = module
        module_spec.loader.exec_module(module)
    return module


SLOW_TESTS = ROOT / "tests" / "slow_tests.txt"


def slow_prefixes() -> list[str]:
    """The node ids (or their starts) tests/slow_tests.txt lists: the tests the fast lane leaves out."""
    lines = (line.strip() for line in SLOW_TESTS.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def is_slow(nodeid: str, prefixes: list[str]) -> bool:
    """Whether ``nodeid`` is a listed file, test, or test with any of its parameters."""
    return any(nodeid == p or nodeid.startswith((p + "::", p + "[")) for p in prefixes)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `slow` what tests/slow_tests.txt lists, so `pytest -m "not slow"` is the fast lane."""
    prefixes = slow_prefixes()
    for item in items:
        if is_slow(item.nodeid, prefixes):
            item.add_marker(pytest.mark.slow)


# --- app model folders (tests/test_model_dirs_*.py: `pytestmark = pytest.mark.usefixtures("app_cache")`) -----
@pytest.fixture
def app_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh dduf_plus cache (hash memory, part maps), no DDUF_PLUS_MODEL_DIRS, the layout readers registered."""
    from dduf_plus.packing.model_dir_layouts import install
    from dduf_plus.refs import model_dirs

    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(model_dirs.ENV, raising=False)
    install()


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files whose tensors are hashed (whole files, and parts of files as ``name:layout``), in order."""
    from dduf_plus.refs import model_dirs, tensor_digest

    seen: list[str] = []
    whole, part = tensor_digest.tensors_digest, model_dirs.part_digest

    def count_whole(files: list[tuple[Path, object]]) -> str:
        seen.extend(p.name for p, _h in files)
        return whole(files)  # type: ignore[arg-type]

    def count_part(path: Path, p: model_dirs.Part) -> str:
        seen.append(f"{path.name}:{p.layout}")
        return part(path, p)

    monkeypatch.setattr(tensor_digest, "tensors_digest", count_whole)
    monkeypatch.setattr(model_dirs, "part_digest", count_part)
    return seen
