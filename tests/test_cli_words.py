"""Every input gets the right words (issue 19): findings grouped by rule for people, `dduf info` of a
.dduf.zst, non-ZIP inputs named for what they are, `dduf refs`/`dduf info` reference lines, info's table."""

from __future__ import annotations

from pathlib import Path

import pytest

from dduf_plus.cli import main as cli_main
from dduf_plus.format.findings import finding, group_findings

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "fixtures" / "pipelines"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- findings grouped by rule --------------------------------------------------------------------------
def test_group_findings_lists_each_entry_once_in_order() -> None:
    items = [finding("Z018", "b", "entry has no ZIP64 extra field"), finding("I003", None, "no index"),
             finding("Z018", "a", "entry has no ZIP64 extra field"),
             {"code": "Z018", "entry": "b", "message": "entry has no ZIP64 extra field"}]  # a report dict too
    groups = group_findings(items)
    assert [(g.code, g.severity, g.entries) for g in groups] == [("Z018", "info", ["b", "a"]),
                                                                 ("I003", "info", [])]
    assert groups[0].message == "entry has no ZIP64 extra field" and groups[0].same_message
    assert len(groups[0].findings) == 3  # nothing dropped: every finding stays in its group


def test_group_findings_with_differing_messages_keeps_each_message() -> None:
    groups = group_findings([finding("S008", "x", "starts at 1"), finding("S008", "y", "starts at 2")])
    assert len(groups) == 1 and not groups[0].same_message
    assert groups[0].message.startswith("tensor data section not page-aligned")  # the rule's title
    assert [f.message for f in groups[0].findings] == ["starts at 1", "starts at 2"]


def test_validate_prints_a_repeated_rule_once_and_json_keeps_every_finding(capsys, tmp_path) -> None:
    import json

    from huggingface_hub import export_folder_as_dduf

    hub = tmp_path / "hub.dduf"
    export_folder_as_dduf(hub, PIPELINES / "tiny-sd")  # no ZIP64 extra fields: Z018 on every entry
    code, out, _ = run_cli(capsys, "validate", str(hub))
    assert code == 0
    z018 = [line for line in out.splitlines() if "Z018" in line]
    assert len(z018) == 1 and "entries): entry has no ZIP64 extra field" in z018[0], out
    assert out.count("model_index.json") == 1  # each entry named once
    code, out, _ = run_cli(capsys, "validate", "--json", str(hub))
    infos = json.loads(out)["files"][0]["infos"]  # Z018: a foreign archive, an info
    assert sum(w["code"] == "Z018" for w in infos) >= 10


# --- what a file is, when it is no DDUF archive -----------------------------------------------------------
def _safetensors_bytes() -> bytes:
    return (PIPELINES / "tiny-sd" / "vae" / "diffusion_pytorch_model.safetensors").read_bytes()


def _torch_zip(path: Path) -> None:
    import torch

    torch.save({"w": torch.zeros(2)}, path)


KINDS = {  # file name -> (bytes or a writer, words the finding must hold)
    "model.safetensors": (_safetensors_bytes, "single-file safetensors checkpoint"),
    "model.gguf": (lambda: b"GGUF\x03\x00\x00\x00" + bytes(64), "GGUF file"),
    "old.ckpt": (lambda: b"\x80\x02}q\x00." + bytes(40), "pickle file"),
    "cfg.dduf": (lambda: b'{"_class_name": "StableDiffusionPipeline"}' + b" " * 40, "JSON file"),
    "empty.dduf": (lambda: b"", "empty (0 bytes)"),
    "page.dduf": (lambda: b"<!DOCTYPE html><html><body>Sign in</body></html>", "HTML or XML page"),
    "lfs.dduf": (lambda: b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 3\n", "Git LFS pointer"),
    "renamed.bin": (lambda: b"\x28\xb5\x2f\xfd" + bytes(40), "zstd-compressed stream"),
}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_file_that_is_no_zip_is_named_for_what_it_is(tmp_path: Path, name: str) -> None:
    from dduf_plus.format.validate import validate

    make, words = KINDS[name]
    (tmp_path / name).write_bytes(make())
    report = validate(tmp_path / name)
    assert not report.valid
    (error,) = report.errors
    assert error.code == "Z001" and words in error.message, error.message
    assert "end-of-central-directory" not in error.message


def test_a_truncated_zip_and_an_unknown_file_keep_z001_with_plain_words(tmp_path: Path, packed) -> None:
    from dduf_plus.format.validate import validate

    data = packed["tiny-sd"].read_bytes()
    (tmp_path / "half.dduf").write_bytes(data[: len(data) // 2])
    assert "truncated ZIP archive" in validate(tmp_path / "half.dduf").errors[0].message
    (tmp_path / "noise.dduf").write_bytes(bytes(range(256)) * 4)
    message = validate(tmp_path / "noise.dduf").errors[0].message
    assert "truncated or not a DDUF archive" in message


def test_a_torch_zip_is_one_d001_saying_so(tmp_path: Path) -> None:
    from dduf_plus.format.validate import validate

    _torch_zip(tmp_path / "model.ckpt")
    report = validate(tmp_path / "model.ckpt")
    assert [f.code for f in report.errors] == ["D001"]  # not a ZIP or DDUF error per pickle entry
    assert "PyTorch checkpoint" in report.errors[0].message


def test_a_zst_given_to_a_plain_archive_reader_says_to_decompress(capsys, tmp_path, packed) -> None:
    from dduf_plus.storage.zst import compress

    zst = tmp_path / "sd.dduf.zst"
    compress(packed["tiny-sd"], zst, quiet=True)
    code, _, err = run_cli(capsys, "unpack", str(zst), "-o", str(tmp_path / "out"))
    assert code == 1 and "dduf decompress" in err


# --- dduf info ---------------------------------------------------------------------------------------------
def test_info_reads_a_zst_like_validate(capsys, tmp_path, packed) -> None:
    from dduf_plus.storage.zst import compress

    zst = tmp_path / "sd.dduf.zst"
    compress(packed["tiny-sd"], zst, quiet=True)
    code, out, err = run_cli(capsys, "info", str(zst))
    assert code == 0, err
    assert out.startswith(f"{zst}: StableDiffusionPipeline (archive, ") and "as .zst)" in out
    code, plain, _ = run_cli(capsys, "info", str(packed["tiny-sd"]))
    assert out.splitlines()[1:] == plain.splitlines()[1:]
    code, out, _ = run_cli(capsys, "refs", str(zst))
    assert code == 0 and "no references" in out


def _columns(out: str) -> tuple[str, list[str]]:
    lines = out.splitlines()
    header = next(line for line in lines if "COMPONENT" in line)
    rows = lines[lines.index(header) + 1:]
    return header, [r for r in rows if r.startswith("  ") and not r.startswith("  null") and "would skip" not in r]


def test_info_has_headers_and_fp8_rows_stay_aligned(capsys, tmp_path) -> None:
    from dduf_plus.packing import pack

    out_path = tmp_path / "fp8.dduf"
    pack(PIPELINES / "tiny-sd", out_path, dtype={"unet": "float8_e4m3fn", "default": "bfloat16"}, quiet=True)
    code, out, _ = run_cli(capsys, "info", str(out_path))
    header, rows = _columns(out)
    assert header.split() == ["COMPONENT", "CLASS", "DTYPE", "PARAMS", "SIZE", "NOTES"]
    for column in ("CLASS", "DTYPE", "PARAMS", "SIZE"):
        at = header.index(column)
        assert all(r[at - 1] == " " and r[at] != " " for r in rows), (column, out)  # every cell starts there
    unet = next(r for r in rows if r.split()[0] == "unet")
    assert "float8_e4m3fn" in unet and "stored float8_e4m3fn, computes float16" in unet
    assert "GiB" not in out and "MiB" not in out and "kB" in out  # decimal units, one convention


def test_info_tags_a_quanto_component(capsys, tmp_path) -> None:
    import shutil

    folder = tmp_path / "q"
    shutil.copytree(PIPELINES / "tiny-dit", folder)
    (folder / "transformer" / "quanto_qmap.json").write_text('{"proj_out": {"weights": "qint8", "activations": "none"}}')
    _, out, _ = run_cli(capsys, "info", str(folder))
    assert "quantized: optimum-quanto" in next(r for r in out.splitlines() if r.split()[:1] == ["transformer"])
    from dduf_plus.packing import pack

    pack(folder, tmp_path / "q.dduf", quiet=True)  # pack records the map in the index
    _, out, _ = run_cli(capsys, "info", str(tmp_path / "q.dduf"))
    assert "quantized: optimum-quanto (qint8)" in out


def test_info_and_refs_say_where_a_reference_comes_from(capsys, tmp_path) -> None:
    from dduf_plus.packing.partial import pack_partial

    nosource = tmp_path / "nosource.dduf"
    pack_partial(PIPELINES / "tiny-sd", nosource, exclude=["vae"], quiet=True)
    hub = tmp_path / "hub.dduf"
    pack_partial(PIPELINES / "tiny-sd", hub, exclude=["vae"], refs={"*": "org/base@v1"}, quiet=True)
    _, out, _ = run_cli(capsys, "info", str(nosource))
    assert "(must be passed" not in out and "no source recorded: pass it when loading" in out
    _, out, _ = run_cli(capsys, "info", str(hub))
    assert "referenced: org/base@v1:vae (Hub repo)" in out
    code, out, _ = run_cli(capsys, "refs", str(nosource))
    assert code == 1
    after = out.split("UNRESOLVED", 1)[1]
    assert "no recorded source" in after  # the reason, not an empty "-> UNRESOLVED:"
    code, out, _ = run_cli(capsys, "refs", str(hub))
    assert "To fix: " in out and "To fix: or" not in out and "(1 files" not in out and "2 files" in out



def test_a_refusal_lists_each_broken_rule_once(capsys, tmp_path) -> None:
    """`dduf info` of a DEFLATE zip: Z011 for every entry was ten lines of the same words, and most rules hidden."""
    import os
    import zipfile

    root = PIPELINES / "tiny-sd"
    with zipfile.ZipFile(tmp_path / "deflated.dduf", "w", zipfile.ZIP_DEFLATED) as z:
        z.write(root / "model_index.json", "model_index.json")
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            for f in sorted(os.listdir(folder)):
                z.write(folder / f, f"{folder.name}/{f}")
    code, _, err = run_cli(capsys, "info", str(tmp_path / "deflated.dduf"))
    assert code == 1
    z011 = [line for line in err.splitlines() if "Z011" in line]
    assert len(z011) == 1 and "entries): compression method 8" in z011[0], err
    assert "... and" not in err  # every broken rule shown
