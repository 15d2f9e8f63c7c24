"""Fake Hugging Face caches for the reference tests (test_refs_resolve, test_complete, test_hf_cache_layouts):
one copy of each helper. The cache itself is ``dduf_plus.refs.cache.add_to_hf_cache`` (what huggingface_hub
writes: blobs, snapshots, refs; test_hf_cache_layouts checks huggingface_hub reads it back)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dduf_plus.refs import cache as refs_cache
from dduf_plus.refs.cache import add_to_hf_cache

ROOT = Path(__file__).resolve().parent.parent
TINY_SD = ROOT / "fixtures" / "pipelines" / "tiny-sd"
REPO = "org/tiny-sd"
LAYOUTS = {"symlinks": "copy", "real-files": "none"}  # huggingface_hub's two layouts -> add_to_hf_cache(link=)


def cached(hf_env: Path, source: Path = TINY_SD, repo: str = REPO, layout: str = "symlinks", **kwargs) -> Path:
    """``source`` as snapshot of ``repo`` in the fake cache ``hf_env`` (see conftest.hf_env); its folder."""
    return add_to_hf_cache(source, repo, cache_dir=hf_env, link=LAYOUTS[layout], **kwargs)


def count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path dduf_plus.refs hashes with sha256 from now on, in order."""
    hashed: list[str] = []
    real = refs_cache.sha256_file

    def counting(path):
        hashed.append(str(path))
        return real(path)

    monkeypatch.setattr(refs_cache, "sha256_file", counting)
    return hashed


def corrupted_copy(tmp_path: Path, component: str, filename: str, source: Path = TINY_SD) -> Path:
    """``source`` with one byte of ``component/filename`` flipped (same size, same name)."""
    bad = tmp_path / "bad-sd"
    shutil.copytree(source, bad)
    target = bad / component / filename
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    return bad
