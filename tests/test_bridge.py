"""The precision bridge: mixed-dtype pipelines run with stock diffusers pipelines, no weight converted."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from dduf_plus import load_dduf  # noqa: E402
from dduf_plus.loading.bridge import cast_inputs, install_bridge, is_bridged, remove_bridge  # noqa: E402

PIPELINES = Path(__file__).resolve().parent.parent / "fixtures" / "pipelines"
PROMPT = "a photo of a cat sitting on a mat"


def run(pipe, name: str, **kwargs) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    extra = {"use_resolution_binning": False, "clean_caption": False} if "dit" in name else {}
    return pipe(PROMPT, num_inference_steps=2, output_type="np", height=32, width=32,
                generator=torch.Generator().manual_seed(0), **extra, **kwargs).images


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> dict[str, Path]:
    from dduf_plus.format.pack import pack_folder

    out = tmp_path_factory.mktemp("bridge")
    return {n: pack_folder(PIPELINES / n, out / f"{n}.dduf", quiet=True).path for n in ("tiny-sd", "tiny-dit")}


def weights(pipe) -> dict[str, tuple[int, torch.dtype]]:
    return {f"{c}.{n}": (t.data_ptr(), t.dtype) for c, m in pipe.components.items() if isinstance(m, torch.nn.Module)
            for n, t in m.state_dict().items()}


@pytest.mark.parametrize("name", ("tiny-sd", "tiny-dit"))
def test_mixed_precision_pipeline_runs_as_saved(archives, name):
    """fp16 unet (tiny-sd) / bf16 transformer (tiny-dit) beside fp32 text encoder and vae, on CPU. This torch
    runs fp16 convolutions on CPU; if one did not, only the fp16 case would need a GPU."""
    pipe = load_dduf(archives[name])  # auto
    before = weights(pipe)
    assert len({dtype for _, dtype in before.values() if dtype.is_floating_point}) == 2
    image = run(pipe, name)
    assert image.dtype == np.float32 and np.isfinite(image).all()
    assert weights(pipe) == before  # no weight converted, moved or copied
    full = run(load_dduf(archives[name], torch_dtype=torch.float32), name)
    assert np.abs(image - full).max() < 0.05  # the half-precision model, not garbage


def test_single_dtype_pipelines_are_not_bridged(archives):
    pipe = load_dduf(archives["tiny-sd"], torch_dtype=torch.float32)
    assert not any(is_bridged(m) for m in pipe.components.values() if isinstance(m, torch.nn.Module))
    mixed = load_dduf(archives["tiny-sd"])
    assert all(is_bridged(m) for m in (mixed.unet, mixed.vae, mixed.text_encoder))


def test_cast_rules():
    latents = torch.zeros(1, 4, 8, 8)
    mask = torch.ones(1, 7, dtype=torch.int64)
    timestep = torch.tensor(999.0)  # SD's loop `t`: 0-d
    args, kwargs, caller = cast_inputs((latents, timestep), {"encoder_hidden_states": torch.zeros(1, 7, 32),
                                                              "attention_mask": mask,
                                                              "added_cond_kwargs": {"time_ids": torch.zeros(1, 6)},
                                                              "scale": 1.0}, torch.float16)
    assert caller is torch.float32
    assert args[0].dtype is torch.float16 and kwargs["encoder_hidden_states"].dtype is torch.float16
    assert args[1] is timestep  # 0-d: stays fp32, as in single-dtype pipelines (1-d: tests/test_bridge_1d.py)
    assert kwargs["attention_mask"] is mask and kwargs["scale"] == 1.0
    assert kwargs["added_cond_kwargs"]["time_ids"].dtype is torch.float16
    same = torch.zeros(2, 2, dtype=torch.float16)
    _, _, caller = cast_inputs((same,), {}, torch.float16)
    assert caller is None


def test_forward_and_methods_cast_in_and_back(archives):
    pipe = load_dduf(archives["tiny-sd"])
    unet, vae, text_encoder = pipe.unet, pipe.vae, pipe.text_encoder
    sample = torch.randn(1, 4, 16, 16)  # fp32 caller, fp16 unet
    hidden = torch.randn(1, 7, 32)
    with torch.no_grad():
        out = unet(sample, torch.tensor(10), encoder_hidden_states=hidden).sample
        assert out.dtype is torch.float32
        tuple_out = unet(sample, 10, hidden, return_dict=False)
        assert isinstance(tuple_out, tuple) and tuple_out[0].dtype is torch.float32
        # vae.decode / vae.encode are called directly by pipelines: fp16 latents into the fp32 vae
        decoded = vae.decode(sample.half()).sample
        assert decoded.dtype is torch.float16
        posterior = vae.encode(decoded).latent_dist
        assert posterior.mean.dtype is torch.float32  # the distribution object is returned as it is
        ids = pipe.tokenizer(PROMPT, return_tensors="pt").input_ids
        encoded = text_encoder(input_ids=ids)  # keyword tensors, integers: nothing to cast
        assert encoded.last_hidden_state.dtype is torch.float32


def test_img2img_uses_vae_encode(archives):
    pipe = load_dduf(archives["tiny-sd"])
    img2img = diffusers.StableDiffusionImg2ImgPipeline(**pipe.components)
    img2img.set_progress_bar_config(disable=True)
    image = img2img(PROMPT, image=torch.rand(1, 3, 32, 32), num_inference_steps=2, strength=1.0,
                    output_type="np", generator=torch.Generator().manual_seed(0)).images
    assert np.isfinite(image).all()


def test_remove_reinstall_and_deepcopy(archives):
    pipe = load_dduf(archives["tiny-sd"])
    twin = copy.deepcopy(pipe.vae)
    assert twin.decode.module is twin  # the copied method calls the copy
    with torch.no_grad():
        assert twin.decode(torch.randn(1, 4, 16, 16).half()).sample.dtype is torch.float16
    remove_bridge(pipe)
    assert "decode" not in pipe.vae.__dict__ and not is_bridged(pipe.unet)
    assert not pipe.unet._forward_pre_hooks and not pipe.unet._forward_hooks
    assert install_bridge(pipe) == ["text_encoder", "unet", "vae"]
    pipe.to(torch.float32)  # one dtype now: the bridge stays but casts nothing
    with torch.no_grad():
        out = pipe.unet(torch.randn(1, 4, 16, 16), 10, torch.randn(1, 7, 32)).sample
    assert out.dtype is torch.float32


def test_components_and_config_untouched(archives, tmp_path):
    pipe = load_dduf(archives["tiny-sd"])
    assert set(pipe.components) == {"vae", "text_encoder", "tokenizer", "unet", "scheduler", "safety_checker",
                                    "feature_extractor", "image_encoder"}
    assert pipe.config["unet"] == ("diffusers", "UNet2DConditionModel")
    pipe.save_pretrained(tmp_path)
    assert "_dduf_plus" not in (tmp_path / "unet" / "config.json").read_text()
