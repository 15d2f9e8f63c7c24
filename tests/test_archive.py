"""The reader: strict on open, zero-copy views, tensors sharing the file mapping, foreign archives."""

from __future__ import annotations

import ctypes
import json

import pytest
import torch
from huggingface_hub import export_folder_as_dduf
from huggingface_hub import read_dduf_file as hub_read_dduf_file
from safetensors.torch import load_file

from conftest import PIPELINES
from dduf_plus import read_dduf_file
from dduf_plus.errors import DDUFEntryNotFoundError, DDUFError, DDUFFormatError, DDUFValidationError
from dduf_plus.format.archive import DDUFArchive


def mapping_range(archive: DDUFArchive) -> tuple[int, int]:
    base = ctypes.addressof(ctypes.c_char.from_buffer(archive.mmap))
    return base, base + len(archive.mmap)


def source_tensors(pipeline: str, component: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((PIPELINES / pipeline / component).glob("*.safetensors")):
        if ".fp16." not in f.name:
            out.update(load_file(f))
    return out


@pytest.mark.parametrize("component", ["unet", "vae", "text_encoder"])
def test_tensors_are_views_of_the_mapping(packed, component):
    with DDUFArchive(packed["tiny-sd"]) as archive:
        tensors = archive.tensors(component)
        start, end = mapping_range(archive)
        expected = source_tensors("tiny-sd", component)
        assert tensors.keys() == expected.keys()
        for name, t in tensors.items():
            assert start <= t.data_ptr() < end, name
            assert torch.equal(t, expected[name]), name
            assert t.dtype == expected[name].dtype


def test_entries_and_text(packed):
    with DDUFArchive(packed["tiny-dit"]) as archive:
        assert archive.entry("model_index.json").offset % 64 == 0
        mi = json.loads(archive.read_text("model_index.json"))
        assert mi["_class_name"] == "PixArtAlphaPipeline"
        assert archive.read_json("transformer/config.json")["_class_name"] == "PixArtTransformer2DModel"
        view = archive.view("tokenizer/tokenizer.json")
        assert view.readonly and bytes(view) == (PIPELINES / "tiny-dit/tokenizer/tokenizer.json").read_bytes()
        assert archive.components["tokenizer"].class_name == "T5Tokenizer"
        with pytest.raises(DDUFEntryNotFoundError, match="no entry 'nope.json'"):
            archive.entry("nope.json")
        with pytest.raises(DDUFEntryNotFoundError, match="no component 'nope'"):
            archive.component("nope")


def test_tensors_outlive_close(packed):
    archive = DDUFArchive(packed["tiny-sd"])
    tensors = archive.tensors("vae")
    archive.close()
    assert all(torch.isfinite(t.float()).all() for t in tensors.values())


def test_sharded_and_variant_weight_files(tmp_path):
    from dduf_plus.format.pack import pack_folder

    path = pack_folder(PIPELINES / "tiny-sd", tmp_path / "v.dduf", variant="fp16", quiet=True).path
    with DDUFArchive(path) as archive:
        assert archive.weight_files("unet") == [
            "unet/diffusion_pytorch_model-00001-of-00002.safetensors",
            "unet/diffusion_pytorch_model-00002-of-00002.safetensors",
        ]
        assert archive.weight_files("vae", "fp16") == ["vae/diffusion_pytorch_model.fp16.safetensors"]
        assert {t.dtype for t in archive.tensors("vae", "fp16").values()} == {torch.float16}


def test_foreign_hub_archive_opens_with_derived_index(tmp_path):
    path = tmp_path / "hub.dduf"
    export_folder_as_dduf(path, PIPELINES / "tiny-sd")
    with DDUFArchive(path) as archive:
        assert archive.stored_index is None
        codes = {f.code for f in archive.findings}
        assert "I003" in codes and not [f for f in archive.findings if f.severity == "error"]
        index = archive.index
        assert index["components"]["unet"]["summary"]["dtype"] == "float16"
        for component in ("unet", "vae", "text_encoder"):
            expected = source_tensors("tiny-sd", component)
            got = archive.tensors(component)
            assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_compat_read_dduf_file_matches_huggingface_hub(packed):
    ours, theirs = read_dduf_file(packed["tiny-sd"]), hub_read_dduf_file(packed["tiny-sd"])
    assert ours.keys() == theirs.keys()
    for name, entry in theirs.items():
        assert (ours[name].offset, ours[name].length) == (entry.offset, entry.length)
        with entry.as_mmap() as copy, ours[name].as_mmap() as view:
            assert isinstance(view, memoryview) and bytes(view) == copy
    assert json.loads(ours["model_index.json"].read_text())["_class_name"] == "StableDiffusionPipeline"
    tensors = ours["vae/diffusion_pytorch_model.safetensors"].as_tensors()
    expected = load_file(PIPELINES / "tiny-sd/vae/diffusion_pytorch_model.safetensors")
    assert all(torch.equal(tensors[k], v) for k, v in expected.items())


@pytest.mark.parametrize(
    "payload, code",
    [(b"", "Z001"), (b"not a zip at all" * 10, "Z001"), (b"PK\x05\x06" + b"\x00" * 18, "D001")],
)
def test_refuses_non_archives(tmp_path, payload, code):
    path = tmp_path / "bad.dduf"
    path.write_bytes(payload)
    with pytest.raises(DDUFValidationError) as info:
        DDUFArchive(path)
    assert code in info.value.codes
    assert str(path) in str(info.value)


def test_truncated_archive_is_a_dduf_error(packed, tmp_path):
    raw = packed["tiny-sd"].read_bytes()
    for cut in (len(raw) - 1, len(raw) - 30, len(raw) // 2, 100):
        path = tmp_path / f"cut{cut}.dduf"
        path.write_bytes(raw[:cut])
        with pytest.raises(DDUFError):
            DDUFArchive(path)


def test_missing_file(tmp_path):
    with pytest.raises(DDUFError, match="cannot open"):
        DDUFArchive(tmp_path / "missing.dduf")


def test_read_bytes_ranges_stay_inside_the_entry(packed):
    with DDUFArchive(packed["tiny-sd"]) as archive:
        whole = archive.read_bytes("unet/config.json")
        assert archive.read_bytes("unet/config.json", 4, 13) == whole[4:17]
        assert archive.read_bytes("unet/config.json", 5) == whole[5:]
        assert archive.read_bytes("unet/config.json", len(whole), 0) == b""
        for offset, length in ((-1, 2), (0, len(whole) + 1), (len(whole), 1)):
            with pytest.raises(DDUFFormatError, match="outside entry 'unet/config.json'"):
                archive.read_bytes("unet/config.json", offset, length)
