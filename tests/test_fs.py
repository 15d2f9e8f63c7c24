"""DDUFFileSystem: the archive as a read-only fsspec file system (protocol "dduf")."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from dduf_plus.format.archive import DDUFArchive
from dduf_plus.fs import DDUFFileSystem

PIPELINES = Path(__file__).resolve().parent.parent / "fixtures" / "pipelines"


@pytest.fixture(scope="module")
def archive_path(tmp_path_factory) -> Path:
    from dduf_plus.format.pack import pack_folder

    return pack_folder(PIPELINES / "tiny-sd", tmp_path_factory.mktemp("fs") / "sd.dduf", quiet=True).path


def test_protocol_is_registered():
    assert fsspec.get_filesystem_class("dduf") is DDUFFileSystem


def test_open_with_fo_and_chained_url(archive_path):
    expected = (PIPELINES / "tiny-sd" / "unet" / "config.json").read_bytes()
    with fsspec.open("dduf://unet/config.json", fo=str(archive_path), mode="rt") as f:
        assert json.load(f)["_class_name"] == "UNet2DConditionModel"
    with fsspec.open(f"dduf://unet/config.json::file://{archive_path}", mode="rb") as f:
        assert f.read() == expected
    with fsspec.open(f"dduf://tokenizer/merges.txt::{archive_path}", mode="rt") as f:
        assert f.readline() == "#version: 0.2\n"


def test_listing_and_info(archive_path):
    fs = DDUFFileSystem(archive_path)
    top = fs.ls("", detail=False)
    assert "model_index.json" in top and "unet" in top and "dduf_plus.index.json" in top
    assert fs.ls("/unet", detail=False) == sorted(f"unet/{n}" for n in DDUFArchive(archive_path).component("unet").files)
    info = fs.info("unet/config.json")
    assert info["type"] == "file" and info["size"] == (PIPELINES / "tiny-sd" / "unet" / "config.json").stat().st_size
    assert info["sha256"] and info["crc32"] and info["offset"] > 0
    assert fs.info("unet")["type"] == "directory" and fs.isdir("vae") and fs.isfile("model_index.json")
    assert not fs.exists("unet/nope.json")
    with pytest.raises(FileNotFoundError):
        fs.info("missing")
    assert "vae/config.json" in fs.glob("*/config.json")
    assert set(fs.find("scheduler")) == {"scheduler/scheduler_config.json"}
    assert fs.cat("model_index.json") == (PIPELINES / "tiny-sd" / "model_index.json").read_bytes()


def test_files_are_zero_copy_and_seekable(archive_path):
    fs = DDUFFileSystem(archive_path)
    data = (PIPELINES / "tiny-sd" / "tokenizer" / "vocab.json").read_bytes()
    with fs.open("tokenizer/vocab.json") as f:
        assert isinstance(f.getbuffer(), memoryview) and f.getbuffer().readonly
        assert f.getbuffer() == data
        f.seek(10)
        assert f.read(5) == data[10:15] and f.tell() == 15
        buf = bytearray(7)
        assert f.readinto(buf) == 7 and bytes(buf) == data[15:22]
        f.seek(-3, io.SEEK_END)
        assert f.read() == data[-3:] and f.read() == b""
    with pytest.raises(ValueError):
        f.read()
    # safetensors entries open too (fsspec-aware readers stream weights out of the archive)
    with fs.open("unet/diffusion_pytorch_model-00001-of-00002.safetensors") as f:
        assert int.from_bytes(f.read(8), "little") > 0


def test_read_only(archive_path):
    fs = DDUFFileSystem(archive_path)
    with pytest.raises(OSError):
        fs.open("unet/config.json", "wb")
    with pytest.raises(ValueError):
        DDUFFileSystem(archive_path, mode="w")


def test_file_object_and_archive_sources(archive_path):
    with open(archive_path, "rb") as raw:
        fs = DDUFFileSystem(raw)
        assert json.loads(fs.cat("model_index.json"))["_class_name"] == "StableDiffusionPipeline"
        with fs.open("unet/config.json") as f:  # no mmap: served by range reads
            f.seek(4)
            assert f.read(13) == b'"_class_name"'
    with DDUFArchive(archive_path) as archive:
        assert DDUFFileSystem(archive).cat("vae/config.json") == archive.read_bytes("vae/config.json")


def test_no_torch_import():
    code = ("import sys, dduf_plus.fs, fsspec; "
            "print('torch' in sys.modules, 'diffusers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
