"""References found in app model folders by their tensors (``load_dduf(model_dirs=...)``, ``DDUF_PLUS_MODEL_DIRS``,
``dduf refs/complete --model-dir``): a ComfyUI-shaped folder holds the VAE and the text encoder, BASE's copies
are gone, and the partial archive loads equal to the pipeline loaded from BASE."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from pipeline_states import assert_same_states
from single_file_ckpt import checkpoint_from_pipeline

from conftest import PIPELINES
from dduf_plus.errors import DDUFReferenceError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.packing.single_file import pack_single_file
from dduf_plus.refs import model_dirs, tensor_digest
from dduf_plus.refs.resolve import check_references, locate_component

TINY_SD = PIPELINES / "tiny-sd"
MOVED = ("vae", "text_encoder")


def _resave(src: Path, dst: Path, metadata: dict[str, str] | None = None) -> Path:
    """The same tensors in another file: other metadata, other order (a re-save; the file's sha256 differs)."""
    from safetensors.torch import load_file, save_file

    state = load_file(src)
    save_file(dict(reversed(list(state.items()))), dst, metadata=metadata or {"saved_by": "an app"})
    return dst


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """BASE (a copy of tiny-sd), a partial archive of an SD 1.x checkpoint against it (the UNet stored, the rest
    referenced), the pipeline as loaded from BASE, then BASE's VAE and text encoder moved into a ComfyUI-shaped
    ``models/`` folder (the VAE as it was, the text encoder re-saved) and deleted from BASE."""
    from safetensors.torch import save_file

    from dduf_plus import load_dduf

    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(model_dirs.ENV, raising=False)
    base = shutil.copytree(TINY_SD, tmp_path / "base")
    ckpt = tmp_path / "sd1.safetensors"
    save_file(checkpoint_from_pipeline(base, "v1", unet_delta=0.01, dtype=torch.float32), ckpt)
    archive = tmp_path / "sd1.dduf"
    pack_single_file(ckpt, archive, base=str(base), quiet=True, fsync=False)
    expected = {n: getattr(load_dduf(archive), n).state_dict() for n in MOVED}
    models = tmp_path / "models"
    (models / "vae").mkdir(parents=True)
    (models / "text_encoders").mkdir()
    shutil.copy(base / "vae" / "diffusion_pytorch_model.safetensors", models / "vae" / "sd15_vae.safetensors")
    _resave(base / "text_encoder" / "model.safetensors", models / "text_encoders" / "clip_l.safetensors")
    (models / "checkpoints").mkdir()
    (models / "checkpoints" / "other.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    for n in MOVED:
        shutil.rmtree(base / n)
    return {"archive": archive, "models": models, "expected": expected, "base": base}


def test_pipeline_loads_from_app_folders_and_second_load_hashes_nothing(setup: dict[str, Any],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from dduf_plus import load_dduf

    with DDUFArchive(setup["archive"]) as a:
        refs = a.references
    assert all(tensor_digest.RECORD_KEY in refs[n] for n in MOVED)  # the digest is recorded at pack time
    assert tensor_digest.RECORD_KEY not in refs["scheduler"]  # no weights: nothing to find by content
    with pytest.raises(DDUFReferenceError):
        load_dduf(setup["archive"])  # BASE's copies are gone
    hashed: list[Path] = []
    real = tensor_digest.tensors_digest

    def counting(files: Any) -> str:
        hashed.extend(p for p, _h in files)
        return real(files)

    monkeypatch.setattr(tensor_digest, "tensors_digest", counting)
    assert_same_states(load_dduf(setup["archive"], model_dirs=[setup["models"]]), setup["expected"])
    assert sorted(p.name for p in hashed) == ["clip_l.safetensors", "sd15_vae.safetensors"]
    hashed.clear()
    monkeypatch.setenv(model_dirs.ENV, os.pathsep.join([str(setup["models"] / "vae"), str(setup["models"])]))
    assert_same_states(load_dduf(setup["archive"]), setup["expected"])  # the environment variable; remembered: no hashing
    assert hashed == []
    clip = setup["models"] / "text_encoders" / "clip_l.safetensors"
    os.utime(clip, ns=(1, 1))  # a changed file is hashed again
    assert_same_states(load_dduf(setup["archive"]), setup["expected"])
    assert [p.name for p in hashed] == ["clip_l.safetensors"]


def test_a_file_whose_header_fits_but_bytes_differ_is_skipped_and_said(setup: dict[str, Any],
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    from safetensors.torch import load_file, save_file

    from dduf_plus import load_dduf

    vae = setup["models"] / "vae" / "sd15_vae.safetensors"
    state = load_file(vae)
    k = sorted(state)[0]
    state[k] = state[k] + 1
    save_file(state, setup["models"] / "vae" / "a_tampered.safetensors")  # found first (name order)
    with caplog.at_level("INFO", logger="dduf_plus"):
        assert_same_states(load_dduf(setup["archive"], model_dirs=[setup["models"]]), setup["expected"])
    text = caplog.text
    assert "a_tampered.safetensors" in text and "bytes differ" in text
    vae.unlink()
    with DDUFArchive(setup["archive"]) as a:
        ref = a.references["vae"]
    with pytest.raises(DDUFReferenceError, match="header fits but its tensors' bytes differ"):
        locate_component("vae", ref, model_dirs=[setup["models"]])


def test_refs_says_where_and_older_archives_resolve_as_before(setup: dict[str, Any],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from dduf_plus.cli import main

    rows = {r["component"]: r for r in check_references(_refs(setup), model_dirs=[setup["models"]])}
    assert rows["vae"]["how"] == "model folder" and rows["vae"]["found"].endswith("sd15_vae.safetensors")
    assert rows["scheduler"]["how"] == "recorded folder"
    assert main(["refs", str(setup["archive"]), "--model-dir", str(setup["models"])]) == 0
    out = capsys.readouterr().out
    assert "-> model folder: " in out and "clip_l.safetensors" in out and "model folder: model folder" not in out
    # an archive written before the digest: model folders do not apply, and it says so
    old = {n: {k: v for k, v in r.items() if k != tensor_digest.RECORD_KEY} for n, r in _refs(setup).items()}
    with pytest.raises(DDUFReferenceError, match="records no tensor digest"):
        locate_component("vae", old["vae"], model_dirs=[setup["models"]])
    assert locate_component("scheduler", old["scheduler"]).how == "recorded folder"


def test_hostile_records_and_folders(setup: dict[str, Any], tmp_path: Path) -> None:
    """A malformed digest record is refused as such; a config text that is not the recorded config.json is
    refused; a symlinked folder is not followed."""
    ref = _refs(setup)["vae"]
    bad = {**ref, tensor_digest.RECORD_KEY: {"version": 1, "sha256": "x"}}
    assert model_dirs.find_component("vae", bad, [setup["models"]]) == "the reference's tensor digest record is malformed"
    other = {**ref, tensor_digest.RECORD_KEY: {**ref[tensor_digest.RECORD_KEY], "config": "{}"}}
    assert "does not match the recorded config.json" in str(model_dirs.find_component("vae", other, [setup["models"]]))
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(setup["models"] / "vae", linked / "vae")
    assert "no file in" in str(model_dirs.find_component("vae", ref, [linked]))


def test_complete_takes_a_byte_identical_file_from_a_model_folder(setup: dict[str, Any], tmp_path: Path) -> None:
    from dduf_plus.cli import main

    text_encoder = setup["models"] / "text_encoders" / "clip_l.safetensors"
    text_encoder.unlink()
    shutil.copytree(TINY_SD / "text_encoder", setup["base"] / "text_encoder")
    out = tmp_path / "full.dduf"
    assert main(["complete", str(setup["archive"]), "-o", str(out), "--model-dir", str(setup["models"]), "-q"]) == 0
    with DDUFArchive(out) as a:
        assert not a.references and "vae/diffusion_pytorch_model.safetensors" in a
        assert json.loads(a.read_text("vae/config.json")) == json.loads((TINY_SD / "vae" / "config.json").read_text())


def test_an_ldm_vae_in_models_vae_is_found_renamed(setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """ComfyUI's VAEs are in the LDM layout (bare keys, 1x1 attention convolutions): found by the same tensors
    under diffusers' names, renamed once into the cache (the data section as it is), remembered."""
    from safetensors.torch import save_file
    from single_file_ckpt import _config, _state, vae_to_ldm

    from dduf_plus import load_dduf

    (setup["models"] / "vae" / "sd15_vae.safetensors").unlink()
    ldm = {k.removeprefix("first_stage_model."): v for k, v in vae_to_ldm(_state(TINY_SD, "vae"),
                                                                          _config(TINY_SD, "vae")).items()}
    assert "encoder.mid.attn_1.q.weight" in ldm and ldm["encoder.mid.attn_1.q.weight"].ndim == 4
    save_file(ldm, setup["models"] / "vae" / "vae-ft-mse.safetensors")
    hashed: list[Path] = []
    real = tensor_digest.tensors_digest
    monkeypatch.setattr(tensor_digest, "tensors_digest", lambda files: hashed.extend(p for p, _h in files) or real(files))
    assert_same_states(load_dduf(setup["archive"], model_dirs=[setup["models"]]), setup["expected"])
    assert "vae-ft-mse.safetensors" in [p.name for p in hashed]
    hashed.clear()
    assert_same_states(load_dduf(setup["archive"], model_dirs=[setup["models"]]), setup["expected"])
    assert hashed == []
    row = next(r for r in check_references(_refs(setup), model_dirs=[setup["models"]]) if r["component"] == "vae")
    assert "vae-ft-mse.safetensors (ldm-vae layout" in row["found"]


def test_a_clip_under_text_model_is_found_renamed(setup: dict[str, Any]) -> None:
    """ComfyUI's clip_l file keeps transformers' ``text_model.`` prefix, which the installed transformers saves
    without (or the other way round): found by the same tensors under the archive's names."""
    from safetensors.torch import load_file, save_file

    from dduf_plus import load_dduf

    clip = setup["models"] / "text_encoders" / "clip_l.safetensors"
    state = load_file(clip)
    flat = not any(k.startswith("text_model.") for k in state)
    clip.unlink()
    save_file({("text_model." + k if flat else k.removeprefix("text_model.")): v for k, v in state.items()},
              setup["models"] / "text_encoders" / "clip_l_comfy.safetensors")
    row = next(r for r in check_references(_refs(setup), model_dirs=[setup["models"]])
               if r["component"] == "text_encoder")
    if not flat:  # the installed transformers keeps the prefix: a flat file is another layout, not matched
        assert row["status"] == "unresolved"
        return
    assert row["status"] == "ok" and "clip_l_comfy.safetensors (text_model layout" in row["found"]
    assert_same_states(load_dduf(setup["archive"], model_dirs=[setup["models"]]), setup["expected"])


def test_export_resolves_from_app_folders(setup: dict[str, Any], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A partial archive whose BASE copies are gone exports complete from the model folders."""
    from dduf_plus.cli import main
    from dduf_plus.packing.single_file import read_checkpoint_header

    out = tmp_path / "out.safetensors"
    assert main(["export", str(setup["archive"]), "-o", str(out)]) == 1  # not found without the folders
    assert not out.exists()
    assert main(["export", str(setup["archive"]), "-o", str(out), "--model-dir", str(setup["models"])]) == 0
    text = capsys.readouterr().out
    assert "vae: model folder: " in text and "sd15_vae.safetensors" in text
    keys = read_checkpoint_header(out).tensors
    assert any(k.startswith("first_stage_model.") for k in keys) and any(k.startswith("cond_stage_model.") for k in keys)


def _refs(setup: dict[str, Any]) -> dict[str, Any]:
    with DDUFArchive(setup["archive"]) as a:
        return dict(a.references)


def _single_file_partial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, base: Path, checkpoint: dict[str, Any],
                         name: str, moved: tuple[str, ...]) -> tuple[Path, dict[str, dict[str, Any]]]:
    """``checkpoint`` saved as NAME.safetensors and packed against BASE (a private dduf_plus cache, no model folders
    from the environment): the archive and the ``moved`` components' state dicts as it loads them."""
    from safetensors.torch import save_file

    from dduf_plus import load_dduf

    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(model_dirs.ENV, raising=False)
    ckpt = tmp_path / f"{name}.safetensors"
    save_file(checkpoint, ckpt)
    archive = tmp_path / f"{name}.dduf"
    pack_single_file(ckpt, archive, base=str(base), quiet=True, fsync=False)
    pipe = load_dduf(archive)
    return archive, {n: getattr(pipe, n).state_dict() for n in moved}


def test_sdxl_text_encoders_and_vae_from_app_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SDXL: the VAE (LDM layout, for models/vae) and both text encoders (re-saved, for models/text_encoders) in an
    app's folders, BASE's copies gone: the single-file partial archive loads them by content, equal to BASE's."""
    from safetensors.torch import save_file
    from single_file_ckpt import build_tiny_sdxl, vae_to_ldm

    from dduf_plus import load_dduf

    base = build_tiny_sdxl(tmp_path / "sdxl", TINY_SD / "tokenizer")
    moved = ("vae", "text_encoder", "text_encoder_2")
    archive, expected = _single_file_partial(
        tmp_path, monkeypatch, base, checkpoint_from_pipeline(base, "xl_base", unet_delta=0.01, dtype=torch.float32),
        "xl", moved)
    models = tmp_path / "models"
    (models / "vae").mkdir(parents=True)
    (models / "text_encoders").mkdir()
    from safetensors.torch import load_file

    vae_config = json.loads((base / "vae" / "config.json").read_text())
    save_file(vae_to_ldm(load_file(base / "vae" / "diffusion_pytorch_model.safetensors"), vae_config),
              models / "vae" / "sdxl_vae.safetensors")
    _resave(base / "text_encoder" / "model.safetensors", models / "text_encoders" / "clip_l.safetensors")
    _resave(base / "text_encoder_2" / "model.safetensors", models / "text_encoders" / "clip_g.safetensors")
    for n in moved:
        shutil.rmtree(base / n)
    assert_same_states(load_dduf(archive, model_dirs=[models]), expected)


def test_sd3_text_encoders_from_app_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SD3.5: CLIP-L, CLIP-G and T5 re-saved in models/text_encoders (as ComfyUI users keep them), BASE's copies
    gone: the single-file partial archive finds all three by content."""
    from single_file_ckpt import build_tiny_sd3, sd3_checkpoint_from_pipeline

    from dduf_plus import load_dduf

    base = build_tiny_sd3(tmp_path / "sd3", TINY_SD / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer")
    moved = ("text_encoder", "text_encoder_2", "text_encoder_3")
    archive, expected = _single_file_partial(
        tmp_path, monkeypatch, base,
        sd3_checkpoint_from_pipeline(base, transformer_delta=0.01, components=("transformer",)), "sd35", moved)
    models = tmp_path / "models" / "text_encoders"
    models.mkdir(parents=True)
    for n, file in zip(moved, ("clip_l", "clip_g", "t5xxl"), strict=True):
        _resave(base / n / "model.safetensors", models / f"{file}.safetensors")  # the fp32 weights the pack named
        shutil.rmtree(base / n)
    assert_same_states(load_dduf(archive, model_dirs=[tmp_path / "models"]), expected)


def test_flux_text_encoders_and_vae_from_app_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Flux: the BFL transformer file packed against BASE; the VAE (diffusers' file, as apps also keep it), CLIP-L
    and T5 (re-saved) in an app's folders, BASE's copies gone: all three found by content."""
    from single_file_ckpt import build_tiny_flux, flux_checkpoint

    from dduf_plus import load_dduf

    base = build_tiny_flux(tmp_path / "flux", TINY_SD / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer")
    moved = ("vae", "text_encoder", "text_encoder_2")
    archive, expected = _single_file_partial(tmp_path, monkeypatch, base, flux_checkpoint(base, transformer_delta=0.01),
                                             "flux1", moved)
    models = tmp_path / "models"
    (models / "vae").mkdir(parents=True)
    (models / "text_encoders").mkdir()
    shutil.copy(base / "vae" / "diffusion_pytorch_model.safetensors", models / "vae" / "ae.safetensors")
    _resave(base / "text_encoder" / "model.safetensors", models / "text_encoders" / "clip_l.safetensors")
    _resave(base / "text_encoder_2" / "model.safetensors", models / "text_encoders" / "t5xxl.safetensors")
    for n in moved:
        shutil.rmtree(base / n)
    assert_same_states(load_dduf(archive, model_dirs=[models]), expected)
