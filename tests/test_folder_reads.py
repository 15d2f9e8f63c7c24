"""Folder files read from Python: a file changed, grown or swapped for a FIFO after the folder was scanned is
refused with a DDUFError (never read without end, never waited on)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import PIPELINES
from dduf_plus.errors import DDUFError, DDUFFormatError, DDUFIOError
from dduf_plus.loading.files import FolderComponentFiles
from dduf_plus.loading.folder_source import FolderPipeline


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return Path(shutil.copytree(PIPELINES / "tiny-sd", tmp_path / "tiny-sd"))


def test_a_folder_file_changed_after_the_scan_is_refused(folder: Path) -> None:
    pipeline = FolderPipeline(folder)
    config = json.loads(pipeline.read_bytes("vae/config.json"))
    (folder / "vae" / "config.json").write_text(json.dumps({**config, "pad": "x" * 100}))
    with pytest.raises(DDUFIOError, match="vae/config.json changed since the folder was scanned"):
        pipeline.read_bytes("vae/config.json")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_put_in_a_scanned_file_s_place_is_refused_without_blocking(folder: Path) -> None:
    pipeline = FolderPipeline(folder)
    target = folder / "vae" / "config.json"
    target.unlink()
    os.mkfifo(target)
    with pytest.raises(DDUFIOError, match="no longer a regular file"):
        pipeline.read_bytes("vae/config.json")


def test_a_json_file_that_grows_past_its_stat_is_refused(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget is checked on the bytes read too: a file that grew between the stat and the read (here a stat
    that says 100 bytes) is D013, not parsed."""
    import dduf_plus.loading.files as files_module

    big = folder / "vae" / "config.json"
    big.write_text(json.dumps({"_class_name": "AutoencoderKL", "pad": "x" * (20 << 20)}))
    files = FolderComponentFiles(folder / "vae", "vae")
    real_stat = os.stat
    monkeypatch.setattr(files_module.os, "stat",
                        lambda p, *a, **k: os.stat_result((*real_stat(p)[:6], 100, *real_stat(p)[7:])))
    with pytest.raises(DDUFFormatError, match="D013"):
        files.read_json("config.json")
    monkeypatch.undo()
    with pytest.raises(DDUFError, match="D013"):  # and with the true stat, refused before it is read
        files.read_json("config.json")
