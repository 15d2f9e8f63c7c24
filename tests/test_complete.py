"""``complete``: partial archive + resolved references -> the archive a direct full pack writes."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
from hfcache import cached, corrupted_copy

from conftest import npm_check
from dduf_plus.cli import main as cli_main
from dduf_plus.errors import DDUFReferenceError
from dduf_plus.format import spec
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.pack import pack_folder
from dduf_plus.packing.complete import complete_archive
from dduf_plus.packing.partial import ORIGINAL_MODEL_INDEX_KEY, pack_partial

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "fixtures" / "pipelines"
TINY_SD = PIPELINES / "tiny-sd"
TINY_FT = PIPELINES / "tiny-sd-finetune"



def entries(path: Path) -> dict[str, bytes]:
    with DDUFArchive(path) as archive:
        return {name: archive.read_bytes(name) for name in archive.entries}


def assert_same_archive(got: Path, want: Path) -> None:
    a, b = entries(got), entries(want)
    assert list(a) == list(b)  # same entries, same order
    for name in a:
        assert a[name] == b[name], name  # byte-identical entries (the index included: same offsets)
    assert got.read_bytes() == want.read_bytes()  # and, the writer being deterministic, the whole file


def test_complete_equals_a_direct_full_pack(tmp_path: Path, hf_env: Path) -> None:
    cached(hf_env)
    partial = tmp_path / "partial.dduf"
    pack_partial(TINY_SD, partial, exclude=["text_encoder", "tokenizer", "vae"], refs={"*": "org/tiny-sd"}, quiet=True)
    result = complete_archive(partial, tmp_path / "full.dduf", quiet=True)
    assert_same_archive(result.path, pack_folder(TINY_SD, tmp_path / "direct.dduf", quiet=True).path)
    with DDUFArchive(result.path) as archive:
        assert archive.references == {} and spec.REFERENCES_KEY not in archive.model_index
        assert all("external" not in c for c in archive.index["components"].values())


def test_complete_of_a_base_partial(tmp_path: Path, hf_env: Path) -> None:
    partial = tmp_path / "ft.partial.dduf"
    pack_partial(TINY_FT, partial, base=str(TINY_SD), quiet=True)  # references resolve from the recorded folder
    full = complete_archive(partial, tmp_path / "ft.dduf", quiet=True).path
    assert_same_archive(full, pack_folder(TINY_FT, tmp_path / "direct.dduf", quiet=True).path)


def test_complete_with_a_variant(tmp_path: Path, hf_env: Path) -> None:
    cached(hf_env)
    partial = tmp_path / "ft16.partial.dduf"
    pack_partial(TINY_FT, partial, base="org/tiny-sd", variant="fp16", quiet=True)
    full = complete_archive(partial, tmp_path / "ft16.dduf", quiet=True).path
    assert_same_archive(full, pack_folder(TINY_FT, tmp_path / "direct.dduf", variant="fp16", quiet=True).path)


def test_complete_from_another_archive(tmp_path: Path, hf_env: Path) -> None:
    base = pack_folder(TINY_SD, tmp_path / "base.dduf", quiet=True).path
    partial = tmp_path / "ft.partial.dduf"
    pack_partial(TINY_FT, partial, base=str(base), quiet=True)
    full = complete_archive(partial, tmp_path / "ft.dduf", quiet=True).path
    assert_same_archive(full, pack_folder(TINY_FT, tmp_path / "direct.dduf", quiet=True).path)


def test_non_canonical_model_index_is_restored(tmp_path: Path, hf_env: Path) -> None:
    folder = tmp_path / "ft"
    shutil.copytree(TINY_FT, folder)
    raw = json.dumps(json.loads((folder / "model_index.json").read_text()), indent=4).encode()
    (folder / "model_index.json").write_bytes(raw)
    partial = tmp_path / "ft.partial.dduf"
    pack_partial(folder, partial, base=str(TINY_SD), quiet=True)
    full = complete_archive(partial, tmp_path / "ft.dduf", quiet=True).path
    assert_same_archive(full, pack_folder(folder, tmp_path / "direct.dduf", quiet=True).path)
    with DDUFArchive(full) as archive:
        assert ORIGINAL_MODEL_INDEX_KEY not in archive.model_index


def test_complete_refuses_wrong_content_and_writes_nothing(tmp_path: Path, hf_env: Path) -> None:
    bad = corrupted_copy(tmp_path, "vae", "diffusion_pytorch_model.safetensors")
    partial = tmp_path / "partial.dduf"
    pack_partial(TINY_SD, partial, exclude=["vae"], refs={"*": "org/tiny-sd"}, quiet=True)
    cached(hf_env, bad)  # after packing: packing would refuse the mismatch
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(DDUFReferenceError, match="vae/diffusion_pytorch_model.safetensors"):
        complete_archive(partial, out_dir / "full.dduf", quiet=True)
    assert list(out_dir.iterdir()) == []  # no output, no temporary left behind


def test_completed_archive_is_valid_everywhere(tmp_path: Path, hf_env: Path) -> None:
    from huggingface_hub import read_dduf_file

    partial = tmp_path / "ft.partial.dduf"
    pack_partial(TINY_FT, partial, base=str(TINY_SD), quiet=True)
    full = complete_archive(partial, tmp_path / "ft.dduf", quiet=True).path
    hub_entries = read_dduf_file(full)
    assert "text_encoder/model.safetensors" in hub_entries
    with zipfile.ZipFile(full) as zf:
        assert zf.testzip() is None
    done = npm_check(full)
    if done is not None:
        assert done.returncode == 0, done.stderr
        assert sorted(json.loads(done.stdout)) == sorted(hub_entries)


def test_cli_complete(tmp_path: Path, hf_env: Path, capsys) -> None:
    partial = tmp_path / "ft.partial.dduf"
    pack_partial(TINY_FT, partial, base=str(TINY_SD), quiet=True)
    out = tmp_path / "ft.dduf"
    assert cli_main(["complete", str(partial), "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert cli_main(["refs", str(out)]) == 0
    assert "no references" in capsys.readouterr().out
    # a reference that cannot be resolved: exit 1 with the reason, no output
    lone = tmp_path / "lone.dduf"
    pack_partial(TINY_SD, lone, exclude=["vae"], refs={"*": "org/not-cached"}, quiet=True)
    assert cli_main(["complete", str(lone), "-o", str(tmp_path / "x.dduf"), "-q"]) == 1
    assert "org/not-cached" in capsys.readouterr().err and not (tmp_path / "x.dduf").exists()
    # --ref supplies the source instead
    assert cli_main(["complete", str(lone), "-o", str(tmp_path / "x.dduf"), "-q", "--ref", f"vae={TINY_SD}"]) == 0
    assert_same_archive(tmp_path / "x.dduf", pack_folder(TINY_SD, tmp_path / "direct.dduf", quiet=True).path)
