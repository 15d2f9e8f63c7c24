"""Model folders in the layouts apps keep (refs/model_dirs.py + packing/model_dir_layouts.py): a full original
checkpoint in ``models/checkpoints`` gives its UNet, VAE and text encoder; a bare LDM UNet in ``models/unet``, an
OpenCLIP text encoder, SD3's MMDiT and BFL's Flux transformer in ``models/diffusion_models`` are found by content
(fused q/k/v split, halves swapped, a projection really transposed), BASE's copies absent, and load equal to
BASE tensor for tensor. A second load hashes nothing; a file whose header fits but whose bytes differ, and
hostile files, are rejected with a reason."""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pipeline_states import assert_same_states, states
from safetensors.torch import load_file, save_file
from single_file_ckpt import (
    _config,
    _state,
    build_tiny_flux,
    build_tiny_sd2,
    build_tiny_sd3,
    build_tiny_sdxl,
    build_tiny_sdxl_refiner,
    checkpoint_from_pipeline,
    flux_to_bfl,
    open_clip_to_ldm,
    sd3_transformer_to_original,
    unet_to_ldm,
)

from conftest import PIPELINES
from dduf_plus.errors import DDUFFormatError, DDUFLoadError, DDUFReferenceError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.safetensors_header import TensorInfo, read_file_header
from dduf_plus.packing import pack
from dduf_plus.packing.model_dir_layouts import read_parts
from dduf_plus.refs import model_dirs, tensor_digest
from dduf_plus.refs.resolve import check_references, locate_component

pytestmark = pytest.mark.usefixtures("app_cache")

TINY_SD = PIPELINES / "tiny-sd"
SD_PARTS = ("unet", "vae", "text_encoder")




def _fp32_base(out: Path) -> Path:
    """tiny-sd re-saved by diffusers in float32: one weights file per component (a sharded component records no
    tensor digest, so model folders do not apply to it)."""
    from diffusers import DiffusionPipeline

    DiffusionPipeline.from_pretrained(TINY_SD, torch_dtype=torch.float32).save_pretrained(out)
    return out


def _partial(base: Path, out: Path, exclude: tuple[str, ...]) -> Path:
    pack(base, out, exclude=list(exclude), refs={n: str(base) for n in exclude}, quiet=True, fsync=False)
    return out


def _image(pipe: Any) -> Any:
    return pipe("a cat", num_inference_steps=1, output_type="np", height=32, width=32,
                generator=torch.Generator().manual_seed(0)).images


def _rows(archive: Path, dirs: list[Path]) -> dict[str, dict[str, Any]]:
    with DDUFArchive(archive) as a:
        refs = dict(a.references)
    return {r["component"]: r for r in check_references(refs, model_dirs=dirs)}


@pytest.fixture
def sd15(tmp_path: Path) -> dict[str, Any]:
    """An fp32 tiny SD 1.5 BASE, a partial archive referencing its UNet, VAE and text encoder, the pipeline and a
    1-step image loaded from BASE; then ONE full original checkpoint of BASE in models/checkpoints and BASE's
    copies deleted."""
    from dduf_plus import load_dduf

    base = _fp32_base(tmp_path / "base")
    archive = _partial(base, tmp_path / "sd15.dduf", SD_PARTS)
    pipe = load_dduf(archive)
    expected, image = states(pipe, SD_PARTS), _image(pipe)
    models = tmp_path / "models"
    (models / "checkpoints").mkdir(parents=True)
    full = models / "checkpoints" / "sd15-pruned.safetensors"
    save_file(checkpoint_from_pipeline(base, "v1"), full)
    for n in SD_PARTS:
        shutil.rmtree(base / n)
    return {"base": base, "archive": archive, "expected": expected, "image": image, "models": models, "full": full}


def test_sd15_unet_vae_and_text_encoder_from_one_full_checkpoint(sd15: dict[str, Any], hashed: list[str],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from dduf_plus import load_dduf
    from dduf_plus.cli import main

    with pytest.raises(DDUFReferenceError):
        load_dduf(sd15["archive"])  # BASE's copies are gone
    pipe = load_dduf(sd15["archive"], model_dirs=[sd15["models"]])
    assert_same_states(pipe, sd15["expected"])
    assert (_image(pipe) == sd15["image"]).all()
    assert _weights_in_cache() == []  # used in place: no copy of any part written into dduf_plus' cache
    assert sorted(h.split(":")[1].split(" (")[0] for h in hashed if ":" in h) == [
        "CLIP under cond_stage_model.transformer.", "LDM UNet under model.diffusion_model.",
        "LDM VAE under first_stage_model."]
    rows = _rows(sd15["archive"], [sd15["models"]])
    assert all(rows[n]["how"] == "model folder" and "sd15-pruned.safetensors" in rows[n]["found"] for n in SD_PARTS)
    assert "LDM UNet under model.diffusion_model. layout" in rows["unet"]["found"]
    assert main(["refs", str(sd15["archive"]), "--model-dir", str(sd15["models"])]) == 0
    out = capsys.readouterr().out
    assert "unet" in out and "sd15-pruned.safetensors (LDM UNet under model.diffusion_model. layout" in out
    hashed.clear()
    assert_same_states(load_dduf(sd15["archive"], model_dirs=[sd15["models"]]), sd15["expected"])
    assert hashed == []  # the parts and the written copies are remembered: a second load hashes nothing


def test_a_changed_or_tampered_checkpoint_is_hashed_again_or_skipped_and_said(
        sd15: dict[str, Any], hashed: list[str], caplog: pytest.LogCaptureFixture) -> None:
    from dduf_plus import load_dduf

    full: Path = sd15["full"]
    state = load_file(full)
    key = "model.diffusion_model.input_blocks.0.0.weight"
    state[key] = state[key] + 1
    tampered = full.parent / "a-merge.safetensors"  # found first (name order): same header, other bytes
    save_file(state, tampered)
    with caplog.at_level("WARNING", logger="dduf_plus"):
        assert_same_states(load_dduf(sd15["archive"], model_dirs=[sd15["models"]]), sd15["expected"])
    assert "a-merge.safetensors" in caplog.text and "bytes differ" in caplog.text
    full.unlink()
    with DDUFArchive(sd15["archive"]) as a:
        ref = a.references["unet"]
    with pytest.raises(DDUFReferenceError, match="LDM UNet under model.diffusion_model.: its header fits but"):
        locate_component("unet", ref, model_dirs=[sd15["models"]])
    vae = locate_component("vae", _ref(sd15["archive"], "vae"), model_dirs=[sd15["models"]])
    assert "a-merge.safetensors" in vae.source  # its VAE part is untouched: still used
    hashed.clear()
    os.utime(tampered, ns=(1, 1))  # changed since: hashed again
    locate_component("vae", _ref(sd15["archive"], "vae"), model_dirs=[sd15["models"]])
    assert hashed == ["a-merge.safetensors:LDM VAE under first_stage_model."]


def _ref(archive: Path, name: str) -> dict[str, Any]:
    with DDUFArchive(archive) as a:
        return dict(a.references[name])


def _weights_in_cache() -> list[Path]:
    """Weights files in dduf_plus' cache (the fixture's), where a renamed copy of a part would be written (not the
    view folders' links)."""
    return sorted(p for p in Path(os.environ["DDUF_PLUS_CACHE"]).rglob("*.safetensors") if not p.is_symlink())


def test_a_part_is_viewed_in_place_copy_on_write(sd15: dict[str, Any]) -> None:
    """The UNet part of a full checkpoint: a folder of the recorded config and one virtual weights file, whose
    tensors are views of the user's file (mapped copy-on-write: writing to one never reaches the file), its header
    the one the renamed copy has; a file changed since it was verified is refused before it is mapped."""
    from dduf_plus.loading.files import resolve_component
    from dduf_plus.loading.in_place import MappedPartFiles
    from dduf_plus.refs.cache import sha256_file

    full: Path = sd15["full"]
    before = sha256_file(full)
    files = resolve_component("unet", _ref(sd15["archive"], "unet"), model_dirs=[sd15["models"]])
    assert isinstance(files, MappedPartFiles)
    weights = files.weight_files()
    assert weights == ["diffusion_pytorch_model.safetensors"]
    assert files.listdir() == ["config.json", *weights] and files.read_json("config.json")["_class_name"]
    with pytest.raises(DDUFLoadError, match="never read whole"):
        files.read_bytes(weights[0])
    tensors = files.tensors(weights)
    assert {k: v for k, v in tensors.items()}.keys() == sd15["expected"]["unet"].keys()
    assert all(torch.equal(tensors[k], v) for k, v in sd15["expected"]["unet"].items())
    part = files.in_place.part
    a, b = "conv_in.weight", "conv_in.bias"
    assert len(part.tensors[a].ranges) == len(part.tensors[b].ranges) == 1
    # views of one mapping of the user's file: as far apart in memory as their bytes are in the file
    assert tensors[b].data_ptr() - tensors[a].data_ptr() == part.tensors[b].ranges[0][0] - part.tensors[a].ranges[0][0]
    tensors[a].add_(1)
    assert sha256_file(full) == before and _weights_in_cache() == []
    header = files.safetensors_header(weights[0])
    assert {n: i.shape for n, i in header.tensors.items()} == {n: tuple(v.shape) for n, v in tensors.items()}
    os.utime(full, ns=(1, 1))
    again = resolve_component("unet", _ref(sd15["archive"], "unet"), model_dirs=[sd15["models"]])
    os.utime(full, ns=(2, 2))  # changed between the search and the load
    with pytest.raises(DDUFReferenceError, match="changed since its tensors were verified"):
        again.tensors(weights)


def test_the_copy_is_hashed_as_written_and_refused_when_the_file_changed(sd15: dict[str, Any],
                                                                          hashed: list[str]) -> None:
    """``InPlace.copy`` (what ``dduf complete`` and export read): written once, its digest from the bytes as they
    were written (not hashed again), then remembered; a file whose bytes changed since it was verified leaves
    nothing behind."""
    loc = locate_component("vae", _ref(sd15["archive"], "vae"), model_dirs=[sd15["models"]])
    assert loc.in_place is not None and set(loc.files) == {"config.json"}
    hashed.clear()
    copy = loc.in_place.copy()
    assert hashed == [] and model_dirs.verified_digest(copy) == loc.in_place.digest
    header = read_file_header(copy, copy.name, DDUFFormatError)
    assert tensor_digest.tensors_digest([(copy, header)]) == loc.in_place.digest  # what was remembered is right
    copy.unlink()
    full: Path = sd15["full"]
    data = bytearray(full.read_bytes())
    src = next(iter(loc.in_place.part.tensors.values()))
    at = loc.in_place.part.data_start + src.ranges[0][0]
    data[at] ^= 0xFF
    full.write_bytes(bytes(data))
    with pytest.raises(DDUFFormatError, match="changed since its LDM VAE"):
        loc.in_place.copy()
    assert _weights_in_cache() == []


def test_a_file_changed_while_hashed_is_not_remembered(sd15: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    real = model_dirs.part_digest
    calls: list[str] = []

    def touching(path: Path, part: Any) -> str:
        calls.append(part.layout)
        out = real(path, part)
        os.utime(path, ns=(len(calls), len(calls)))  # written to while it was read
        return out

    monkeypatch.setattr(model_dirs, "part_digest", touching)
    for _ in range(2):  # nor used: the bytes hashed may not be the file's now (tests/test_hostile_0100.py)
        with pytest.raises(DDUFReferenceError, match="changed while it was searched"):
            locate_component("vae", _ref(sd15["archive"], "vae"), model_dirs=[sd15["models"]])
    assert calls == ["LDM VAE under first_stage_model."] * 2


def test_sdxl_bare_unet_and_open_clip_g(tmp_path: Path, hashed: list[str]) -> None:
    """SDXL: the UNet as a bare LDM file (models/unet), CLIP-G as a bare OpenCLIP file (fused in_proj, its
    projection transposed) in models/text_encoders."""
    from dduf_plus import load_dduf

    base = build_tiny_sdxl(tmp_path / "sdxl", TINY_SD / "tokenizer")
    moved = ("unet", "text_encoder_2")
    archive = _partial(base, tmp_path / "xl.dduf", moved)
    expected = states(load_dduf(archive), moved)
    proj = expected["text_encoder_2"]["text_projection.weight"]
    assert not torch.equal(proj, proj.T)  # a transpose that did nothing would prove nothing
    models = tmp_path / "models"
    (models / "unet").mkdir(parents=True)
    (models / "text_encoders").mkdir()
    prefix = "model.diffusion_model."
    save_file({k.removeprefix(prefix): v for k, v in unet_to_ldm(_state(base, "unet"), _config(base, "unet")).items()},
              models / "unet" / "sdxl_unet.safetensors")
    clip_g = open_clip_to_ldm(_state(base, "text_encoder_2"), "")
    assert "transformer.resblocks.0.attn.in_proj_weight" in clip_g and "text_projection" in clip_g
    save_file(clip_g, models / "text_encoders" / "open_clip_g.safetensors")
    for n in moved:
        shutil.rmtree(base / n)
    assert_same_states(load_dduf(archive, model_dirs=[models]), expected)
    rows = _rows(archive, [models])
    assert "sdxl_unet.safetensors (LDM UNet layout" in rows["unet"]["found"]
    assert "open_clip_g.safetensors (OpenCLIP text encoder" in rows["text_encoder_2"]["found"]


@pytest.mark.parametrize(("family", "build", "parts"), [
    ("v2", build_tiny_sd2, ("unet", "vae", "text_encoder")),  # OpenCLIP-H under cond_stage_model.model.
    ("xl_refiner", build_tiny_sdxl_refiner, ("unet", "vae", "text_encoder_2")),  # under conditioner.embedders.0.model.
])
def test_sd2_and_sdxl_refiner_parts_from_one_full_checkpoint(tmp_path: Path, hashed: list[str], family: str,
                                                              build: Any, parts: tuple[str, ...]) -> None:
    """SD 2.x and the SDXL refiner: the UNet, VAE and OpenCLIP text encoder of one full original checkpoint in
    models/checkpoints, BASE's copies gone, load equal to BASE; the second load hashes nothing."""
    from dduf_plus import load_dduf

    base = build(tmp_path / family, TINY_SD / "tokenizer")
    archive = _partial(base, tmp_path / f"{family}.dduf", parts)
    expected = states(load_dduf(archive), parts)
    models = tmp_path / "models"
    (models / "checkpoints").mkdir(parents=True)
    save_file(checkpoint_from_pipeline(base, family), models / "checkpoints" / f"{family}.safetensors")
    for n in parts:
        shutil.rmtree(base / n)
    hashed.clear()  # the pack hashed BASE's files for their digest
    assert_same_states(load_dduf(archive, model_dirs=[models]), expected)
    assert sorted(h.split(":")[0] for h in hashed) == [f"{family}.safetensors"] * len(parts), hashed
    rows = _rows(archive, [models])
    assert all(f"{family}.safetensors (" in rows[n]["found"] for n in parts), rows
    hashed.clear()
    assert_same_states(load_dduf(archive, model_dirs=[models]), expected)
    assert hashed == []  # remembered: the second load hashes nothing


@pytest.mark.parametrize("family", ["sd3", "flux-bfl", "flux-comfy"])
def test_transformer_from_an_original_file_in_diffusion_models(tmp_path: Path, family: str) -> None:
    """SD3's MMDiT (fused qkv, the last adaLN's halves swapped) and BFL's Flux transformer (fused qkv and
    single-block linear1, swapped final adaLN), bare or under ``model.diffusion_model.``."""
    from dduf_plus import load_dduf

    if family == "sd3":
        base = build_tiny_sd3(tmp_path / "sd3", TINY_SD / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer")
        original = sd3_transformer_to_original(_state(base, "transformer"), prefix="")
        layout = "MMDiT transformer layout"
    else:
        base = build_tiny_flux(tmp_path / "flux", TINY_SD / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer")
        prefix = "model.diffusion_model." if family == "flux-comfy" else ""
        original = flux_to_bfl(_state(base, "transformer"), prefix)
        original[prefix + "stray.weight"] = torch.ones(4)  # a key diffusers' converter leaves: ignored, as it does
        layout = "BFL Flux transformer" + (" under model.diffusion_model." if prefix else "") + " layout"
    archive = _partial(base, tmp_path / "t.dduf", ("transformer",))
    expected = states(load_dduf(archive), ("transformer",))
    models = tmp_path / "models" / "diffusion_models"
    models.mkdir(parents=True)
    save_file(original, models / "model.safetensors")
    shutil.rmtree(base / "transformer")
    assert_same_states(load_dduf(archive, model_dirs=[models.parent]), expected)
    assert _weights_in_cache() == []  # swapped halves, fused slices and transposes: from the user's file
    assert layout in _rows(archive, [models.parent])["transformer"]["found"]
    with pytest.MonkeyPatch.context() as m:  # use_mmap=False (network file systems): read, nothing mapped
        m.setattr(mmap, "mmap", _no_map)
        assert_same_states(load_dduf(archive, model_dirs=[models.parent], use_mmap=False), expected)


def _no_map(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("use_mmap=False mapped a file")


def test_a_lora_archive_whose_base_is_an_app_checkpoint(tmp_path: Path) -> None:
    """``dduf pack LORA --base BASE`` references every component of BASE: with BASE's UNet, VAE and text encoder
    only in an app's full checkpoint, the archive loads with the adapter applied, as diffusers gives it."""
    pytest.importorskip("peft")
    from diffusers import DiffusionPipeline
    from lora_files import TE_TARGETS, UNET_TARGETS, diffusers_lora

    from dduf_plus import load_dduf
    from dduf_plus.packing.lora import pack_lora

    base = _fp32_base(tmp_path / "base")
    style = diffusers_lora(base, tmp_path / "style", {"unet": UNET_TARGETS, "text_encoder": TE_TARGETS})
    archive = tmp_path / "lora.dduf"
    pack_lora([style], archive, base=str(base), quiet=True)
    theirs = DiffusionPipeline.from_pretrained(base, torch_dtype=torch.float32)
    theirs.load_lora_weights(str(style.parent), weight_name=style.name, adapter_name="style")
    want = _image(theirs)
    assert abs(want - _image(DiffusionPipeline.from_pretrained(base, torch_dtype=torch.float32))).max() > 1e-4
    models = tmp_path / "models" / "checkpoints"
    models.mkdir(parents=True)
    save_file(checkpoint_from_pipeline(base, "v1"), models / "sd15.safetensors")
    for n in SD_PARTS:
        shutil.rmtree(base / n)
    assert (_image(load_dduf(archive, model_dirs=[models.parent])) == want).all()


# --- hostile files -----------------------------------------------------------------------------------------------
def test_hostile_checkpoints_are_rejected_with_a_reason(sd15: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A huge header, a part whose tensors do not make the layout (a tensor of the wrong size, another's
    renamed), and a converter that fails are each a rejected candidate with its reason, never a crash."""
    from dduf_plus.packing import single_file_convert

    full: Path = sd15["full"]
    folder = full.parent
    (folder / "huge.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    state = load_file(full)
    k = "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"
    state[k] = state[k][:-1]  # one row short: bytes moved to another tensor keep the part's byte total
    b = "cond_stage_model.transformer.text_model.final_layer_norm.bias"
    state[b] = torch.cat([state[b], torch.zeros(state[k].shape[1])])
    save_file(state, folder / "bad-shapes.safetensors")
    unet = load_file(full)
    unet["model.diffusion_model.input_blocks.99.0.weight"] = unet.pop("model.diffusion_model.time_embed.0.weight")
    full.unlink()
    found = model_dirs.find_component("text_encoder", _ref(sd15["archive"], "text_encoder"), [sd15["models"]])
    assert isinstance(found, str)
    assert "huge.safetensors: not a readable safetensors file" in found
    assert "bad-shapes.safetensors: CLIP under cond_stage_model.transformer." in found
    (folder / "bad-shapes.safetensors").unlink()
    save_file(unet, folder / "renamed.safetensors")  # the bytes all there, a tensor diffusers needs is not
    found = model_dirs.find_component("unet", _ref(sd15["archive"], "unet"), [sd15["models"]])
    assert isinstance(found, str) and "renamed.safetensors: LDM UNet under model.diffusion_model.: other tensor " \
        "names" in found

    def crash(*_a: Any, **_k: Any) -> Any:
        raise ZeroDivisionError("a converter's bug on a hostile file")

    monkeypatch.setattr(single_file_convert, "convert_component", crash)
    found = model_dirs.find_component("unet", _ref(sd15["archive"], "unet"), [sd15["models"]])
    assert isinstance(found, str) and "diffusers' converter refused it (ZeroDivisionError" in found


def test_a_readers_ranges_outside_the_file_are_refused(sd15: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The search checks what a reader says before reading a byte: every range inside the data section and the
    ranges of a tensor making its size; a malformed transpose refused."""
    info = TensorInfo("w", "float32", (2, 2), 0, 16)
    assert model_dirs.part_problem(model_dirs.Part("x", 8, {"w": model_dirs.Source(info, ((0, 16),))}), 16) is None
    for src, size in [(model_dirs.Source(info, ((8, 24),)), 16), (model_dirs.Source(info, ((0, 12),)), 16),
                      (model_dirs.Source(info, ((-4, 12),)), 16), (model_dirs.Source(info, ((0, 16),), rows=3), 16),
                      (model_dirs.Source(info, ((0, 8), (8, 16)), rows=2), 16)]:
        assert model_dirs.part_problem(model_dirs.Part("x", 8, {"w": src}), size) is not None

    def lying(*_a: Any) -> Iterator[Any]:
        yield model_dirs.Part("a liar", 8, {"w": model_dirs.Source(info, ((1 << 40, (1 << 40) + 16),))})

    monkeypatch.setattr(model_dirs, "_READERS", [lying])
    found = model_dirs.find_component("vae", _ref(sd15["archive"], "vae"), [sd15["models"]])
    assert isinstance(found, str) and "a liar: w: its byte ranges" in found

    def failing(*_a: Any) -> Iterator[Any]:
        raise RuntimeError("a reader's bug")
        yield

    monkeypatch.setattr(model_dirs, "_READERS", [failing])
    found = model_dirs.find_component("vae", _ref(sd15["archive"], "vae"), [sd15["models"]])
    assert isinstance(found, str) and "the layout reader failed (RuntimeError: a reader's bug)" in found
    # a hostile config text names no class the reader knows: nothing tried, nothing raised
    assert list(read_parts(read_file_header(sd15["full"], "f", DDUFFormatError), {"architectures": 5}, 1, 1)) == []


def test_sd3_full_checkpoint_gives_transformer_vae_clip_g_and_t5(tmp_path: Path) -> None:
    """A full SD3 file (Stability's layout: MMDiT under ``model.diffusion_model.``, the LDM VAE, CLIP-G and T5
    under ``text_encoders.*``) gives four components, each from its own part."""
    from single_file_ckpt import sd3_checkpoint_from_pipeline

    from dduf_plus import load_dduf

    base = build_tiny_sd3(tmp_path / "sd3", TINY_SD / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer")
    moved = ("transformer", "vae", "text_encoder_2", "text_encoder_3")
    archive = _partial(base, tmp_path / "sd3.dduf", moved)
    expected = states(load_dduf(archive), moved)
    models = tmp_path / "models" / "checkpoints"
    models.mkdir(parents=True)
    save_file(sd3_checkpoint_from_pipeline(base), models / "sd3_medium_incl_clips_t5.safetensors")
    for n in moved:
        shutil.rmtree(base / n)
    assert_same_states(load_dduf(archive, model_dirs=[models.parent]), expected)
    rows = _rows(archive, [models.parent])
    assert "MMDiT transformer under model.diffusion_model. layout" in rows["transformer"]["found"]
    assert "CLIP under text_encoders.clip_g.transformer." in rows["text_encoder_2"]["found"]
    assert "T5 under text_encoders.t5xxl.transformer. layout" in rows["text_encoder_3"]["found"]


def test_a_clip_file_with_position_ids_beside_its_weights(sd15: dict[str, Any]) -> None:
    """A CLIP-L file as some apps save it, ``text_model.embeddings.position_ids`` beside the weights (the
    reference has none): one tensor more than the reference, found all the same."""
    full = load_file(sd15["full"])
    prefix = "cond_stage_model.transformer."
    clip = {k.removeprefix(prefix): v for k, v in full.items() if k.startswith(prefix)}
    clip["text_model.embeddings.position_ids"] = torch.arange(77).unsqueeze(0)
    (sd15["models"] / "clip").mkdir()
    save_file(clip, sd15["models"] / "clip" / "clip_l.safetensors")
    sd15["full"].unlink()
    found = locate_component("text_encoder", _ref(sd15["archive"], "text_encoder"), model_dirs=[sd15["models"]])
    assert "clip_l.safetensors (CLIP" in found.source and "layout, read in place" in found.source


def test_complete_takes_the_parts_of_a_full_checkpoint(sd15: dict[str, Any], tmp_path: Path,
                                                       hashed: list[str]) -> None:
    """``dduf complete --model-dir``: the archive made whole from the checkpoint's parts, equal to BASE's; each
    part's renamed copy is written for it (an entry is copied from a file) and never hashed again."""
    from dduf_plus import load_dduf
    from dduf_plus.cli import main

    out = tmp_path / "whole.dduf"
    assert main(["complete", str(sd15["archive"]), "-o", str(out), "--model-dir", str(sd15["models"]), "-q"]) == 0
    copies = _weights_in_cache()
    assert len(copies) == len(SD_PARTS)
    assert not {c.name for c in copies} & set(hashed)  # hashed as written: no second pass over the copy
    with DDUFArchive(out) as a:
        assert not {n for n in a.references if n in SD_PARTS}
    assert_same_states(load_dduf(out), sd15["expected"])
