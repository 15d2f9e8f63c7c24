"""What a reference records so app model folders find it by content (its tensors' digest), whatever BASE is
(a folder, a Hugging Face cache snapshot or repo id, a ``.dduf``, ``save_dduf(pipe, base=...)``), and
``dduf complete --model-dir`` completing an archive from files found by content (re-saved, LDM layout)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hfcache import REPO, cached

from dduf_plus import load_dduf
from dduf_plus.errors import DDUFReferenceError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.safetensors_header import read_file_header
from dduf_plus.packing import reference_source, tensor_records
from dduf_plus.packing.complete import complete_archive
from dduf_plus.packing.pack import pack
from dduf_plus.packing.partial import pack_partial
from dduf_plus.packing.reference_source import hash_local_files
from dduf_plus.refs import model_dirs, tensor_digest
from dduf_plus.refs.resolve import parse_spec

ROOT = Path(__file__).resolve().parent.parent
TINY_SD = ROOT / "fixtures" / "pipelines" / "tiny-sd"
WEIGHTS = {"vae": "diffusion_pytorch_model.safetensors", "text_encoder": "model.safetensors"}


def _digest(path: Path) -> str:
    return tensor_digest.tensors_digest([(path, read_file_header(path, path.name, ValueError))])


def _finetune(tmp_path: Path) -> Path:
    """tiny-sd with its UNet changed: every other model is BASE's."""
    from safetensors.torch import load_file, save_file

    ft = shutil.copytree(TINY_SD, tmp_path / "ft")
    unet = next((ft / "unet").glob("*.safetensors"))
    save_file({k: v + 0.01 for k, v in load_file(unet).items()}, unet)
    return ft


def _resave(src: Path, dst: Path) -> Path:
    """The same tensors in another file (other order, other metadata): other bytes."""
    from safetensors.torch import load_file, save_file

    save_file(dict(reversed(list(load_file(src).items()))), dst, metadata={"saved_by": "an app"})
    return dst


def _base(kind: str, tmp_path: Path, hf_env: Path) -> str:
    if kind == "folder":
        return str(shutil.copytree(TINY_SD, tmp_path / "base"))
    if kind == "hf-snapshot":
        return str(cached(hf_env))
    if kind == "hub":
        cached(hf_env)
        return REPO
    return str(pack(TINY_SD, tmp_path / "base.dduf", quiet=True)[0].path)


@pytest.mark.parametrize("kind", ["folder", "hf-snapshot", "hub", "dduf"])
@pytest.mark.parametrize("how", ["pack", "save_dduf"])
def test_every_base_records_the_tensors_digest(kind: str, how: str, tmp_path: Path, hf_env: Path) -> None:
    """The digest is that of BASE's tensors (the same for every kind of BASE), and its config text is BASE's."""
    base = _base(kind, tmp_path, hf_env)
    out = tmp_path / "ft.dduf"
    if how == "pack":
        pack_partial(_finetune(tmp_path), out, base=base, quiet=True)
    else:
        from diffusers import DiffusionPipeline

        from dduf_plus import save_dduf

        save_dduf(DiffusionPipeline.from_pretrained(_finetune(tmp_path)), out, base=base, quiet=True)
    with DDUFArchive(out) as a:
        refs = a.references
    assert {"vae", "text_encoder"} <= set(refs)
    for name, weights in WEIGHTS.items():
        rec = refs[name][tensor_digest.RECORD_KEY]
        assert rec["sha256"] == _digest(TINY_SD / name / weights), (kind, name)
        assert json.loads(rec["config"]) == json.loads((TINY_SD / name / "config.json").read_text())
    assert tensor_digest.RECORD_KEY not in refs["scheduler"]


def test_a_hub_base_not_on_this_machine_records_from_the_identical_local_copy(tmp_path: Path, hf_env: Path) -> None:
    """BASE's bytes elsewhere (a Hub repo compared by file hashes): the local copy with the recorded sha256 gives
    the digest; a local copy with other bytes gives none (it could not be the reference's)."""
    sub = tmp_path / "vae"
    shutil.copytree(TINY_SD / "vae", sub)
    local = {f: sub / f for f in ("config.json", WEIGHTS["vae"])}
    files = hash_local_files(local)
    spec = parse_spec("org/not-cached")
    rec = tensor_records.reference_tensors(spec, "vae", files, None, local)[tensor_digest.RECORD_KEY]
    assert rec["sha256"] == _digest(TINY_SD / "vae" / WEIGHTS["vae"])
    assert tensor_records.reference_tensors(spec, "vae", files, None, None) == {}
    other = {**files, WEIGHTS["vae"]: {**files[WEIGHTS["vae"]], "sha256": "0" * 64}}
    assert tensor_records.reference_tensors(spec, "vae", other, None, local) == {}


def test_an_archive_repacked_against_a_hub_base_elsewhere_records_from_its_entries(tmp_path: Path,
                                                                                   hf_env: Path) -> None:
    """``dduf pack IN.dduf --base org/repo`` with the repo's bytes elsewhere: IN's entries (the local copy, found
    identical by file hashes) give the digest, hashed from the mapped archive."""
    from dduf_plus.format.pack import FileRegion

    archive = pack(TINY_SD, tmp_path / "in.dduf", quiet=True)[0].path
    with DDUFArchive(archive) as a:
        local = {f: FileRegion(archive, a.entry(f"vae/{f}").offset, a.entry(f"vae/{f}").length, f"vae/{f}")
                 for f in ("config.json", WEIGHTS["vae"])}
    files = hash_local_files(local)
    found = tensor_records.reference_tensors(parse_spec("org/not-cached"), "vae", files, None, local)
    assert found[tensor_digest.RECORD_KEY]["sha256"] == _digest(TINY_SD / "vae" / WEIGHTS["vae"])


def test_an_archive_base_is_hashed_once_per_entry(tmp_path: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing again against the same .dduf BASE hashes no tensors: the digest is remembered per entry."""
    base = _base("dduf", tmp_path, hf_env)
    ft = _finetune(tmp_path)
    hashed: list[Path] = []
    real = tensor_digest.tensors_digest
    monkeypatch.setattr(tensor_records, "tensors_digest", lambda files: hashed.extend(p for p, _h in files) or real(files))
    pack_partial(ft, tmp_path / "a.dduf", base=base, quiet=True)
    assert len(hashed) == 2  # the VAE's and the text encoder's entries, once each
    hashed.clear()
    pack_partial(ft, tmp_path / "b.dduf", base=base, quiet=True)
    assert hashed == []


def test_an_archive_bases_entries_are_sha256_hashed_once(tmp_path: Path, hf_env: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The entries of a .dduf BASE are compared by sha256 through the verified-hash memory: packing again
    against the same archive hashes no entry."""
    base = _base("dduf", tmp_path, hf_env)
    ft = _finetune(tmp_path)
    hashed: list[int] = []

    class Counting:
        @staticmethod
        def sha256(data: Any = b"") -> Any:
            hashed.append(len(data))
            return hashlib.sha256(data)

    monkeypatch.setattr(reference_source, "hashlib", Counting())
    pack_partial(ft, tmp_path / "a.dduf", base=base, quiet=True)
    assert sum(hashed) > 1 << 10  # the BASE's entries, weights included
    hashed.clear()
    pack_partial(ft, tmp_path / "b.dduf", base=base, quiet=True)
    assert sum(hashed) == 0


def test_an_archive_base_found_in_app_folders_once_it_is_gone(tmp_path: Path, hf_env: Path) -> None:
    """A partial packed against a .dduf resolves, once that archive is gone, from a re-saved VAE in models/vae."""
    base = Path(_base("dduf", tmp_path, hf_env))
    out = pack_partial(_finetune(tmp_path), tmp_path / "ft.dduf", base=str(base), quiet=True).path
    expected = load_dduf(out).vae.state_dict()
    models = tmp_path / "models" / "vae"
    models.mkdir(parents=True)
    _resave(TINY_SD / "vae" / WEIGHTS["vae"], models / "my_vae.safetensors")
    base.unlink()
    others = {n: str(TINY_SD) for n in ("scheduler", "text_encoder", "tokenizer")}  # only the VAE from app folders
    got = load_dduf(out, model_dirs=[tmp_path / "models"], refs=others).vae.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


# --- dduf complete --model-dir by content ----------------------------------------------------------------------
@pytest.fixture
def moved(tmp_path: Path, hf_env: Path) -> dict[str, Any]:
    """A partial archive against a BASE folder, its models as loaded then; BASE's VAE and text encoder then
    moved into an app's folders: the VAE in the LDM layout (models/vae), the text encoder re-saved."""
    from safetensors.torch import save_file
    from single_file_ckpt import _config, _state, vae_to_ldm

    base = shutil.copytree(TINY_SD, tmp_path / "base")
    archive = pack_partial(_finetune(tmp_path), tmp_path / "ft.dduf", base=str(base), quiet=True).path
    pipe = load_dduf(archive)
    expected = {n: getattr(pipe, n).state_dict() for n in ("unet", *WEIGHTS)}
    models = tmp_path / "models"
    (models / "vae").mkdir(parents=True)
    (models / "text_encoders").mkdir()
    ldm = vae_to_ldm(_state(base, "vae"), _config(base, "vae"))
    save_file({k.removeprefix("first_stage_model."): v for k, v in ldm.items()}, models / "vae" / "vae-ft.safetensors")
    _resave(base / "text_encoder" / WEIGHTS["text_encoder"], models / "text_encoders" / "clip_l.safetensors")
    for n in WEIGHTS:
        shutil.rmtree(base / n)
    return {"archive": archive, "models": models, "expected": expected}


def test_complete_from_a_resaved_text_encoder_and_an_ldm_vae(moved: dict[str, Any], tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    from dduf_plus.cli import main
    from dduf_plus.format.validate import validate

    out = tmp_path / "full.dduf"
    with pytest.raises(DDUFReferenceError):
        complete_archive(moved["archive"], out, quiet=True)  # BASE's copies are gone
    with DDUFArchive(moved["archive"]) as a:
        refs = a.references
    with caplog.at_level(logging.WARNING, logger="dduf_plus"):
        assert main(["complete", str(moved["archive"]), "-o", str(out), "--model-dir", str(moved["models"]), "-q"]) == 0
    said = caplog.text
    assert "clip_l.safetensors" in said and "other bytes" in said
    assert "vae-ft.safetensors" not in said  # renamed and laid out as safetensors lays it out: the recorded bytes
    with DDUFArchive(out) as a:
        assert not a.references
        for name, weights in WEIGHTS.items():  # the found bytes, their own sha256 in the index
            entry = f"{name}/{weights}"
            same = a.index["files"][entry]["sha256"] == refs[name]["files"][weights]["sha256"]
            assert same == (name == "vae"), name
            assert a.read_bytes(f"{name}/config.json") == (TINY_SD / name / "config.json").read_bytes()
    assert not [f for f in validate(out).findings if f.severity == "error"]
    pipe = load_dduf(out)
    for name, state in moved["expected"].items():
        mine = getattr(pipe, name).state_dict()
        assert mine.keys() == state.keys() and all(torch.equal(mine[k], state[k]) for k in state), name


def test_complete_refuses_a_found_file_whose_tensors_differ(moved: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    clip = moved["models"] / "text_encoders" / "clip_l.safetensors"
    state = load_file(clip)
    k = sorted(state)[0]
    save_file({**state, k: state[k] + 1}, clip)
    out = tmp_path / "full.dduf"
    with pytest.raises(DDUFReferenceError) as e:
        complete_archive(moved["archive"], out, quiet=True, model_dirs=[moved["models"]])
    assert "'text_encoder'" in str(e.value) and "clip_l.safetensors" in str(e.value) and "bytes differ" in str(e.value)
    assert not out.exists()


def test_complete_refuses_a_file_changed_after_it_was_verified(moved: dict[str, Any], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The file copied must still be the one whose tensors were verified (its digest still remembered)."""
    monkeypatch.setattr(model_dirs, "verified_digest", lambda path: None)
    out = tmp_path / "full.dduf"
    with pytest.raises(DDUFReferenceError, match="changed after its tensors were verified"):
        complete_archive(moved["archive"], out, quiet=True, model_dirs=[moved["models"]])
    assert not out.exists()
