"""Archives out: ``export_single_file(ARCHIVE, OUT.safetensors)`` / ``dduf export``.

Per family, a tiny checkpoint in the original layout (ORIGINAL, tests/single_file_ckpt.py) is packed against its
BASE (a partial archive: what differs stored, the rest referenced) and exported; the proof is what issue #30
asks: ``from_single_file(OUT, config=BASE)`` equals ``from_single_file(ORIGINAL, config=BASE)`` and
``load_dduf(ARCHIVE)`` tensor for tensor, diffusers' ``infer_diffusers_model_type`` says the same type for
both files, and ``pack(OUT, base=BASE)`` gives back the same archive."""

from __future__ import annotations

import gc
import json
import os
import shutil
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from single_file_ckpt import (
    build_tiny_flux,
    build_tiny_sd3,
    build_tiny_sdxl,
    checkpoint_from_pipeline,
    flux_checkpoint,
    sd3_checkpoint_from_pipeline,
)

from conftest import PIPELINES
from dduf_plus.errors import DDUFError, DDUFReferenceError, DDUFUsageError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.packing.export import export_single_file
from dduf_plus.packing.single_file import pack_single_file, read_checkpoint_header

TINY_SD = PIPELINES / "tiny-sd"


def _save(state: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    save_file(state, path)
    return path


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core runner: one intra-op thread (see tests/test_single_file_sd3.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sd(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """SD 1.x (fp32, UNet changed) against tiny-sd; SDXL (fp16, every component, UNet changed) against a tiny SDXL
    base (fp32 files with fp16 variants)."""
    out = tmp_path_factory.mktemp("export-sd")
    sdxl = build_tiny_sdxl(out / "tiny-sdxl", TINY_SD / "tokenizer")
    return {"sdxl_base": sdxl,
            "sd1": _save(checkpoint_from_pipeline(TINY_SD, "v1", unet_delta=0.01, dtype=torch.float32),
                         out / "sd1.safetensors"),
            "sdxl": _save(checkpoint_from_pipeline(sdxl, "xl_base", unet_delta=0.01, dtype=torch.float16),
                          out / "sdxl.safetensors")}


def _model_type(path: Path) -> str:
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    class Shape:
        def __init__(self, shape: tuple[int, ...]):
            self.shape = shape

    return str(infer_diffusers_model_type({k: Shape(v.shape) for k, v in read_checkpoint_header(path).tensors.items()}))


def _same_modules(a: Any, b: Any, names: tuple[str, ...]) -> int:
    """Every named component of two pipelines tensor for tensor (names, dtypes, values); the tensors compared."""
    count = 0
    for name in names:
        mine, other = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        assert mine.keys() == other.keys(), name
        for k in mine:
            assert mine[k].dtype == other[k].dtype and torch.equal(mine[k], other[k]), (name, k)
        count += len(mine)
    return count


def _stored(archive: Path) -> dict[str, bytes]:
    with DDUFArchive(archive) as a:
        return {n: bytes(a.read_bytes(n)) for n in a if "/" in n}


def _pack_back(out: Path, base: Path, archive: Path, tmp_path: Path) -> None:
    """``pack OUT --base BASE`` gives back the archive: the same entries, bytes, references and index."""
    again = tmp_path / "again.dduf"
    pack_single_file(out, again, base=str(base), quiet=True, fsync=False)
    with DDUFArchive(archive) as a, DDUFArchive(again) as b:
        assert a.references == b.references and a.model_index == b.model_index
    assert _stored(archive) == _stored(again)


def _metadata(path: Path) -> dict[str, str]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])["__metadata__"]


def _fix_t5(pipe: Any, name: str) -> Any:
    """diffusers 0.42.1 + transformers 5 from a single file: T5's tied embed_tokens left on the meta device and
    the model in training mode (tests/test_single_file_sd3.py); tied and eval()'d as from_pretrained does."""
    t5 = getattr(pipe, name)
    if t5.encoder.embed_tokens.weight.is_meta:
        t5.tie_weights()
    t5.eval()
    return pipe


def _proof(ckpt: Path, base: Path, cls_name: str, dtype: torch.dtype, names: tuple[str, ...], tmp_path: Path,
           t5: str | None = None) -> Path:
    import diffusers

    from dduf_plus import load_dduf

    archive = tmp_path / "a.dduf"
    pack_single_file(ckpt, archive, base=str(base), quiet=True, fsync=False)
    out = tmp_path / "out.safetensors"
    result = export_single_file(archive, out, fsync=False)
    assert result.path == out and result.bytes == out.stat().st_size
    assert _model_type(out) == _model_type(ckpt) == result.model_type
    cls = getattr(diffusers, cls_name)
    theirs = cls.from_single_file(str(ckpt), config=str(base), torch_dtype=dtype, local_files_only=True)
    mine = cls.from_single_file(str(out), config=str(base), torch_dtype=dtype, local_files_only=True)
    if t5:
        _fix_t5(theirs, t5), _fix_t5(mine, t5)
    assert _same_modules(mine, theirs, names) > 0
    del theirs
    ours = load_dduf(archive, torch_dtype=dtype)
    assert _same_modules(mine, ours, names) > 0
    del mine, ours
    gc.collect()
    _pack_back(out, base, archive, tmp_path)
    return out


SD_NAMES = ("unet", "vae", "text_encoder")


def test_sd1_export_round_trip(sd: dict[str, Path], tmp_path: Path) -> None:
    out = _proof(sd["sd1"], TINY_SD, "StableDiffusionPipeline", torch.float32, SD_NAMES, tmp_path)
    meta = _metadata(out)
    assert meta["modelspec.architecture"] == "stable-diffusion-v1" and meta["modelspec.title"] == "a"
    keys = read_checkpoint_header(out).tensors
    assert any(k.startswith("model.diffusion_model.input_blocks.") for k in keys)
    assert any(k.startswith("first_stage_model.decoder.up.") for k in keys)
    assert any(k.startswith("cond_stage_model.transformer.text_model.") for k in keys)


def test_sdxl_export_round_trip(sd: dict[str, Path], tmp_path: Path) -> None:
    """Every component stored in fp16 against an fp32 base with fp16 variants: the references are to BASE's
    fp16 files, resolved and read as those."""
    out = _proof(sd["sdxl"], sd["sdxl_base"], "StableDiffusionXLPipeline", torch.float16,
                 SD_NAMES + ("text_encoder_2",), tmp_path)
    assert _metadata(out)["modelspec.architecture"] == "stable-diffusion-xl-v1-base"
    keys = read_checkpoint_header(out).tensors
    assert "conditioner.embedders.1.model.text_projection" in keys  # OpenCLIP's layout: transposed back
    assert any(k.endswith("attn.in_proj_weight") for k in keys)  # q/k/v fused back


def test_sd3_export_round_trip(tmp_path: Path) -> None:
    base = build_tiny_sd3(tmp_path / "tiny-sd3", TINY_SD / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer")
    ckpt = _save(sd3_checkpoint_from_pipeline(base, transformer_delta=0.01, dtype=torch.float16),
                 tmp_path / "sd35.safetensors")
    work = tmp_path / "work"
    work.mkdir()
    out = _proof(ckpt, base, "StableDiffusion3Pipeline", torch.float16,
                 ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"), work, t5="text_encoder_3")
    assert _metadata(out)["modelspec.architecture"] == "stable-diffusion-v3.5-large"
    assert "text_encoders.clip_l.transformer.text_projection.weight" not in read_checkpoint_header(out).tensors


def test_flux_export_round_trip(tmp_path: Path) -> None:
    """A ComfyUI full file (transformer under model.diffusion_model. in BFL's layout, VAE, CLIP-L, T5); and the
    transformer alone for models/diffusion_models, in BFL's bare layout."""
    from diffusers import FluxTransformer2DModel

    from dduf_plus import load_dduf

    base = build_tiny_flux(tmp_path / "tiny-flux", TINY_SD / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer")
    ckpt = _save(flux_checkpoint(base, layout="comfy", full=True, transformer_delta=0.01), tmp_path / "full.safetensors")
    work = tmp_path / "work"
    work.mkdir()
    out = _proof(ckpt, base, "FluxPipeline", torch.bfloat16, ("transformer", "vae", "text_encoder", "text_encoder_2"),
                 work, t5="text_encoder_2")
    assert _metadata(out)["modelspec.architecture"] == "flux-1-dev"
    out.unlink()
    alone = export_single_file(work / "a.dduf", work / "flux1.safetensors", component="transformer", fsync=False)
    keys = read_checkpoint_header(alone.path).tensors
    assert "double_blocks.0.img_attn.qkv.weight" in keys and not any(k.startswith("model.") for k in keys)
    assert _model_type(alone.path) == "flux-dev" and alone.architecture == "flux-1-dev/transformer"
    mine = FluxTransformer2DModel.from_single_file(str(alone.path), config=str(base), subfolder="transformer",
                                                   torch_dtype=torch.bfloat16, local_files_only=True)
    assert _same_modules(type("P", (), {"transformer": mine})(), load_dduf(work / "a.dduf"), ("transformer",)) > 0


def test_component_vae_and_text_encoder_for_app_folders(sd: dict[str, Path], tmp_path: Path) -> None:
    """``component="vae"``: a bare LDM VAE (models/vae); ``text_encoder_2``: transformers' CLIP layout (ComfyUI's
    clip_g file in models/text_encoders), not OpenCLIP's."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModelWithProjection

    from dduf_plus import load_dduf

    archive = tmp_path / "a.dduf"
    pack_single_file(sd["sdxl"], archive, base=str(sd["sdxl_base"]), quiet=True, fsync=False)
    ours = load_dduf(archive, torch_dtype=torch.float16)
    vae = export_single_file(archive, tmp_path / "vae.safetensors", component="vae", fsync=False)
    keys = read_checkpoint_header(vae.path).tensors
    assert "encoder.conv_in.weight" in keys and not any(k.startswith("first_stage_model.") for k in keys)
    assert vae.architecture == "stable-diffusion-xl-v1-base/vae"
    mine = AutoencoderKL.from_single_file(str(vae.path), config=str(sd["sdxl_base"]), subfolder="vae",
                                          torch_dtype=torch.float16, local_files_only=True)
    assert _same_modules(type("P", (), {"vae": mine})(), ours, ("vae",)) > 0
    te = export_single_file(archive, tmp_path / "clip_g.safetensors", component="text_encoder_2", fsync=False)
    from safetensors.torch import load_file

    state = load_file(te.path)
    assert "text_projection.weight" in state and all(k.startswith(("text_model.", "text_projection")) for k in state)
    model = CLIPTextModelWithProjection.from_pretrained(sd["sdxl_base"], subfolder="text_encoder_2")
    flat = not any(k.startswith("text_model.") for k in model.state_dict())
    theirs = ours.text_encoder_2.state_dict()
    assert {(k.removeprefix("text_model.") if flat and k != "text_projection.weight" else k) for k in state} \
        == set(theirs)
    assert all(torch.equal(v, theirs[k.removeprefix("text_model.") if flat else k]) for k, v in state.items())
    with pytest.raises(DDUFUsageError, match="--component 'controlnet'"):
        export_single_file(archive, tmp_path / "x.safetensors", component="controlnet")


def test_deterministic_dtype_and_atomic(sd: dict[str, Path], tmp_path: Path) -> None:
    archive = tmp_path / "a.dduf"
    pack_single_file(sd["sd1"], archive, base=str(TINY_SD), quiet=True, fsync=False)
    one = export_single_file(archive, tmp_path / "one.safetensors", title="t", fsync=False)
    two = export_single_file(archive, tmp_path / "two.safetensors", title="t", fsync=False)
    assert one.path.read_bytes() == two.path.read_bytes()
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(one.path.stat().st_mode) == 0o644 & ~umask  # as apps' model files are (was 0600)
    half = export_single_file(archive, tmp_path / "half.safetensors", dtype="fp16", fsync=False)
    dtypes = {t.dtype for t in read_checkpoint_header(half.path).tensors.values()}
    assert dtypes == {"float16"}, dtypes
    assert half.bytes < one.bytes
    with pytest.raises(DDUFUsageError, match="--dtype"):
        export_single_file(archive, tmp_path / "x.safetensors", dtype="int3")
    # a reference that cannot be resolved: refused, and nothing (not even a temporary file) is left
    moved = tmp_path / "moved"
    shutil.copytree(TINY_SD, moved)
    partial = tmp_path / "p.dduf"
    pack_single_file(sd["sd1"], partial, base=str(moved), quiet=True, fsync=False)
    shutil.rmtree(moved)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(DDUFReferenceError):
        export_single_file(partial, tmp_path / "broken.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_cli_export(sd: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dduf_plus.cli import main

    archive = tmp_path / "a.dduf"
    pack_single_file(sd["sd1"], archive, base=str(TINY_SD), quiet=True, fsync=False)
    out = tmp_path / "out.safetensors"
    assert main(["export", str(archive), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "unet: stored" in text and "vae: recorded folder" in text and "stable-diffusion-v1 (v1)" in text
    assert main(["export", str(archive), "-o", str(out)]) == 2  # exists: --force
    assert main(["export", str(archive), "-o", str(tmp_path / "v.safetensors"), "--component", "vae", "-q"]) == 0
    assert capsys.readouterr().out == ""
    assert main(["export", str(tmp_path / "missing.dduf"), "-o", str(tmp_path / "m.safetensors")]) == 2
    bad = tmp_path / "bad.dduf"
    bad.write_bytes(b"garbage" * 100)
    assert main(["export", str(bad), "-o", str(tmp_path / "b.safetensors")]) == 1
    assert not (tmp_path / "m.safetensors").exists() and not (tmp_path / "b.safetensors").exists()


def test_unsupported_pipeline_is_refused(tmp_path: Path) -> None:
    from dduf_plus.packing.pack import pack

    archive = tmp_path / "dit.dduf"
    pack(PIPELINES / "tiny-dit", archive, quiet=True)
    with pytest.raises(DDUFError, match="no single-file layout"):
        export_single_file(archive, tmp_path / "x.safetensors")


def test_component_unet_packs_back_and_loads_in_diffusers(sd: dict[str, Path], tmp_path: Path) -> None:
    """``component="unet"`` keeps ``model.diffusion_model.``: diffusers' UNet from_single_file reads it, and
    ``dduf pack`` takes it back (the UNet stored, everything else referenced)."""
    from diffusers import UNet2DConditionModel

    from dduf_plus import load_dduf

    archive = tmp_path / "a.dduf"
    pack_single_file(sd["sd1"], archive, base=str(TINY_SD), quiet=True, fsync=False)
    unet = export_single_file(archive, tmp_path / "unet.safetensors", component="unet", fsync=False)
    assert all(k.startswith("model.diffusion_model.") for k in read_checkpoint_header(unet.path).tensors)
    mine = UNet2DConditionModel.from_single_file(str(unet.path), config=str(TINY_SD), subfolder="unet",
                                                 local_files_only=True)
    assert _same_modules(type("P", (), {"unet": mine})(), load_dduf(archive), ("unet",)) > 0
    again = tmp_path / "again.dduf"
    _result, partial = pack_single_file(unet.path, again, base=str(TINY_SD), quiet=True, fsync=False)
    assert _stored(again) == _stored(archive)


@pytest.mark.parametrize("family", ["v2", "xl_refiner"])
def test_sd2_and_refiner_export_round_trip(family: str, tmp_path: Path) -> None:
    """SD 2.x (OpenCLIP-H in cond_stage_model.model., no projection: diffusers' CLIPTextModel has none) and the
    SDXL refiner (OpenCLIP-G only, as conditioner.embedders.0.model.)."""
    from single_file_ckpt import build_tiny_sd2, build_tiny_sdxl_refiner

    if family == "v2":
        base = build_tiny_sd2(tmp_path / "tiny-sd2", TINY_SD / "tokenizer")
        ckpt = _save(checkpoint_from_pipeline(base, "v2", unet_delta=0.01), tmp_path / "sd2.safetensors")
        cls, names, dtype = "StableDiffusionPipeline", SD_NAMES, torch.float32
    else:
        base = build_tiny_sdxl_refiner(tmp_path / "tiny-refiner", TINY_SD / "tokenizer")
        ckpt = _save(checkpoint_from_pipeline(base, "xl_refiner", unet_delta=0.01, dtype=torch.float16),
                     tmp_path / "refiner.safetensors")
        cls, names, dtype = "StableDiffusionXLImg2ImgPipeline", ("unet", "vae", "text_encoder_2"), torch.float16
    work = tmp_path / "work"
    work.mkdir()
    out = _proof(ckpt, base, cls, dtype, names, work)
    want = {"v2": "stable-diffusion-v2-512", "xl_refiner": "stable-diffusion-xl-v1-refiner"}[family]
    assert _metadata(out)["modelspec.architecture"] == want


@pytest.mark.parametrize("kernel", ["stops half-way", "absent"])
def test_export_without_a_full_kernel_copy_writes_the_same_bytes(sd: dict[str, Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    """A copy_file_range that copies part of a tensor and then meets another file system (EXDEV), or none at all:
    the rest comes through the maps, nothing written twice or left out (fd_io.kernel_copy)."""
    import errno

    archive = tmp_path / "a.dduf"
    pack_single_file(sd["sd1"], archive, base=str(TINY_SD), quiet=True, fsync=False)
    whole = export_single_file(archive, tmp_path / "whole.safetensors", fsync=False).path.read_bytes()
    real, calls = os.copy_file_range, []

    def half_then_exdev(src: int, dst: int, count: int, *offsets: int | None) -> int:
        calls.append(count)
        if len(calls) > 1:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        return real(src, dst, max(1, count // 2), *offsets)

    if kernel == "absent":
        monkeypatch.delattr(os, "copy_file_range")
    else:
        monkeypatch.setattr(os, "copy_file_range", half_then_exdev)
    assert export_single_file(archive, tmp_path / "b.safetensors", fsync=False).path.read_bytes() == whole
    assert len(calls) == (2 if kernel != "absent" else 0)
