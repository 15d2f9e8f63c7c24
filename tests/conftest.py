"""Shared test setup: offline Hub, the committed fixture pipelines, archives packed from them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "fixtures" / "pipelines"
FIXTURE_NAMES = ("tiny-sd", "tiny-sd-finetune", "tiny-dit")


@pytest.fixture(scope="session")
def pipelines_dir() -> Path:
    return PIPELINES


@pytest.fixture(scope="session")
def packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each fixture pipeline packed once per session with dduf_plus: {name: archive path}."""
    from dduf_plus.format.pack import pack_folder

    out = tmp_path_factory.mktemp("packed")
    return {name: pack_folder(PIPELINES / name, out / f"{name}.dduf", quiet=True).path for name in FIXTURE_NAMES}
