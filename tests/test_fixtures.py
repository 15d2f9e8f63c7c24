"""The committed tiny pipeline fixtures load in diffusers, have the advertised on-disk layout, and are reproducible."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PIPELINES = REPO / "fixtures" / "pipelines"
TINY_SD = PIPELINES / "tiny-sd"
TINY_SD_FT = PIPELINES / "tiny-sd-finetune"
TINY_DIT = PIPELINES / "tiny-dit"
ALLOWED_COMPONENT_EXTS = {".json", ".safetensors", ".txt", ".model"}


def _load_make_fixtures():
    spec = importlib.util.spec_from_file_location("make_fixtures", REPO / "fixtures" / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mf = _load_make_fixtures()


def st_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def st_dtypes(path: Path) -> set[str]:
    return {v["dtype"] for k, v in st_header(path).items() if k != "__metadata__"}


def st_shapes(path: Path) -> dict[str, list[int]]:
    return {k: v["shape"] for k, v in st_header(path).items() if k != "__metadata__"}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    mf._quiet_libraries()


def _run(pipe, size: int, **kwargs) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        "a photo of a cat",
        num_inference_steps=2,
        output_type="np",
        height=size,
        width=size,
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    )
    return out.images


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-sd-finetune"])
def test_tiny_sd_inference(name):
    from diffusers import DiffusionPipeline, StableDiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(PIPELINES / name, dtype=torch.float32)
    assert isinstance(pipe, StableDiffusionPipeline)
    assert pipe.safety_checker is None and pipe.feature_extractor is None
    images = _run(pipe, mf.TINY_SD_IMAGE_SIZE)
    assert images.shape == (1, mf.TINY_SD_IMAGE_SIZE, mf.TINY_SD_IMAGE_SIZE, 3)
    assert np.isfinite(images).all()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy 2 __array__ copy warning inside diffusers
def test_tiny_dit_inference():
    from diffusers import DiffusionPipeline, PixArtAlphaPipeline

    pipe = DiffusionPipeline.from_pretrained(TINY_DIT, dtype=torch.float32)
    assert isinstance(pipe, PixArtAlphaPipeline)
    # A tiny sample_size has no aspect-ratio bins; clean_caption needs bs4/ftfy.
    images = _run(
        pipe,
        mf.TINY_DIT_IMAGE_SIZE,
        use_resolution_binning=False,
        clean_caption=False,
        max_sequence_length=16,
    )
    assert images.shape == (1, mf.TINY_DIT_IMAGE_SIZE, mf.TINY_DIT_IMAGE_SIZE, 3)
    assert np.isfinite(images).all()


def test_tiny_sd_variant_fp16_loads():
    """variant="fp16": the vae takes its fp16 variant file, the other components fall back to their default files."""
    from diffusers import DiffusionPipeline

    default = DiffusionPipeline.from_pretrained(TINY_SD, dtype=torch.float32)
    variant = DiffusionPipeline.from_pretrained(TINY_SD, dtype=torch.float32, variant="fp16")
    vae_d, vae_v = default.vae.state_dict(), variant.vae.state_dict()
    assert any(not torch.equal(vae_d[k], vae_v[k]) for k in vae_d), "vae did not load the fp16 variant file"
    assert all(torch.equal(vae_d[k].half().float(), vae_v[k]) for k in vae_d)
    for comp in ("unet", "text_encoder"):
        sd_d, sd_v = getattr(default, comp).state_dict(), getattr(variant, comp).state_dict()
        assert all(torch.equal(sd_d[k], sd_v[k]) for k in sd_d), comp
    images = _run(variant, mf.TINY_SD_IMAGE_SIZE)
    assert np.isfinite(images).all()


def test_on_disk_dtypes():
    unet = TINY_SD / "unet"
    for shard in sorted(unet.glob("diffusion_pytorch_model-*.safetensors")):
        assert st_dtypes(shard) == {"F16"}, shard
    assert st_dtypes(TINY_SD / "text_encoder" / "model.safetensors") == {"F32"}
    assert st_dtypes(TINY_SD / "vae" / "diffusion_pytorch_model.safetensors") == {"F32"}
    assert st_dtypes(TINY_SD / "vae" / "diffusion_pytorch_model.fp16.safetensors") == {"F16"}
    assert st_dtypes(TINY_SD_FT / "unet" / "diffusion_pytorch_model.safetensors") == {"F16"}
    assert st_dtypes(TINY_DIT / "transformer" / "diffusion_pytorch_model.safetensors") == {"BF16"}
    assert st_dtypes(TINY_DIT / "text_encoder" / "model.safetensors") == {"F32"}
    assert st_dtypes(TINY_DIT / "vae" / "diffusion_pytorch_model.safetensors") == {"F32"}
    for path in PIPELINES.rglob("*.safetensors"):
        assert st_header(path)["__metadata__"] == {"format": "pt"}, path


def test_unet_shard_index():
    unet = TINY_SD / "unet"
    index = json.loads((unet / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in unet.glob("diffusion_pytorch_model-*.safetensors"))
    assert shards == [
        "diffusion_pytorch_model-00001-of-00002.safetensors",
        "diffusion_pytorch_model-00002-of-00002.safetensors",
    ]
    assert not (unet / "diffusion_pytorch_model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shards
    keys_in_shards: dict[str, str] = {}
    total = 0
    for shard in shards:
        header = st_header(unet / shard)
        for k, v in header.items():
            if k != "__metadata__":
                keys_in_shards[k] = shard
                total += v["data_offsets"][1] - v["data_offsets"][0]
    assert keys_in_shards == index["weight_map"]
    assert index["metadata"]["total_size"] == total


def test_vae_variant_layout():
    vae = TINY_SD / "vae"
    assert (vae / "diffusion_pytorch_model.safetensors").is_file()
    assert (vae / "diffusion_pytorch_model.fp16.safetensors").is_file()
    assert st_shapes(vae / "diffusion_pytorch_model.safetensors") == st_shapes(
        vae / "diffusion_pytorch_model.fp16.safetensors"
    )
    assert sorted(p.name for p in (TINY_DIT / "vae").iterdir()) == [
        "config.json",
        "diffusion_pytorch_model.safetensors",
    ]


def test_file_layout():
    for pipe_dir in (TINY_SD, TINY_SD_FT, TINY_DIT):
        root_files = sorted(p.name for p in pipe_dir.iterdir() if p.is_file())
        assert root_files == ["README.md", "model_index.json"], pipe_dir
        for comp in (p for p in pipe_dir.iterdir() if p.is_dir()):
            for f in comp.rglob("*"):
                assert f.is_file(), f"unexpected nested folder {f}"
                assert f.suffix in ALLOWED_COMPONENT_EXTS, f
    tok_sd = sorted(p.name for p in (TINY_SD / "tokenizer").iterdir())
    assert tok_sd == ["merges.txt", "tokenizer.json", "tokenizer_config.json", "vocab.json"]
    tok_dit = sorted(p.name for p in (TINY_DIT / "tokenizer").iterdir())
    assert tok_dit == ["spiece.model", "tokenizer.json", "tokenizer_config.json"]
    index = json.loads((TINY_SD / "model_index.json").read_text())
    assert index["safety_checker"] == [None, None]
    assert index["feature_extractor"] == [None, None]
    assert index["image_encoder"] == [None, None]
    assert index["requires_safety_checker"] is False


def test_finetune_shares_everything_but_unet():
    base = mf.tree_hashes(TINY_SD)
    fine = mf.tree_hashes(TINY_SD_FT)
    shared = {k for k in base if not k.startswith("unet/") and k != "README.md"}
    assert shared == {k for k in fine if not k.startswith("unet/") and k != "README.md"}
    assert {k.split("/")[0] for k in shared} >= {
        "model_index.json",
        "scheduler",
        "text_encoder",
        "tokenizer",
        "vae",
    }
    for k in shared:
        assert base[k] == fine[k], k
    assert base["unet/config.json"] == fine["unet/config.json"]

    from safetensors.torch import load_file

    base_sd: dict[str, torch.Tensor] = {}
    for shard in sorted((TINY_SD / "unet").glob("diffusion_pytorch_model-*.safetensors")):
        base_sd.update(load_file(shard))
    fine_sd = load_file(TINY_SD_FT / "unet" / "diffusion_pytorch_model.safetensors")
    assert base_sd.keys() == fine_sd.keys()
    for k, v in base_sd.items():
        assert v.shape == fine_sd[k].shape and v.dtype == fine_sd[k].dtype == torch.float16
        assert not torch.equal(v, fine_sd[k]), k
        assert torch.isfinite(fine_sd[k]).all()


def _committed_versions() -> dict[str, str]:
    diffusers_v = json.loads((TINY_SD / "model_index.json").read_text())["_diffusers_version"]
    transformers_v = json.loads((TINY_SD / "text_encoder" / "config.json").read_text())["transformers_version"]
    return {"diffusers": diffusers_v, "transformers": transformers_v}


def test_fixture_versions_table_matches_committed_files():
    """make_fixtures.FIXTURE_VERSIONS (what the version check below trusts) agrees with the versions embedded
    in the committed files, so regenerating without updating the table is caught."""
    assert {k: mf.FIXTURE_VERSIONS[k] for k in ("diffusers", "transformers")} == _committed_versions()
    for path in PIPELINES.rglob("*.json"):
        data = json.loads(path.read_text())
        for key, lib in (("_diffusers_version", "diffusers"), ("transformers_version", "transformers")):
            if isinstance(data, dict) and key in data:
                assert data[key] == mf.FIXTURE_VERSIONS[lib], path


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> dict[str, Path]:
    missing = mf.missing_requirements()
    if missing:  # declared dependencies: a broken install, not a reason to skip
        pytest.fail(f"make_fixtures needs {', '.join(missing)}, which is not installed: pip install -e .")
    return mf.build_all_tiny(tmp_path_factory.mktemp("rebuilt"))


def test_rebuild_is_byte_identical(request):
    # Checked before building: other library versions write other bytes (or may not build at all).
    mismatches = mf.version_mismatches()
    if mismatches:
        pytest.skip(
            f"fixtures were written with {mf.describe_mismatches(mismatches)}; byte identity holds only under "
            "those versions (regenerate with `python fixtures/make_fixtures.py` and update FIXTURE_VERSIONS)"
        )
    rebuilt = request.getfixturevalue("rebuilt")
    for name in mf.TINY_NAMES:
        committed = mf.tree_hashes(PIPELINES / name)
        fresh = mf.tree_hashes(rebuilt[name])
        assert fresh.keys() == committed.keys(), name
        differing = sorted(k for k in committed if committed[k] != fresh[k])
        assert not differing, f"{name}: {differing} differ; run `python fixtures/make_fixtures.py`"


def test_builder_is_deterministic(rebuilt, tmp_path):
    """Two builds in one process give the same bytes, whatever the library versions."""
    again = mf.build_all_tiny(tmp_path)
    for name in mf.TINY_NAMES:
        assert mf.tree_hashes(rebuilt[name]) == mf.tree_hashes(again[name]), name


def test_version_check_reports_what_differs(monkeypatch):
    assert mf.version_mismatches({"torch": mf.installed_version("torch")}) == {}
    found = mf.version_mismatches({"torch": "0.0.1", "no-such-distribution-xyz": "1.0"})
    assert found == {"torch": ("0.0.1", mf.installed_version("torch")), "no-such-distribution-xyz": ("1.0", None)}
    assert "no-such-distribution-xyz 1.0 (installed: none)" in mf.describe_mismatches(found)
    assert "+" not in mf.installed_version("torch")  # 2.13.0+cpu compares as 2.13.0
    monkeypatch.setitem(mf.BUILD_REQUIREMENTS, "no_such_module_xyz.sub", "no-such-dist")
    assert mf.missing_requirements() == ["no-such-dist"]


def test_make_fixtures_refuses_to_start_without_requirements(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(mf.BUILD_REQUIREMENTS, "no_such_module_xyz", "no-such-dist")
    assert mf.main(["--out", str(tmp_path / "out")]) == 2
    assert "not installed: no-such-dist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_streamed_writer_matches_save_pretrained_layout(tmp_path):
    """The writer behind build_sd15_shaped produces what save_pretrained would, and diffusers loads it."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    kwargs = dict(
        block_out_channels=(16, 32),
        layers_per_block=1,
        cross_attention_dim=32,
        norm_num_groups=8,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    )
    text_config = CLIPTextConfig(
        hidden_size=32,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=100,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    UNet2DConditionModel(**kwargs).save_pretrained(tmp_path / "ref_unet")
    CLIPTextModel(text_config).save_pretrained(tmp_path / "ref_te")
    with torch.device("meta"):
        unet = UNet2DConditionModel(**kwargs)
        te = CLIPTextModel(text_config)
    gen = torch.Generator().manual_seed(0)
    (tmp_path / "unet").mkdir()
    unet.save_config(tmp_path / "unet")
    mf._write_random_safetensors(
        tmp_path / "unet" / "diffusion_pytorch_model.safetensors", unet, torch.float16, gen
    )
    (tmp_path / "te").mkdir()
    mf._write_random_safetensors(tmp_path / "te" / "model.safetensors", te, torch.float16, gen)

    ref = st_shapes(tmp_path / "ref_unet" / "diffusion_pytorch_model.safetensors")
    assert st_shapes(tmp_path / "unet" / "diffusion_pytorch_model.safetensors") == ref
    assert st_shapes(tmp_path / "te" / "model.safetensors") == st_shapes(
        tmp_path / "ref_te" / "model.safetensors"
    )
    loaded = UNet2DConditionModel.from_pretrained(tmp_path / "unet", torch_dtype=torch.float32)
    assert all(torch.isfinite(p).all() for p in loaded.parameters())
    assert torch.equal(loaded.conv_norm_out.weight, torch.ones_like(loaded.conv_norm_out.weight))
