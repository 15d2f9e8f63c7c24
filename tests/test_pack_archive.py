"""``dduf pack IN.dduf ...``: an archive is re-packed without unpacking (re-based into a partial one, converted,
quantized, components excluded or referenced) by the rules of a folder, and the output is the one packing the
folder the archive was made from gives, byte for byte. The input is hostile: structure checked first, bytes
copied checked against its own CRC-32 and sha256; the output may not be the input."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from test_partial_content import FROZEN_SD, TINY_SD, assert_loads_like_folder, finetune

from dduf_plus.cli import main
from dduf_plus.errors import DDUFError, DDUFPackError, DDUFUsageError, DDUFValidationError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.validate import validate
from dduf_plus.packing.pack import pack

QUANT = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None or importlib.util.find_spec("torchao")
                           is None, reason="torchao / bitsandbytes are not installed here (pip install -e '.[quant]')")


@pytest.fixture(scope="module")
def sd_ft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trainer's folder: tiny SD loaded (fp32 by diffusers' default), UNet changed, save_pretrained."""
    return finetune(TINY_SD, tmp_path_factory.mktemp("ft") / "tiny-sd-ft")


@pytest.fixture(scope="module")
def full(sd_ft: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The complete archive of the trainer's folder (what a trainer shipped before partial packs)."""
    return pack(sd_ft, tmp_path_factory.mktemp("full") / "ft-full.dduf", quiet=True)[0].path


def both(source_archive: Path, folder: Path, tmp_path: Path, **kwargs: Any) -> tuple[Path, Path, Any, Any]:
    """The archive route and the folder route of the same pack: (from archive, from folder, their partial plans)."""
    a, b = tmp_path / "from-archive.dduf", tmp_path / "from-folder.dduf"
    _, pa = pack(source_archive, a, quiet=True, **kwargs)
    _, pb = pack(folder, b, quiet=True, **kwargs)
    return a, b, pa, pb


def test_rebase_a_complete_archive(full: Path, sd_ft: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every component but the changed UNet referenced to BASE; the same bytes and report as packing the folder."""
    with caplog.at_level(logging.INFO, logger="dduf_plus"):
        a, b, pa, pb = both(full, sd_ft, tmp_path, base=str(TINY_SD))
    assert a.read_bytes() == b.read_bytes()
    assert pa.report == pb.report and pa.bytes_saved == pb.bytes_saved > 0
    assert any(line.startswith("referenced vae -> ") and "same content" in line for line in pa.report), pa.report
    with DDUFArchive(a) as archive:
        assert set(archive.references) == FROZEN_SD
        assert {n.split("/")[0] for n in archive.entries if "/" in n} == {"unet"}
    assert a.stat().st_size < full.stat().st_size
    assert validate(a, verify=True).valid
    assert_loads_like_folder(a, sd_ft)


def test_nothing_is_extracted(full: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries are regions of the input: no temporary folder, no file written but the output's own temp file."""
    import tempfile

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a temporary folder was made")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    monkeypatch.setattr(tempfile, "TemporaryDirectory", refuse)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    pack(full, out_dir / "x.dduf", quiet=True, exclude=["vae"])
    assert sorted(os.listdir(out_dir)) == ["x.dduf"]


def test_redtype_fp32_archive_to_fp16(full: Path, sd_ft: Path, tmp_path: Path) -> None:
    a, b, _, _ = both(full, sd_ft, tmp_path, dtype="float16")
    assert a.read_bytes() == b.read_bytes()
    with DDUFArchive(a) as archive:
        assert {i.dtype for i in archive.headers["unet/diffusion_pytorch_model.safetensors"].tensors.values()} == \
            {"float16"}
        assert archive.index["components"]["unet"]["dtype_conversion"]["from"] == "float32"
    assert validate(a, verify=True).valid


@QUANT
@pytest.mark.parametrize("scheme", ["bnb-nf4", "torchao-int8"])
def test_requantize_the_unet_of_an_archive(bnb_sd: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           scheme: str) -> None:
    """Quantized from the archive's entries, equal to quantizing from the folder (tensor for tensor, index
    record included; torchao's __metadata__ key order is safetensors' hash order)."""
    from test_quant_save import assert_same_archive, bnb_cpu_gate

    bnb_cpu_gate(monkeypatch)
    source = pack(bnb_sd, tmp_path / "full.dduf", quiet=True)[0].path
    a, b, _, _ = both(source, bnb_sd, tmp_path, quantize={"unet": scheme})
    assert_same_archive(a, b)
    with DDUFArchive(a) as archive:
        assert archive.index["components"]["unet"]["quantization"]["quantized"] > 10
    report = validate(a, verify=True, strict=True)
    assert report.valid and not report.codes, str(report)


def test_exclude_and_ref(full: Path, sd_ft: Path, tmp_path: Path) -> None:
    a, b, pa, _ = both(full, sd_ft, tmp_path, exclude=["vae"])
    assert a.read_bytes() == b.read_bytes()
    assert pa.references["vae"]["pretrained_model_name_or_path"] is None and pa.references["vae"]["files"]
    shutil.rmtree(tmp_path / "x", ignore_errors=True)
    (tmp_path / "x").mkdir()
    a, b, pa, _ = both(full, sd_ft, tmp_path / "x", refs={"text_encoder": str(TINY_SD)})
    assert a.read_bytes() == b.read_bytes()  # --ref checked by content against the archive's entries
    assert set(pa.references) == {"text_encoder"}


def test_a_partial_input_keeps_its_references(sd_ft: Path, tmp_path: Path) -> None:
    partial = pack(sd_ft, tmp_path / "partial.dduf", quiet=True, base=str(TINY_SD))[0].path
    with DDUFArchive(partial) as archive:
        before = archive.references
    plain = pack(partial, tmp_path / "plain.dduf", quiet=True)[0].path
    assert plain.read_bytes() == partial.read_bytes()  # a re-pack with nothing to change is the same archive
    fp16 = pack(partial, tmp_path / "fp16.dduf", quiet=True, dtype="float16")[0].path
    more, plan = pack(partial, tmp_path / "more.dduf", quiet=True, exclude=["unet"])
    for path in (fp16, more.path):
        with DDUFArchive(path) as archive:
            kept = {n: r for n, r in archive.references.items() if n != "unet"}
        assert kept == before
        assert validate(path).valid
    assert any(line == "kept the existing reference of vae" for line in plan.report), plan.report
    _, same = pack(partial, tmp_path / "same.dduf", quiet=True, exclude=["vae", "unet"])  # vae: excluded already
    assert same.references["vae"] == before["vae"]
    with pytest.raises(DDUFPackError, match="stored as a reference"):
        pack(partial, tmp_path / "no.dduf", quiet=True, dtype={"vae": "float16"})
    _, moved = pack(partial, tmp_path / "moved.dduf", quiet=True, refs={"vae": str(sd_ft)})  # --ref replaces one
    assert moved.references["vae"]["pretrained_model_name_or_path"] == str(sd_ft)
    assert {n: r for n, r in moved.references.items() if n != "vae"} == {n: r for n, r in before.items() if n != "vae"}
    _loads_as_folder_cast(fp16, sd_ft)


def _loads_as_folder_cast(archive: Path, folder: Path) -> None:
    """The archive loads (its references resolved) with its UNet the fp16 cast of the folder's, the rest equal."""
    import torch
    from diffusers import DiffusionPipeline

    from dduf_plus import load_dduf

    ours, theirs = load_dduf(archive), DiffusionPipeline.from_pretrained(folder)
    for name in ("unet", "vae", "text_encoder"):
        a, b = getattr(ours, name).state_dict(), getattr(theirs, name).state_dict()
        cast = torch.float16 if name == "unet" else None
        assert set(a) == set(b) and all(torch.equal(a[k], b[k].to(cast or b[k].dtype)) for k in a), name


def test_the_original_model_index_text_survives_a_repack(sd_ft: Path, tmp_path: Path) -> None:
    """A partial packed from a non-canonical model_index.json records its text (for dduf complete); re-packed with
    another reference, the record stays."""
    folder = tmp_path / "ft"
    shutil.copytree(sd_ft, folder)
    index = folder / "model_index.json"
    index.write_text(json.dumps(json.loads(index.read_text()), indent=4))
    partial = pack(folder, tmp_path / "partial.dduf", quiet=True, base=str(TINY_SD))[0].path
    again = pack(partial, tmp_path / "again.dduf", quiet=True, exclude=["unet"])[0].path
    with DDUFArchive(partial) as a, DDUFArchive(again) as b:
        recorded = a.model_index["_dduf_plus_original_model_index"]
        assert recorded["text"] == index.read_text()
        assert b.model_index["_dduf_plus_original_model_index"] == recorded


def test_same_path_is_refused(full: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "in.dduf"
    shutil.copyfile(full, copy)
    data = copy.read_bytes()
    with pytest.raises(DDUFUsageError, match="is the input archive"):
        pack(copy, copy, quiet=True, dtype="float16")
    link = tmp_path / "link.dduf"
    os.link(copy, link)
    with pytest.raises(DDUFUsageError, match="is the input archive"):
        pack(copy, link, quiet=True)
    assert main(["pack", str(copy), "-o", str(copy), "-f", "--quiet"]) != 0
    assert "is the input archive" in capsys.readouterr().err
    assert main(["pack", str(copy), "-o", f"{tmp_path}/", "--quiet"]) != 0  # DIR/ names the same file
    assert copy.read_bytes() == data


def test_cli_says_what_a_folder_pack_says(full: Path, sd_ft: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str],
                                          caplog: pytest.LogCaptureFixture) -> None:
    assert main(["pack", str(full), "-o", str(tmp_path / "a.dduf"), "--base", str(TINY_SD), "-q"]) == 0
    assert main(["pack", str(sd_ft), "-o", str(tmp_path / "b.dduf"), "--base", str(TINY_SD), "-q"]) == 0
    assert (tmp_path / "a.dduf").read_bytes() == (tmp_path / "b.dduf").read_bytes()
    capsys.readouterr()
    caplog.set_level(logging.INFO, logger="dduf_plus")
    caplog.clear()
    assert main(["pack", str(full), "-o", str(tmp_path / "c.dduf"), "--base", str(TINY_SD)]) == 0
    def said() -> list[str]:  # the report is logged (stderr, once), skipped files and "wrote" on stdout
        out = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("wrote ")]
        logged = [r.getMessage() for r in caplog.records if r.name.startswith("dduf_plus")]
        caplog.clear()
        return out + logged

    lines = said()
    assert main(["pack", str(sd_ft), "-o", str(tmp_path / "d.dduf"), "--base", str(TINY_SD)]) == 0
    assert lines == said()
    assert any(line.startswith("referenced tokenizer -> ") for line in lines), lines


# --- hostile input archives ---------------------------------------------------------------------------------------
def _entry_offset(path: Path, name: str) -> tuple[int, int]:
    with DDUFArchive(path) as archive:
        e = archive.entry(name)
        return e.offset, e.length


def _patched(src: Path, dst: Path, at: int, data: bytes) -> Path:
    raw = bytearray(src.read_bytes())
    raw[at : at + len(data)] = data
    dst.write_bytes(bytes(raw))
    return dst


def test_a_broken_structure_is_refused_before_any_work(full: Path, tmp_path: Path) -> None:
    """A safetensors header whose length points past its entry: one error naming the entry and the rule."""
    offset, _ = _entry_offset(full, "vae/diffusion_pytorch_model.safetensors")
    bad = _patched(full, tmp_path / "bad.dduf", offset, struct.pack("<Q", 1 << 40))
    with pytest.raises(DDUFValidationError) as info:
        pack(bad, tmp_path / "out.dduf", quiet=True, base=str(TINY_SD))
    assert "vae/diffusion_pytorch_model.safetensors" in str(info.value) and info.value.codes
    assert not (tmp_path / "out.dduf").exists()


def test_damaged_bytes_are_never_copied_silently(full: Path, tmp_path: Path) -> None:
    """Tensor bytes changed (structure intact): the CRC-32 the archive records catches it while copying (H001), the
    sha256 of its index when the entry is read to be converted or referenced (H002); nothing is written."""
    offset, length = _entry_offset(full, "vae/diffusion_pytorch_model.safetensors")
    raw = full.read_bytes()
    bad = _patched(full, tmp_path / "bad.dduf", offset + length - 4, bytes(b ^ 0xFF for b in raw[offset + length - 4:
                                                                                              offset + length]))
    with pytest.raises(DDUFPackError, match="H001"):
        pack(bad, tmp_path / "copy.dduf", quiet=True, exclude=["unet"])
    with pytest.raises(DDUFError, match="H002"):
        pack(bad, tmp_path / "ref.dduf", quiet=True, exclude=["vae"])  # the reference records the entry's hash
    with pytest.raises(DDUFPackError, match="H002"):
        pack(bad, tmp_path / "conv.dduf", quiet=True, dtype={"vae": "float16"})
    assert not [p for p in tmp_path.iterdir() if p.name != "bad.dduf"]


def test_not_an_archive_is_said_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.dduf.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 16)
    with pytest.raises(DDUFPackError, match="dduf decompress first"):
        pack(tmp_path / "x.dduf.zst", tmp_path / "out.dduf", quiet=True)
    assert main(["pack", str(tmp_path / "x.dduf.zst"), "-o", str(tmp_path / "out.dduf"), "-q"]) != 0
    assert "dduf decompress first" in capsys.readouterr().err
    junk = tmp_path / "junk.dduf"
    junk.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(DDUFError):
        pack(junk, tmp_path / "out.dduf", quiet=True)
    assert main(["pack", str(junk), "-o", str(tmp_path / "out.dduf"), "-q"]) != 0
    assert not (tmp_path / "out.dduf").exists()


def test_an_archive_huggingface_hub_wrote_becomes_the_folders_pack(tmp_path: Path) -> None:
    """A foreign archive (unaligned, no dduf_plus index: only its ZIP CRC-32s to check the copies against) re-packed
    is the aligned, indexed archive the folder it came from packs into."""
    from huggingface_hub import export_folder_as_dduf

    export_folder_as_dduf(tmp_path / "hub.dduf", TINY_SD)
    a, b = tmp_path / "a.dduf", tmp_path / "b.dduf"
    pack(tmp_path / "hub.dduf", a, quiet=True)
    pack(TINY_SD, b, quiet=True)
    assert a.read_bytes() == b.read_bytes()
    with DDUFArchive(tmp_path / "hub.dduf") as foreign:
        assert foreign.stored_index is None
