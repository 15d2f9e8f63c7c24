"""A tiny SD pipeline whose UNet bitsandbytes can run in 4 bits on every CPU, and the two CPU paths to run it on.

bitsandbytes 0.50 has two CPU paths for a 4-bit ``Linear4bit.forward``. Where the CPU has ``avx512_bf16``, the
first forward repacks the weight for a fused kernel (``_convert_weight_packed_for_cpu``), which needs the
output size to be a multiple of 32 and each row a whole number of quantization blocks (64 values by default);
elsewhere the plain path takes any shape. tiny-sd's UNet (16 and 32 channels) is narrower than one block, so its
4-bit layers fail on AVX512-BF16 machines. The pipeline built here has 64-channel blocks and a 64-wide text
encoder (cross-attention 64): every 4-bit layer fits both paths.

Tests pick the path with :func:`use_cpu_path` instead of depending on the machine: "plain" runs everywhere,
"avx512_bf16" runs where the CPU has the flag and skips elsewhere, naming it. :func:`assert_every_4bit_layer_repacks`
runs the repack itself (pure torch) on every CPU, so the fixture's fitness is checked even where the packed
kernel cannot run."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

CPU_PATHS = ("plain", "avx512_bf16")
BNB_UNET = {"block_out_channels": (64, 64), "cross_attention_dim": 64}  # tiny-sd's: (16, 32) and 32


def build_bnb_ready_sd(tiny_sd: Path, dest: Path, seed: int = 0) -> Path:
    """tiny-sd with a 64-channel UNet (fp16, as tiny-sd's) and a 64-wide CLIP text encoder, seeded; tokenizer,
    scheduler and VAE copied. Every ``nn.Linear`` of the UNet fits bitsandbytes' packed CPU path."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    shutil.copytree(tiny_sd, dest, ignore=shutil.ignore_patterns("unet", "text_encoder", "README.md"))
    config = UNet2DConditionModel.load_config(tiny_sd / "unet")
    config = {k: v for k, v in config.items() if not k.startswith("_")} | BNB_UNET
    torch.manual_seed(seed)
    UNet2DConditionModel.from_config(config).eval().to(torch.float16).save_pretrained(dest / "unet")
    text_config = CLIPTextConfig.from_pretrained(tiny_sd / "text_encoder")
    text_config.hidden_size = text_config.projection_dim = 64
    torch.manual_seed(seed + 1)
    CLIPTextModel(text_config).eval().save_pretrained(dest / "text_encoder")
    return dest


def _bnb() -> Any:
    """bitsandbytes (imported when a test needs it: importing it has side effects), or the test skips."""
    try:
        import bitsandbytes
        import bitsandbytes.functional
    except ImportError:  # the quant extra is installed wherever these tests run
        pytest.skip("bitsandbytes is not installed here (pip install -e '.[quant]')")
    return bitsandbytes


def four_bit_layers(model: Any) -> list[Any]:
    return [m for m in model.modules() if isinstance(m, _bnb().nn.Linear4bit)]


def require_cpu_path(path: str) -> None:
    """Skip the calling test, naming the flag, where this CPU cannot run bitsandbytes' ``path``."""
    assert path in CPU_PATHS, path
    if path == "avx512_bf16" and not _bnb().functional.has_avx512bf16():
        pytest.skip("this CPU lacks avx512_bf16: bitsandbytes' packed 4-bit CPU kernel cannot run here "
                    "(the plain-path case runs; assert_every_4bit_layer_repacks checks the shapes)")


def use_cpu_path(model: Any, path: str) -> None:
    """Run every 4-bit layer of ``model`` on bitsandbytes' ``path`` ("plain" or "avx512_bf16"). The packed
    path needs the CPU flag: without it the test skips, saying so."""
    require_cpu_path(path)
    for module in four_bit_layers(model):
        module.support_avx512bf16_for_cpu = path == "avx512_bf16"  # what Linear4bit.forward reads (0.50)


def assert_every_4bit_layer_repacks(model: Any) -> None:
    """bitsandbytes' own repack for the AVX512-BF16 path succeeds on (copies of) every 4-bit layer of ``model``:
    the shapes fit that path, whatever this CPU has."""
    layers = four_bit_layers(model)
    assert len(layers) > 10
    for module in layers:
        state = copy.deepcopy(module.weight.quant_state)
        _bnb().functional._convert_weight_packed_for_cpu(module.weight.data.clone(), state)
        assert state.packing_format_for_cpu
