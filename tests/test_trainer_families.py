"""The trainer's workflow on tiny SDXL and Flux with every kind of BASE (a folder, a ``.dduf``, a Hugging Face cache
snapshot): ``from_pretrained(BASE)``, change the denoiser, ``save_pretrained(FT)``, ``pack FT --base BASE``. Every
component but the denoiser is referenced, and the archive loads equal to ``from_pretrained(FT)``
(tests/test_partial_content.py has SD 1.5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hfcache import cached
from single_file_ckpt import build_tiny_flux, build_tiny_sdxl
from test_partial_content import PIPELINES, TINY_SD, assert_loads_like_folder, finetune

from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.validate import validate
from dduf_plus.packing.pack import pack

FROZEN = {"scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae"}


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """SDXL as its users load it (``torch_dtype=float16, variant="fp16"``): every component of FT in fp16. (Loaded
    without, FT mixes precisions: transformers 5 loads the text encoders in their config's float16, diffusers
    upcasts the VAE to float32; a .dduf BASE, which holds one variant, then matches only part of it.)"""
    root = tmp_path_factory.mktemp("sdxl")
    base = build_tiny_sdxl(root / "sdxl", TINY_SD / "tokenizer")
    return base, finetune(base, root / "sdxl-ft", torch_dtype=torch.float16, variant="fp16")


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("flux")
    base = build_tiny_flux(root / "flux", TINY_SD / "tokenizer", PIPELINES / "tiny-dit" / "tokenizer")
    return base, finetune(base, root / "flux-ft", denoiser="transformer", torch_dtype=torch.bfloat16)


def base_as(kind: str, folder: Path, tmp_path: Path, hf_env: Path, repo: str, variant: str | None) -> str:
    if kind == "dduf":
        return str(pack(folder, tmp_path / "base.dduf", quiet=True, variant=variant)[0].path)
    if kind == "hub":
        cached(hf_env, source=folder, repo=repo)
        return repo
    return str(folder)


@pytest.mark.parametrize("family", ["sdxl", "flux"])
@pytest.mark.parametrize("kind", ["dduf", "hub"])
def test_trainer_workflow_every_base_kind(family: str, kind: str, request: pytest.FixtureRequest, tmp_path: Path,
                                          hf_env: Path) -> None:
    base, ft = request.getfixturevalue(family)
    denoiser = "unet" if family == "sdxl" else "transformer"
    spec = base_as(kind, base, tmp_path, hf_env, f"org/tiny-{family}", "fp16" if family == "sdxl" else None)
    out = tmp_path / "ft.dduf"
    _, partial = pack(ft, out, base=spec, quiet=True)
    with DDUFArchive(out) as archive:
        assert set(archive.references) == FROZEN, partial.report
        assert {n.split("/")[0] for n in archive.entries if "/" in n} == {denoiser}
        if kind == "hub":  # a snapshot reference travels: the repo id at the cached commit
            assert {r["pretrained_model_name_or_path"] for r in archive.references.values()} == {spec}
    assert not partial.report[-1].startswith("bytes saved: 0 "), partial.report
    assert validate(out).valid
    assert_loads_like_folder(out, ft, prompt_steps=0)
