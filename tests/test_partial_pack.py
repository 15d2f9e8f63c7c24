"""Partial packing: --exclude / --ref / --base write references (content identity of every file) instead of
components, and the archive stays a plain DDUF for every other reader."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import npm_check
from dduf_plus.errors import DDUFPackError, DDUFReferenceError
from dduf_plus.format import spec
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.pack import pack_folder
from dduf_plus.packing.partial import (
    ORIGINAL_MODEL_INDEX_KEY,
    canonical_model_index_bytes,
    pack_partial,
    parse_ref_args,
)
from dduf_plus.refs.cache import add_to_hf_cache, git_blob_sha1_file
from dduf_plus.refs.resolve import Spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "fixtures" / "pipelines"
TINY_SD = PIPELINES / "tiny-sd"
TINY_FT = PIPELINES / "tiny-sd-finetune"
NOT_UNET = {"scheduler", "text_encoder", "tokenizer", "vae"}




def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def npm_names(archive: Path) -> list[str] | None:
    """Entry names the npm @huggingface/dduf checker lists, or None when node or the package is absent."""
    done = npm_check(archive)
    if done is None:
        return None
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def assert_plain_dduf(path: Path, tmp_path: Path) -> None:
    """Every other reader accepts the archive."""
    from huggingface_hub import read_dduf_file

    entries = read_dduf_file(path)
    assert "model_index.json" in entries
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
    names = npm_names(path)
    if names is not None:
        assert sorted(names) == sorted(entries)


# --- SPEC syntax ---------------------------------------------------------------------------------------
def test_parse_spec(tmp_path: Path) -> None:
    assert parse_spec("org/repo") == Spec("hub", "org/repo", None, None)
    assert parse_spec("org/repo@v1.0") == Spec("hub", "org/repo", "v1.0", None)
    assert parse_spec("org/repo:text_encoder_2") == Spec("hub", "org/repo", None, "text_encoder_2")
    assert parse_spec("org/repo@refs/pr/3:text_encoder_2") == Spec("hub", "org/repo", "refs/pr/3", "text_encoder_2")
    assert parse_spec("gpt2") == Spec("hub", "gpt2", None, None)
    assert parse_spec(str(tmp_path)) == Spec("folder", str(tmp_path), None, None)
    assert parse_spec(f"{tmp_path}:vae") == Spec("folder", str(tmp_path), None, "vae")
    assert parse_spec("base.dduf:text_encoder_2").kind == "dduf"
    assert parse_spec("base.dduf:text_encoder_2").subfolder == "text_encoder_2"
    assert parse_spec("./relative/folder").kind == "folder"
    for bad in ("", "org/repo/extra", "org/repo@", "not a repo"):
        with pytest.raises(DDUFReferenceError):
            parse_spec(bad)


def test_parse_ref_args() -> None:
    assert parse_ref_args(["org/base", "text_encoder=org/sdxl:text_encoder_2"]) == {
        "*": "org/base", "text_encoder": "org/sdxl:text_encoder_2"}
    assert parse_ref_args(None) == {}
    with pytest.raises(DDUFReferenceError):
        parse_ref_args(["a/b", "c/d"])


# --- --exclude / --ref ----------------------------------------------------------------------------------
def test_exclude_with_hub_ref_records_content_identity(tmp_path: Path, hf_env: Path) -> None:
    out = tmp_path / "partial.dduf"
    pack_partial(TINY_SD, out, exclude=["text_encoder", "vae"], refs={"*": "org/tiny-sd@v1"}, quiet=True)
    with DDUFArchive(out) as archive:  # check=True: D008/R002 and every other rule pass
        refs = archive.references
        assert set(refs) == {"text_encoder", "vae"}
        assert not any(n.startswith(("text_encoder/", "vae/")) for n in archive.entries)
        te = refs["text_encoder"]
        assert te["pretrained_model_name_or_path"] == "org/tiny-sd"
        assert te["subfolder"] == "text_encoder" and te["revision"] == "v1" and te["variant"] is None
        assert te["type_hint"] == ["transformers", "CLIPTextModel"]
        for fname in ("config.json", "model.safetensors"):
            local = TINY_SD / "text_encoder" / fname
            assert te["files"][fname]["size"] == local.stat().st_size
            assert te["files"][fname]["sha256"] == sha256(local)
        assert te["files"]["config.json"]["git_sha1"] == git_blob_sha1_file(TINY_SD / "text_encoder" / "config.json")
        assert "git_sha1" not in te["files"]["model.safetensors"]  # an LFS file: its blob is named by sha256
        # the default variant only, as a full pack would store it
        assert set(refs["vae"]["files"]) == {"config.json", "diffusion_pytorch_model.safetensors"}
        assert archive.index["components"]["text_encoder"]["external"] == te  # `dduf info` shows it as external
        raw = archive.read_bytes(spec.MODEL_INDEX)
        assert raw == canonical_model_index_bytes(json.loads(raw))
        assert ORIGINAL_MODEL_INDEX_KEY not in archive.model_index  # the fixture's model_index is canonical
    assert_plain_dduf(out, tmp_path)


def test_exclude_without_source_is_allowed(tmp_path: Path, hf_env: Path) -> None:
    out = tmp_path / "partial.dduf"
    pack_partial(TINY_SD, out, exclude=["text_encoder"], quiet=True)
    with DDUFArchive(out) as archive:
        ref = archive.references["text_encoder"]
    assert ref["pretrained_model_name_or_path"] is None
    assert set(ref["files"]) == {"config.json", "model.safetensors"}


def test_named_ref_with_another_subfolder(tmp_path: Path, hf_env: Path) -> None:
    out = tmp_path / "partial.dduf"
    pack_partial(TINY_SD, out, refs={"text_encoder": "org/sdxl:text_encoder_2"}, quiet=True)  # NAME=SPEC excludes NAME
    with DDUFArchive(out) as archive:
        refs = archive.references
        assert set(refs) == {"text_encoder"}
        assert refs["text_encoder"]["pretrained_model_name_or_path"] == "org/sdxl"
        assert refs["text_encoder"]["subfolder"] == "text_encoder_2"
        assert "vae/config.json" in archive


def test_local_folder_ref_must_hold_the_same_content(tmp_path: Path, hf_env: Path) -> None:
    out = tmp_path / "partial.dduf"
    pack_partial(TINY_FT, out, exclude=["vae"], refs={"*": str(TINY_SD)}, quiet=True)
    with DDUFArchive(out) as archive:
        assert archive.references["vae"]["pretrained_model_name_or_path"] == str(TINY_SD)
    with pytest.raises(DDUFPackError, match="unet differs from its reference"):
        pack_partial(TINY_FT, tmp_path / "bad.dduf", exclude=["unet"], refs={"*": str(TINY_SD)}, quiet=True)
    assert not (tmp_path / "bad.dduf").exists()


def test_hub_ref_that_differs_from_the_local_copy_is_refused(tmp_path: Path, hf_env: Path) -> None:
    """When the source's file list is at hand (here the HF cache), a reference that could never resolve
    is an error at pack time, not at load time."""
    add_to_hf_cache(TINY_SD, "org/tiny-sd", cache_dir=hf_env)
    with pytest.raises(DDUFPackError, match="unet differs from its reference org/tiny-sd"):
        pack_partial(TINY_FT, tmp_path / "x.dduf", exclude=["unet"], refs={"*": "org/tiny-sd"}, quiet=True)


def test_unknown_component_is_refused(tmp_path: Path, hf_env: Path) -> None:
    with pytest.raises(DDUFPackError, match="--ref text_encoder_3: not a component .*did you mean text_encoder"):
        pack_partial(TINY_SD, tmp_path / "x.dduf", refs={"text_encoder_3": "org/x"}, quiet=True)


def test_hub_only_reference_takes_hashes_from_the_cache(tmp_path: Path, hf_env: Path) -> None:
    """No local copy of the component: its file records come from the source (here the HF cache, offline)."""
    folder = tmp_path / "no-te"
    shutil.copytree(TINY_SD, folder)
    shutil.rmtree(folder / "text_encoder")
    snap = add_to_hf_cache(TINY_SD, "org/tiny-sd", cache_dir=hf_env)
    out = tmp_path / "partial.dduf"
    pack_partial(folder, out, exclude=["text_encoder"], refs={"*": "org/tiny-sd"}, quiet=True)
    with DDUFArchive(out) as archive:
        ref = archive.references["text_encoder"]
    assert ref["revision"] == snap.name  # pinned to the commit the hashes were read at
    st = ref["files"]["model.safetensors"]
    assert st["sha256"] == sha256(TINY_SD / "text_encoder" / "model.safetensors")
    config = ref["files"]["config.json"]  # a small non-LFS file: the Hub knows only its git blob id
    assert "sha256" not in config and config["git_sha1"] == git_blob_sha1_file(TINY_SD / "text_encoder" / "config.json")


# --- --base ---------------------------------------------------------------------------------------------
def _referenced(path: Path) -> set[str]:
    with DDUFArchive(path) as archive:
        stored = {n.split("/")[0] for n in archive.entries if "/" in n}
        assert stored.isdisjoint(archive.references)
        return set(archive.references)


def _component_bytes(folder: Path, names: set[str]) -> int:
    total = 0
    for n in names:
        for f in (folder / n).iterdir():
            if ".fp16." not in f.name:
                total += f.stat().st_size
    return total


def test_base_folder_references_exactly_the_identical_components(tmp_path: Path, hf_env: Path, caplog) -> None:
    from dduf_plus.format.pack import plan_folder
    from dduf_plus.packing.partial import make_references

    partial = make_references(plan_folder(TINY_FT), base=str(TINY_SD))
    assert set(partial.references) == NOT_UNET
    assert {s.name.split("/")[0] for s in partial.sources} == {"unet"}
    assert partial.bytes_saved == _component_bytes(TINY_FT, NOT_UNET)
    assert any(line.startswith("stored unet") for line in partial.report)
    assert any(line.startswith("bytes saved") for line in partial.report)
    out = tmp_path / "ft.dduf"
    pack_partial(TINY_FT, out, base=str(TINY_SD), quiet=True)
    assert _referenced(out) == NOT_UNET
    assert out.stat().st_size < pack_folder(TINY_FT, tmp_path / "full.dduf", quiet=True).bytes_written
    assert_plain_dduf(out, tmp_path)


def test_base_dduf_archive(tmp_path: Path, hf_env: Path) -> None:
    base = pack_folder(TINY_SD, tmp_path / "base.dduf", quiet=True).path
    out = tmp_path / "ft.dduf"
    pack_partial(TINY_FT, out, base=str(base), quiet=True)
    assert _referenced(out) == NOT_UNET
    with DDUFArchive(out) as archive:
        assert archive.references["vae"]["pretrained_model_name_or_path"] == str(base)


def test_base_hub_offline_uses_the_cache_blob_names(tmp_path: Path, hf_env: Path) -> None:
    snap = add_to_hf_cache(TINY_SD, "org/tiny-sd", cache_dir=hf_env)
    out = tmp_path / "ft.dduf"
    pack_partial(TINY_FT, out, base="org/tiny-sd", quiet=True)
    assert _referenced(out) == NOT_UNET
    with DDUFArchive(out) as archive:
        assert {r["revision"] for r in archive.references.values()} == {snap.name}


def _fake_model_info(folder: Path, commit: str):
    """What HfApi.model_info(files_metadata=True) returns for ``folder`` pushed to the Hub."""
    siblings = []
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(folder).as_posix()
        lfs = {"size": p.stat().st_size, "sha256": sha256(p), "pointer_size": 134} if p.suffix == ".safetensors" else None
        siblings.append(SimpleNamespace(rfilename=rel, size=p.stat().st_size, blob_id=git_blob_sha1_file(p), lfs=lfs))
    return SimpleNamespace(sha=commit, siblings=siblings)


def test_base_hub_uses_file_metadata(tmp_path: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setenv("DDUF_PLUS_HUB_PROBE", "0")  # huggingface_hub is mocked below: no real Hub to probe
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []
    commit = "c" * 40

    def model_info(self, repo_id, *, revision=None, files_metadata=False, token=None, **kw):
        calls.append((repo_id, revision, files_metadata))
        return _fake_model_info(TINY_SD, commit)

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    out = tmp_path / "ft.dduf"
    pack_partial(TINY_FT, out, base="org/tiny-sd", quiet=True)
    assert _referenced(out) == NOT_UNET
    assert calls == [("org/tiny-sd", None, True)]  # one metadata call for the whole pipeline
    with DDUFArchive(out) as archive:
        assert {r["revision"] for r in archive.references.values()} == {commit}


def test_base_hub_offline_and_not_cached_is_a_clear_error(tmp_path: Path, hf_env: Path) -> None:
    with pytest.raises(DDUFPackError, match=r"cannot read the file list of org/absent: .*not in the Hugging Face cache"):
        pack_partial(TINY_FT, tmp_path / "x.dduf", base="org/absent", quiet=True)


def test_base_with_variant(tmp_path: Path, hf_env: Path) -> None:
    out = tmp_path / "ft16.dduf"
    pack_partial(TINY_FT, out, base=str(TINY_SD), variant="fp16", quiet=True)
    with DDUFArchive(out) as archive:
        vae = archive.references["vae"]
    assert set(vae["files"]) == {"config.json", "diffusion_pytorch_model.fp16.safetensors"}
    assert vae["variant"] == "fp16"


def test_non_canonical_model_index_is_kept_for_complete(tmp_path: Path, hf_env: Path) -> None:
    folder = tmp_path / "ft"
    shutil.copytree(TINY_FT, folder)
    raw = json.dumps(json.loads((folder / "model_index.json").read_text()), indent=4).encode()
    (folder / "model_index.json").write_bytes(raw)
    out = tmp_path / "ft.dduf"
    pack_partial(folder, out, base=str(TINY_SD), quiet=True)
    with DDUFArchive(out) as archive:
        kept = archive.model_index[ORIGINAL_MODEL_INDEX_KEY]
    assert kept["text"].encode() == raw and kept["sha256"] == hashlib.sha256(raw).hexdigest()


def test_base_of_another_pipeline_class_compares_by_content(tmp_path: Path, hf_env: Path) -> None:
    """tiny-dit's vae happens to be tiny-sd's (same seed, same config): found identical across pipelines;
    components whose class differs are never referenced."""
    from dduf_plus.format.pack import plan_folder
    from dduf_plus.packing.partial import make_references

    partial = make_references(plan_folder(PIPELINES / "tiny-dit"), base=str(TINY_SD))
    assert set(partial.references) == {"vae"}
    assert any("BASE's is transformers.CLIPTextModel" in line for line in partial.report)


def test_nothing_identical_writes_a_complete_archive(tmp_path: Path, hf_env: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    shutil.copy(TINY_SD / "model_index.json", base)
    shutil.copytree(TINY_SD / "unet", base / "unet")
    out = tmp_path / "ft.dduf"
    pack_partial(TINY_FT, out, base=str(base), quiet=True)
    full = pack_folder(TINY_FT, tmp_path / "full.dduf", quiet=True).path
    assert out.read_bytes() == full.read_bytes()


def test_missing_base_path_is_an_error_not_a_complete_pack(tmp_path: Path) -> None:
    """A BASE folder that is not here must not quietly give a complete archive ("nothing in common")."""
    from dduf_plus.errors import DDUFNotFoundError
    from dduf_plus.packing.partial import pack_partial

    with pytest.raises(DDUFNotFoundError, match="does not exist") as caught:
        pack_partial(TINY_FT, tmp_path / "p.dduf", base=str(tmp_path / "missing-folder"), quiet=True)
    assert isinstance(caught.value, FileNotFoundError) and not (tmp_path / "p.dduf").exists()
