"""Partial archives decided by content, the trainer's workflow: ``from_pretrained(BASE)``, change the denoiser,
``save_pretrained(FT)``, ``dduf pack FT --base BASE``. diffusers rewrites every config, transformers 5 rewrites
``tokenizer_config.json`` and drops the slow tokenizer's files, the UNet comes back in one file instead of shards:
no file of FT is byte-identical to BASE's, yet every component but the denoiser is BASE's and must be referenced
(BASE as a folder, a .dduf and a Hugging Face cache snapshot), and the load must equal ``from_pretrained(FT)``."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hfcache import cached
from single_file_ckpt import build_tiny_flux, build_tiny_sdxl

from dduf_plus import load_dduf
from dduf_plus.errors import DDUFPackError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.validate import validate
from dduf_plus.packing.pack import pack
from dduf_plus.packing.partial import pack_partial

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "fixtures" / "pipelines"
TINY_SD = PIPELINES / "tiny-sd"
FROZEN_SD = {"scheduler", "text_encoder", "tokenizer", "vae"}


def finetune(base: Path, out: Path, denoiser: str = "unet", **kwargs: Any) -> Path:
    """What a trainer does: load BASE with diffusers, change the denoiser, save_pretrained."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(base, **kwargs)
    with torch.no_grad():
        for p in getattr(pipe, denoiser).parameters():
            p.add_(0.01)
    pipe.save_pretrained(out)
    return out


def report_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("dduf_plus")]


def assert_loads_like_folder(archive: Path, folder: Path, prompt_steps: int = 2) -> None:
    """Every tensor of every model equal to diffusers' from_pretrained(folder), and the same output."""
    from diffusers import DiffusionPipeline

    ours = load_dduf(archive)
    theirs = DiffusionPipeline.from_pretrained(folder)
    for name, module in theirs.components.items():
        if isinstance(module, torch.nn.Module):
            a, b = getattr(ours, name).state_dict(), module.state_dict()
            assert set(a) == set(b), name
            assert all(torch.equal(a[k].to(b[k].dtype), b[k]) for k in a), name
    if prompt_steps:
        kwargs = {"num_inference_steps": prompt_steps, "output_type": "np", "height": 32, "width": 32}
        x = ours("a cat", generator=torch.Generator().manual_seed(0), **kwargs).images
        y = theirs("a cat", generator=torch.Generator().manual_seed(0), **kwargs).images
        assert (x == y).all()


@pytest.fixture(scope="module")
def sd_ft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return finetune(TINY_SD, tmp_path_factory.mktemp("ft") / "tiny-sd-ft")


def test_no_file_of_the_trainers_folder_is_byte_identical(sd_ft: Path) -> None:
    """The premise (diffusers 0.42, transformers 5): a byte-identity rule would reference nothing."""
    for name in ("vae/config.json", "text_encoder/config.json", "tokenizer/tokenizer_config.json"):
        assert (sd_ft / name).read_bytes() != (TINY_SD / name).read_bytes(), name
    assert not (sd_ft / "tokenizer" / "vocab.json").exists() and (TINY_SD / "tokenizer" / "vocab.json").exists()


@pytest.mark.parametrize("base_kind", ["folder", "dduf", "hub"])
def test_trainer_workflow_references_every_frozen_component(sd_ft: Path, tmp_path: Path, hf_env: Path,
                                                            caplog: pytest.LogCaptureFixture, base_kind: str) -> None:
    base = {"folder": str(TINY_SD), "hub": "org/tiny-sd"}.get(base_kind)
    if base_kind == "dduf":
        base = str(pack(TINY_SD, tmp_path / "base.dduf", quiet=True)[0].path)
    elif base_kind == "hub":
        cached(hf_env)
    out = tmp_path / "ft.dduf"
    with caplog.at_level(logging.INFO, logger="dduf_plus"):
        pack_partial(sd_ft, out, base=base, quiet=True)
    with DDUFArchive(out) as archive:
        assert set(archive.references) == FROZEN_SD
        stored = {n.split("/")[0] for n in archive.entries if "/" in n}
        assert stored == {"unet"}
        vae = archive.references["vae"]["files"]
    assert set(vae) == {"config.json", "diffusion_pytorch_model.safetensors"}  # BASE's files, by BASE's hashes
    lines = report_lines(caplog)
    # loaded without a dtype, diffusers upcast the fp16 UNet: the line names the first tensor and both dtypes
    assert any(line.startswith("stored unet: differs from BASE") and "tensor conv_in.bias: float32 [16] here, "
               "float16 [16] in BASE" in line for line in lines), lines
    assert any(line.startswith("referenced tokenizer -> ") and "same content" in line for line in lines), lines
    saved = next(line for line in lines if line.startswith("bytes saved:"))
    assert not saved.startswith("bytes saved: 0 ")  # the report is true for every kind of BASE
    assert validate(out).valid
    assert_loads_like_folder(out, sd_ft)


def test_ref_to_a_reserialized_copy_is_accepted_and_records_the_source(sd_ft: Path, tmp_path: Path,
                                                                       hf_env: Path) -> None:
    """--ref vae=BASE was refused ("641 bytes there, 675 here"): the same VAE, re-saved. The reference records
    BASE's files (what the loader will find and verify), not the local copy's."""
    out = tmp_path / "ft.dduf"
    pack_partial(sd_ft, out, exclude=["vae"], refs={"vae": str(TINY_SD)}, quiet=True)
    with DDUFArchive(out) as archive:
        size = archive.references["vae"]["files"]["config.json"]["size"]
    assert size == (TINY_SD / "vae" / "config.json").stat().st_size != (sd_ft / "vae" / "config.json").stat().st_size
    assert_loads_like_folder(out, sd_ft, prompt_steps=0)


def test_a_config_value_that_differs_is_named(sd_ft: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ft = tmp_path / "ft"
    shutil.copytree(sd_ft, ft)
    config = json.loads((ft / "vae" / "config.json").read_text())
    config["scaling_factor"] = 0.5
    (ft / "vae" / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="dduf_plus"):
        pack_partial(ft, tmp_path / "ft.dduf", base=str(TINY_SD), quiet=True)
    assert any("stored vae" in line and "key 'scaling_factor': 0.5 here, 0.18215 in BASE" in line
               for line in report_lines(caplog)), report_lines(caplog)
    with pytest.raises(DDUFPackError, match=r"vae differs from its reference .*scaling_factor"):
        pack_partial(ft, tmp_path / "x.dduf", exclude=["vae"], refs={"vae": str(TINY_SD)}, quiet=True)


def test_a_base_saved_by_an_older_diffusers_lacks_keys_at_their_defaults(sd_ft: Path, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A key BASE's config lacks reads as the class's default: equal when FT holds that default, named when not."""
    base = tmp_path / "old-base"
    shutil.copytree(TINY_SD, base)
    for key in ("force_upcast", "mid_block_add_attention"):  # AutoencoderKL defaults: True, True
        config = json.loads((base / "vae" / "config.json").read_text())
        assert config.pop(key) is True
        (base / "vae" / "config.json").write_text(json.dumps(config))
    out = tmp_path / "ft.dduf"
    pack_partial(sd_ft, out, base=str(base), quiet=True)
    with DDUFArchive(out) as archive:
        assert "vae" in archive.references
    ft = tmp_path / "ft"
    shutil.copytree(sd_ft, ft)
    config = json.loads((ft / "vae" / "config.json").read_text())
    config["force_upcast"] = False
    (ft / "vae" / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="dduf_plus"):
        pack_partial(ft, tmp_path / "ft2.dduf", base=str(base), quiet=True)
    assert any("stored vae" in line and "'force_upcast'" in line for line in report_lines(caplog))


def test_fp16_finetune_is_compared_with_the_bases_fp16_variant(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Loaded in fp16, the VAE is saved in fp16: BASE (fp32) has an fp16 variant, which the reference names. The
    text encoder has none: stored, and the line says so."""
    ft = finetune(TINY_SD, tmp_path / "ft16", torch_dtype=torch.float16)
    out = tmp_path / "ft16.dduf"
    with caplog.at_level(logging.INFO, logger="dduf_plus"):
        pack_partial(ft, out, base=str(TINY_SD), quiet=True)
    with DDUFArchive(out) as archive:
        vae = archive.references["vae"]
        assert vae["variant"] == "fp16" and set(vae["files"]) == {"config.json", "diffusion_pytorch_model.fp16.safetensors"}
        assert "text_encoder" not in archive.references
    lines = report_lines(caplog)
    assert any("BASE's fp16 variant" in line for line in lines if line.startswith("referenced vae")), lines
    assert any(line.startswith("stored text_encoder") and "float16" in line and "no other variant" in line
               for line in lines), lines
    assert any(re.match(r"stored unet: .*tensor \S+ differs \(max abs difference 0\.0(1|099)", line) for line in lines), lines
    assert_loads_like_folder(out, ft, prompt_steps=0)


def test_sdxl_trainer_workflow(tmp_path: Path) -> None:
    base = build_tiny_sdxl(tmp_path / "sdxl", TINY_SD / "tokenizer")
    ft = finetune(base, tmp_path / "sdxl-ft")
    out = tmp_path / "sdxl-ft.dduf"
    pack_partial(ft, out, base=str(base), quiet=True)
    with DDUFArchive(out) as archive:
        assert set(archive.references) == {"scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2",
                                           "vae"}
    assert_loads_like_folder(out, ft, prompt_steps=0)


def test_flux_trainer_workflow(tmp_path: Path) -> None:
    base = build_tiny_flux(tmp_path / "flux", TINY_SD / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer")
    ft = finetune(base, tmp_path / "flux-ft", denoiser="transformer", torch_dtype=torch.bfloat16)
    out = tmp_path / "flux-ft.dduf"
    pack_partial(ft, out, base=str(base), quiet=True)
    with DDUFArchive(out) as archive:
        assert set(archive.references) == {"scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2",
                                           "vae"}
    assert_loads_like_folder(out, ft, prompt_steps=0)


def test_a_hostile_base_is_never_the_same_and_never_a_crash(sd_ft: Path, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """BASE is untrusted input: a VAE whose safetensors header lies (a byte span unlike its shape) is compared without
    reading past it, and the VAE is stored, saying why; as a --ref it is refused naming the rule."""
    base = tmp_path / "hostile-base"
    shutil.copytree(TINY_SD, base)
    weights = base / "vae" / "diffusion_pytorch_model.safetensors"
    raw = bytearray(weights.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    first = next(k for k in header if k != "__metadata__")
    header[first]["data_offsets"][1] += 1  # the same digits: a byte span unlike its shape
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    weights.write_bytes(bytes(raw[:8]) + text + bytes(raw[8 + n :]))
    with caplog.at_level(logging.INFO, logger="dduf_plus"):
        pack_partial(sd_ft, tmp_path / "ft.dduf", base=str(base), quiet=True)
    assert any(line.startswith("stored vae: differs from BASE") and "cannot be compared" in line and "S00" in line
               for line in report_lines(caplog)), report_lines(caplog)
    with pytest.raises(DDUFPackError, match=r"vae differs from its reference .*cannot be compared.*S00"):
        pack_partial(sd_ft, tmp_path / "x.dduf", exclude=["vae"], refs={"vae": str(base)}, quiet=True)


@pytest.mark.parametrize("base_kind", ["folder", "dduf"])
def test_save_dduf_with_base_from_memory(tmp_path: Path, base_kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """The trainer's pipeline in memory becomes the partial archive in one call: the references are those
    save_pretrained + pack --base gives, the stored entries the same, the weights compared as they stream."""
    from diffusers import DiffusionPipeline

    from dduf_plus import save_dduf

    base = str(TINY_SD) if base_kind == "folder" else str(pack(TINY_SD, tmp_path / "base.dduf", quiet=True)[0].path)
    pipe = DiffusionPipeline.from_pretrained(TINY_SD)
    with torch.no_grad():
        for p in pipe.unet.parameters():
            p.add_(0.01)
    with caplog.at_level(logging.INFO, logger="dduf_plus"):
        result = save_dduf(pipe, tmp_path / "ft.dduf", base=base, quiet=True)
    assert any(line.startswith("stored unet: differs from BASE") for line in report_lines(caplog))
    pipe.save_pretrained(tmp_path / "ft")
    pack_partial(tmp_path / "ft", tmp_path / "packed.dduf", base=base, quiet=True)
    with DDUFArchive(result.path) as ours, DDUFArchive(tmp_path / "packed.dduf") as theirs:
        assert ours.references == theirs.references and set(ours.references) == FROZEN_SD
        assert {n for n in ours.entries if "/" in n} == {n for n in theirs.entries if "/" in n}
    loaded = load_dduf(result.path)
    for name in ("unet", "vae", "text_encoder"):
        a, b = getattr(loaded, name).state_dict(), getattr(pipe, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in b), name
