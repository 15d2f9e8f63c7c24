"""Tiny single-file checkpoints in the original LDM / SGM key layout, made from diffusers pipelines.

The reverse of diffusers' single-file mapping (``convert_ldm_unet_checkpoint``, ``convert_ldm_vae_checkpoint``,
``convert_ldm_clip_checkpoint``, ``convert_open_clip_checkpoint``), written from the original layouts' structure;
``tests/test_single_file.py`` checks that diffusers' forward conversion maps every key back exactly.
Also a tiny SDXL-base-shaped pipeline (seeded; the second text encoder has 10 layers so that diffusers'
``xl_base`` marker key exists, and a width other than the first's so that diffusers tells them apart)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
           "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
_UNET_FIXED = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
               "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
               "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
               "class_embedding.linear_1": "label_emb.0.0", "class_embedding.linear_2": "label_emb.0.2"}


def _resnet(rest: str, table: Mapping[str, str] = _RESNET) -> str:
    first, _, tail = rest.partition(".")
    return f"{table.get(first, first)}.{tail}"


def unet_key(key: str, config: Mapping[str, Any]) -> str:
    """The LDM name (without ``model.diffusion_model.``) of a diffusers UNet2DConditionModel tensor."""
    n = config["layers_per_block"] + 1
    attn_up = [t.startswith("CrossAttn") for t in config["up_block_types"]]
    head, _, leaf = key.rpartition(".")
    if head in _UNET_FIXED:
        return f"{_UNET_FIXED[head]}.{leaf}"
    rules = [
        (r"down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", lambda b, j, r: f"input_blocks.{1 + b * n + j}.0.{_resnet(r)}"),
        (r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.*)", lambda b, j, r: f"input_blocks.{1 + b * n + j}.1.{r}"),
        (r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", lambda b, r: f"input_blocks.{b * n + n}.0.op.{r}"),
        (r"mid_block\.resnets\.(\d+)\.(.*)", lambda k, r: f"middle_block.{2 * k}.{_resnet(r)}"),
        (r"mid_block\.attentions\.0\.(.*)", lambda r: f"middle_block.1.{r}"),
        (r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", lambda b, j, r: f"output_blocks.{b * n + j}.0.{_resnet(r)}"),
        (r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.*)", lambda b, j, r: f"output_blocks.{b * n + j}.1.{r}"),
        (r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)",
         lambda b, r: f"output_blocks.{b * n + n - 1}.{2 if attn_up[b] else 1}.conv.{r}"),
    ]
    for pattern, build in rules:
        m = re.fullmatch(pattern, key)
        if m:
            args = [int(g) if g.isdigit() else g for g in m.groups()]
            return build(*args)
    raise KeyError(f"no LDM name for UNet tensor {key}")


_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def vae_key(key: str, config: Mapping[str, Any]) -> str:
    """The LDM name (without ``first_stage_model.``) of a diffusers AutoencoderKL tensor."""
    n_up = len(config["up_block_types"])
    shortcut = {"conv_shortcut": "nin_shortcut"}
    for pattern, build in [
        (r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", lambda i, j, r: f"encoder.down.{i}.block.{j}.{_resnet(r, shortcut)}"),
        (r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", lambda i, r: f"encoder.down.{i}.downsample.conv.{r}"),
        (r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", lambda i, j, r: f"decoder.up.{n_up - 1 - i}.block.{j}.{_resnet(r, shortcut)}"),
        (r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)", lambda i, r: f"decoder.up.{n_up - 1 - i}.upsample.conv.{r}"),
        (r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.*)", lambda x, k, r: f"{x}.mid.block_{k + 1}.{_resnet(r, shortcut)}"),
        (r"(encoder|decoder)\.mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)\.(.*)",
         lambda x, p, r: f"{x}.mid.attn_1.{_VAE_ATTN[p]}.{r}"),
        (r"(encoder|decoder)\.conv_norm_out\.(.*)", lambda x, r: f"{x}.norm_out.{r}"),
    ]:
        m = re.fullmatch(pattern, key)
        if m:
            return build(*[int(g) if g.isdigit() else g for g in m.groups()])
    return key  # conv_in, conv_out, quant_conv, post_quant_conv keep their names


def unet_to_ldm(state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {"model.diffusion_model." + unet_key(k, config): v for k, v in state.items()}


def vae_to_ldm(state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        name = vae_key(k, config)
        if ".mid.attn_1." in name and name.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]  # LDM's attention projections are 1x1 convolutions
        out["first_stage_model." + name] = v.contiguous()
    return out


def clip_to_ldm(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """CLIP-L as transformers' CLIPTextModel (``text_model.`` added back where it is flattened), plus the
    int64 ``position_ids`` real SD 1.x files carry (diffusers drops it)."""
    out = {prefix + (k if k.startswith("text_model.") else "text_model." + k): v for k, v in state.items()}
    out[prefix + "text_model.embeddings.position_ids"] = torch.arange(77, dtype=torch.int64)[None]
    return out


def open_clip_to_ldm(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """OpenCLIP layout of a CLIPTextModelWithProjection: fused in_proj, transposed text_projection."""
    state = {k.removeprefix("text_model."): v for k, v in state.items()}
    fixed = {"embeddings.token_embedding.weight": "token_embedding.weight",
             "embeddings.position_embedding.weight": "positional_embedding",
             "final_layer_norm.weight": "ln_final.weight", "final_layer_norm.bias": "ln_final.bias"}
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in state.items():
        if k in fixed:
            out[prefix + fixed[k]] = v
        elif k == "text_projection.weight":
            out[prefix + "text_projection"] = v.T.contiguous()
        else:
            m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.*)", k)
            assert m, k
            layer, rest = m.groups()
            qkv = re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", rest)
            if qkv:
                fused.setdefault(f"{prefix}transformer.resblocks.{layer}.attn.in_proj_{qkv[2]}", {})[qkv[1]] = v
                continue
            for new, old in (("layer_norm1", "ln_1"), ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"),
                             ("mlp.fc2", "mlp.c_proj"), ("self_attn.out_proj", "attn.out_proj")):
                rest = rest.replace(new, old)
            out[f"{prefix}transformer.resblocks.{layer}.{rest}"] = v
    for name, parts in fused.items():
        out[name] = torch.cat([parts["q"], parts["k"], parts["v"]]).contiguous()
    return out


def _config(folder: Path, name: str) -> dict[str, Any]:
    return json.loads((folder / name / "config.json").read_text())


def _state(folder: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted((folder / name).glob("*.safetensors")):
        if f.name.count(".") == 1:  # no variant
            out.update(load_file(f))
    return out


def checkpoint_from_pipeline(folder: Path, family: str, *, unet_delta: float = 0.0,
                             dtype: torch.dtype | None = None, components: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """A single-file checkpoint (as a state dict) of the diffusers pipeline ``folder`` (``v1``, ``v2``,
    ``xl_base``, ``xl_refiner``);
    ``unet_delta`` is added to every UNet tensor (a fine-tune), ``dtype`` casts floating tensors."""
    parts = {"unet": lambda: unet_to_ldm({k: v + unet_delta for k, v in _state(folder, "unet").items()},
                                         _config(folder, "unet")),
             "vae": lambda: vae_to_ldm(_state(folder, "vae"), _config(folder, "vae"))}
    if family in ("v1", "xl_base"):
        te = "cond_stage_model.transformer." if family == "v1" else "conditioner.embedders.0.transformer."
        parts["text_encoder"] = lambda: clip_to_ldm(_state(folder, "text_encoder"), te)
    if family == "v2":  # OpenCLIP-H; its text_projection has no place in CLIPTextModel (diffusers drops it)
        parts["text_encoder"] = lambda: {**open_clip_to_ldm(_state(folder, "text_encoder"), "cond_stage_model.model."),
                                         "cond_stage_model.model.text_projection": torch.ones(1024, 1024)}
    if family in ("xl_base", "xl_refiner"):
        prefix = "conditioner.embedders.1.model." if family == "xl_base" else "conditioner.embedders.0.model."
        parts["text_encoder_2"] = lambda: open_clip_to_ldm(_state(folder, "text_encoder_2"), prefix)
    out: dict[str, torch.Tensor] = {}
    for name, make in parts.items():
        if components is None or name in components:
            out.update(make())
    if dtype is not None:
        out = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in out.items()}
    return out


def build_tiny_sdxl(out: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """A tiny SDXL-base-shaped pipeline folder (float32, seeded), with ``fp16`` variant files."""
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(tokenizer_from)
    ids = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(16, 32), layers_per_block=2, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=72,
        cross_attention_dim=56, norm_num_groups=8).eval()
    vae = AutoencoderKL(block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=4, sample_size=32).eval()
    common = {"intermediate_size": 37, "num_attention_heads": 4, "max_position_embeddings": 77,
              "hidden_act": "gelu", "layer_norm_eps": 1e-5, **ids}
    te = CLIPTextModel(CLIPTextConfig(hidden_size=32, num_hidden_layers=2, projection_dim=32, **common)).eval()
    te2 = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=24, num_hidden_layers=10, projection_dim=24,
                                                     **common)).eval()
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       num_train_timesteps=1000, steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=te, text_encoder_2=te2, tokenizer=tokenizer,
                                     tokenizer_2=tokenizer, unet=unet, scheduler=scheduler)
    if out.exists():
        shutil.rmtree(out)
    pipe.save_pretrained(out)
    pipe.to(torch.float16).save_pretrained(out, variant="fp16")  # as the Hub's SDXL base has both
    return out


def _tiny_vae() -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=4,
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         layers_per_block=1, norm_num_groups=4, sample_size=32).eval()


def build_tiny_sd2(out: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """A tiny SD-2.x-shaped pipeline (float32): 1024-wide one-layer text encoder (diffusers' ``v2`` marker is
    the width of ``input_blocks.2.1``'s cross-attention), linear projections, attention in the first block."""
    from diffusers import PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(tokenizer_from)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(16, 32), layers_per_block=2, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, cross_attention_dim=1024, norm_num_groups=8).eval()
    te = CLIPTextModel(CLIPTextConfig(
        hidden_size=1024, num_hidden_layers=1, intermediate_size=64, num_attention_heads=16, projection_dim=1024,
        max_position_embeddings=77, hidden_act="gelu", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).eval()
    scheduler = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", skip_prk_steps=True,
                              set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=_tiny_vae(), text_encoder=te, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    if out.exists():
        shutil.rmtree(out)
    pipe.save_pretrained(out)
    return out


def build_tiny_sdxl_refiner(out: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """A tiny SDXL-refiner-shaped pipeline (float32): only the OpenCLIP encoder (10 layers: diffusers'
    ``xl_refiner`` marker is ``resblocks.9``), aesthetic-score time ids."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLImg2ImgPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(tokenizer_from)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(16, 32), layers_per_block=2, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=64,
        cross_attention_dim=24, norm_num_groups=8).eval()
    te2 = CLIPTextModelWithProjection(CLIPTextConfig(
        hidden_size=24, num_hidden_layers=10, intermediate_size=37, num_attention_heads=4, projection_dim=24,
        max_position_embeddings=77, hidden_act="gelu", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).eval()
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionXLImg2ImgPipeline(vae=_tiny_vae(), text_encoder=None, text_encoder_2=te2, tokenizer=None,
                                            tokenizer_2=tokenizer, unet=unet, scheduler=scheduler,
                                            requires_aesthetics_score=True, force_zeros_for_empty_prompt=False)
    if out.exists():
        shutil.rmtree(out)
    pipe.save_pretrained(out)
    return out
