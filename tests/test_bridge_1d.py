"""The precision bridge on Hunyuan-DiT: a transformer that computes in ``timestep.dtype`` (a 1-d tensor the
pipeline builds from its latents) beside fp32 text encoders. Before the fix the second denoising step failed
with ``mat1 and mat2 must have the same dtype``: the bridge took its caller dtype from the fp32 rotary
embeddings, cast the fp16 transformer's output to fp32, and left the next step's fp32 timestep uncast."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("sentencepiece")

from dduf_plus import load_dduf  # noqa: E402
from dduf_plus.loading.bridge import cast_inputs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "a photo of a cat sitting on a mat"
WORDS = "a photo of cat sitting on mat dog the".split()


def build_tiny_hunyuan_dit(out: Path, seed: int = 0) -> Path:
    """A tiny random-weight ``HunyuanDiTPipeline`` saved as diffusers does, everything fp32 (no network): Bert
    and T5 text encoders with offline tokenizers, a 4-level vae (the pipeline assumes a scale factor of 8)."""
    from transformers import BertConfig, BertModel, BertTokenizer, T5Config, T5EncoderModel

    spec = importlib.util.spec_from_file_location("make_fixtures", ROOT / "fixtures" / "make_fixtures.py")
    assert spec is not None and spec.loader is not None
    make_fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_fixtures)
    make_fixtures._quiet_libraries()
    (out / "tokenizer").mkdir(parents=True)
    (out / "tokenizer" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
    tokenizer = BertTokenizer.from_pretrained(out / "tokenizer", model_max_length=77)
    tokenizer_2 = make_fixtures.make_t5_tokenizer(out / "tokenizer_2", seed=seed)
    torch.manual_seed(seed)
    text_encoder = BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=37, max_position_embeddings=80))
    torch.manual_seed(seed + 1)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=tokenizer_2.pad_token_id,
        eos_token_id=tokenizer_2.eos_token_id, decoder_start_token_id=tokenizer_2.pad_token_id))
    torch.manual_seed(seed + 2)
    vae = diffusers.AutoencoderKL(block_out_channels=(8, 8, 8, 8), down_block_types=("DownEncoderBlock2D",) * 4,
                                  up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, layers_per_block=1,
                                  norm_num_groups=4, sample_size=32)
    torch.manual_seed(seed + 3)
    transformer = diffusers.HunyuanDiT2DModel(
        sample_size=16, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=3, in_channels=4,
        cross_attention_dim=32, cross_attention_dim_t5=32, pooled_projection_dim=16, hidden_size=24,
        activation_fn="gelu-approximate", text_len=77, text_len_t5=256)
    pipe = diffusers.HunyuanDiTPipeline(
        vae=vae.eval(), text_encoder=text_encoder.eval(), tokenizer=tokenizer, transformer=transformer.eval(),
        scheduler=diffusers.DDPMScheduler(), text_encoder_2=text_encoder_2.eval(), tokenizer_2=tokenizer_2,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hunyuan(tmp_path_factory) -> dict[str, Path]:
    """{"fp32": folder, "float16"/"bfloat16": folder and archive with only the transformer in that dtype}."""
    from dduf_plus.format.pack import pack_folder

    base = tmp_path_factory.mktemp("hunyuan")
    out: dict[str, Path] = {"fp32": build_tiny_hunyuan_dit(base / "fp32")}
    for name in ("float16", "bfloat16"):
        folder = base / name
        shutil.copytree(out["fp32"], folder)
        transformer = diffusers.HunyuanDiT2DModel.from_pretrained(folder / "transformer")
        transformer.to(getattr(torch, name)).save_pretrained(folder / "transformer")
        out[name] = folder
        out[f"{name}.dduf"] = pack_folder(folder, base / f"{name}.dduf", quiet=True, fsync=False).path
    return out


def run(pipe, **kwargs) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe(PROMPT, num_inference_steps=2, height=32, width=32, output_type="np", use_resolution_binning=False,
                generator=torch.Generator().manual_seed(0), **kwargs).images


@pytest.fixture(scope="module")
def reference(hunyuan) -> np.ndarray:
    """The image of diffusers' own folder load in fp32."""
    return run(diffusers.HunyuanDiTPipeline.from_pretrained(hunyuan["fp32"], torch_dtype=torch.float32))


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_hunyuan_dit_mixed_dtypes_runs_from_archive(hunyuan, reference, dtype):
    """Transformer fp16/bf16 as stored, both text encoders and the vae fp32: two steps (the second one failed),
    about as close to diffusers' fp32 image as diffusers' own single-dtype load in that dtype (diffusers cannot run
    the mixed pipeline: ``Input type (c10::Half) and bias type (float) should be the same``)."""
    pipe = load_dduf(hunyuan[f"{dtype}.dduf"])
    assert pipe.transformer.dtype is getattr(torch, dtype)
    assert pipe.text_encoder.dtype is pipe.text_encoder_2.dtype is pipe.vae.dtype is torch.float32
    steps: list[torch.dtype] = []
    pipe.transformer.register_forward_hook(lambda m, a, out: steps.append(out[0].dtype))
    image = run(pipe)
    assert np.isfinite(image).all()
    # the pipeline's latents are in the transformer's dtype: its output must come back in that dtype, not fp32
    assert steps == [getattr(torch, dtype)] * 2
    stock = run(diffusers.HunyuanDiTPipeline.from_pretrained(hunyuan[dtype], torch_dtype=getattr(torch, dtype)))
    # random weights: the rounding errors land elsewhere than in the stock run, so bound them loosely (measured
    # max fp16 0.007; bf16 mean / max 0.0056 / 0.070 vs stock bf16 0.0039 / 0.036); garbage is ~0.2
    error, stock_error = np.abs(image - reference), np.abs(stock - reference)
    assert error.mean() <= 2 * stock_error.mean() + 1e-3 and error.max() < 0.1, (error.mean(), stock_error.mean())


def test_fp32_latents_give_an_fp32_timestep_that_is_cast(hunyuan):
    """latents passed in fp32: the pipeline builds ``t_expand`` in fp32 (1-d) and the transformer computes in
    ``timestep.dtype``; the bridge casts the timestep with the latents."""
    pipe = load_dduf(hunyuan["bfloat16.dduf"])
    latents = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    image = run(pipe, latents=latents)
    assert np.isfinite(image).all()


def test_caller_dtype_is_the_main_activation():
    """fp16 latents beside fp32 rotary embeddings into an fp16 model: nothing to cast back (the old bridge
    took fp32 from the embeddings and returned fp32)."""
    latents = torch.zeros(2, 4, 4, 4, dtype=torch.float16)
    timestep = torch.tensor([999.0, 999.0], dtype=torch.float16)
    rope = (torch.zeros(4, 8), torch.zeros(4, 8))
    args, kwargs, caller = cast_inputs((latents, timestep), {"image_rotary_emb": rope}, torch.float16)
    assert caller is None
    assert args[0] is latents and args[1] is timestep
    assert kwargs["image_rotary_emb"][0].dtype is torch.float16  # activations still follow the model


def test_one_d_tensors_follow_the_caller_only():
    """1-d tensors in the caller's dtype are cast with the latents; 1-d tensors in another dtype and 0-d
    scalars stay as the pipeline made them."""
    latents = torch.zeros(2, 4, 4, 4)
    built_from_latents = torch.tensor([999.0, 999.0])
    fp64 = torch.tensor([0.5, 0.5], dtype=torch.float64)
    scalar = torch.tensor(999.0)
    args, kwargs, caller = cast_inputs((latents, built_from_latents, scalar), {"guidance": fp64}, torch.bfloat16)
    assert caller is torch.float32
    assert args[0].dtype is torch.bfloat16 and args[1].dtype is torch.bfloat16
    assert args[2] is scalar and kwargs["guidance"] is fp64
    half_latents = torch.zeros(2, 4, 4, 4, dtype=torch.float16)
    fp32_timestep = torch.tensor([999.0, 999.0])
    args, _, caller = cast_inputs((half_latents, fp32_timestep), {}, torch.bfloat16)
    assert caller is torch.float16 and args[1] is fp32_timestep  # fp32 timesteps beside fp16 latents: as stock
