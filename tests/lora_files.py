"""LoRA files as trainers write them, for tiny pipelines: diffusers/peft layout (``save_lora_weights`` with its
adapter metadata), kohya / A1111 (``lora_unet_*`` / ``lora_te*_*`` with ``.alpha``), and BFL-named kohya Flux
LoRAs. Seeded, every lora_B non-zero: an adapter that changes nothing would make every comparison vacuous."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

SMALL_FLUX = {"in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
              "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
              "guidance_embeds": True, "axes_dims_rope": (4, 6, 6)}
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TE_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
FLUX_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_out"]


def fp32_copy(source: Path, out: Path) -> Path:
    """``source`` re-saved in float32 by diffusers: a BASE whose components share one dtype, so that diffusers'
    own load (fp32 by default) and the archive's (saved precision) run the adapters in the same dtype."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(source, torch_dtype=torch.float32)
    if out.exists():
        shutil.rmtree(out)
    pipe.save_pretrained(out)
    return out


def _peft_layers(model: torch.nn.Module, targets: Sequence[str], rank: int, alpha: float, seed: int
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A LoRA of ``model`` made by peft itself (random A and B), as {module.lora_A.weight: tensor} + config."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=False, target_modules=list(targets))
    inject_adapter_in_model(config, model, adapter_name="trained")
    state = get_peft_model_state_dict(model, adapter_name="trained")
    state = {k: (v * 0.5).contiguous() for k, v in state.items()}
    metadata = config.to_dict()
    metadata["target_modules"] = sorted(metadata["target_modules"])
    return state, metadata


def diffusers_lora(base: Path, out: Path, targets: Mapping[str, Sequence[str]], *, rank: int = 4, alpha: float = 8,
                   seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """``pipeline_class.save_lora_weights(...)`` of adapters peft put on the named components (diffusers'
    layout: ``unet.<module>.lora_A.weight``, the peft config in ``lora_adapter_metadata``)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(base, torch_dtype=torch.float32)
    layers: dict[str, Any] = {}
    for i, (component, modules) in enumerate(targets.items()):
        state, metadata = _peft_layers(getattr(pipe, component), modules, rank, alpha, seed + i)
        layers[f"{component}_lora_layers"] = {k: v.to(dtype) for k, v in state.items()}
        layers[f"{component}_lora_adapter_metadata"] = metadata
    out.mkdir(parents=True, exist_ok=True)
    type(pipe).save_lora_weights(out, **layers)
    return out / "pytorch_lora_weights.safetensors"


def kohya_lora(diffusers_file: Path, out: Path, prefixes: Mapping[str, str], *, alpha: float = 2.0,
               metadata: Mapping[str, str] | None = None) -> Path:
    """The same modules in kohya / A1111 layout: ``<prefix><module with '_'>.lora_down/.lora_up`` and an
    ``.alpha`` scalar per module (``prefixes``: {"unet": "lora_unet_", "text_encoder": "lora_te1_", ...})."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    with safe_open(diffusers_file, "pt") as f:
        for key in f.keys():
            component, _, rest = key.partition(".")
            if component not in prefixes:
                continue
            module, _, half = rest.rpartition(".lora_")
            stem = prefixes[component] + module.replace(".", "_")
            tensors[f"{stem}.lora_{'down' if half.startswith('A') else 'up'}.weight"] = f.get_tensor(key)
            tensors[f"{stem}.alpha"] = torch.tensor(alpha)
    save_file(tensors, out, metadata=dict(metadata or {}))
    return out


def kohya_flux_lora(out: Path, *, hidden: int = 32, mlp: int = 128, rank: int = 4, seed: int = 0,
                    metadata: Mapping[str, str] | None = None) -> Path:
    """A kohya Flux LoRA in BFL naming (``lora_unet_double_blocks_0_img_attn_qkv``), as sd-scripts writes it."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"double_blocks_0_img_attn_qkv": (3 * hidden, hidden), "double_blocks_0_img_attn_proj": (hidden, hidden),
              "double_blocks_0_txt_attn_qkv": (3 * hidden, hidden), "double_blocks_0_txt_attn_proj": (hidden, hidden),
              "double_blocks_0_img_mlp_0": (mlp, hidden), "double_blocks_0_img_mlp_2": (hidden, mlp),
              "single_blocks_0_linear1": (3 * hidden + mlp, hidden), "single_blocks_0_linear2": (hidden, hidden + mlp)}
    tensors: dict[str, torch.Tensor] = {}
    for name, (o, i) in shapes.items():
        stem = f"lora_unet_{name}"
        tensors[f"{stem}.lora_down.weight"] = torch.randn(rank, i, generator=g) * 0.2
        tensors[f"{stem}.lora_up.weight"] = torch.randn(o, rank, generator=g) * 0.2
        tensors[f"{stem}.alpha"] = torch.tensor(float(rank))
    save_file(tensors, out, metadata=dict(metadata or {}))
    return out
