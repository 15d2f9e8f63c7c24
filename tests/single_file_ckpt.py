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


# --- Flux (BFL layout) ---------------------------------------------------------------------------------------
# diffusers' convert_flux_transformer_checkpoint_to_diffusers assumes FLUX.1's width (3072 = 24 heads x 128) and
# mlp ratio 4, so the tiny Flux has the real width with one double and one single block (~1.06 GB in bf16).
_FLUX_FIXED = {"time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
               "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
               "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
               "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
               "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
               "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
               "context_embedder": "txt_in", "x_embedder": "img_in", "proj_out": "final_layer.linear"}
_FLUX_DOUBLE = {"norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
                "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
                "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
                "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0",
                "ff_context.net.2": "txt_mlp.2", "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj"}
_FLUX_SINGLE = {"norm.linear": "modulation.lin", "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm",
                "proj_out": "linear2"}
_FLUX_FUSED = {"transformer_blocks": {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                                      "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")},
               "single_transformer_blocks": {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}}


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    """BFL's final adaLN is (shift, scale), diffusers' (scale, shift): the swap is its own inverse."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a])


def flux_to_bfl(state: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """The BFL names of a diffusers FluxTransformer2DModel state (fused q/k/v and single-block linear1
    concatenated back, the final norm's halves swapped), each under ``prefix`` (``model.diffusion_model.``
    in ComfyUI-style full files)."""
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for kind, fused in _FLUX_FUSED.items():
        blocks = sorted({int(k.split(".")[1]) for k in state if k.startswith(kind + ".")})
        for i in blocks:
            old = "double_blocks" if kind == "transformer_blocks" else "single_blocks"
            for target, parts in fused.items():
                for leaf in ("weight", "bias"):
                    names = [f"{kind}.{i}.{p}.{leaf}" for p in parts]
                    out[f"{prefix}{old}.{i}.{target}.{leaf}"] = torch.cat([state[n] for n in names])
                    done.update(names)
    for k, v in state.items():
        if k in done:
            continue
        head, _, leaf = k.rpartition(".")
        leaf = "scale" if head.endswith(("norm_q", "norm_k", "norm_added_q", "norm_added_k")) else leaf
        m = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.*)", head)
        if m:
            table, old = (_FLUX_DOUBLE, "double_blocks") if m[1] == "transformer_blocks" else (_FLUX_SINGLE,
                                                                                              "single_blocks")
            out[f"{prefix}{old}.{m[2]}.{table[m[3]]}.{leaf}"] = v
        elif head == "norm_out.linear":
            out[f"{prefix}final_layer.adaLN_modulation.1.{leaf}"] = _swap_halves(v)
        else:
            out[f"{prefix}{_FLUX_FIXED[head]}.{leaf}"] = v
    return out


def _seeded_like(shapes: Mapping[str, torch.Size], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Seeded values for ~500M parameters in about a second: slices of one random pool at random offsets
    (torch.randn for all of them takes ~12 s); std ~0.02 keeps a 1-step image finite."""
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn(1_000_003, generator=g) * 0.02).to(dtype)
    out = {}
    for k, shape in shapes.items():
        n = shape.numel()
        offset = int(torch.randint(0, pool.numel(), (), generator=g))
        reps = (offset + n) // pool.numel() + 1
        flat = pool.repeat(reps)[offset:offset + n] if reps > 1 else pool[offset:offset + n]
        out[k] = flat.clone().view(shape)
    return out


FLUX_TRANSFORMER = {"in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 128,
                    "num_attention_heads": 24, "joint_attention_dim": 32, "pooled_projection_dim": 32,
                    "guidance_embeds": True, "axes_dims_rope": (16, 56, 56)}


def build_tiny_flux(out: Path, clip_tokenizer: Path, t5_tokenizer: Path, seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16, transformer_config: Mapping[str, Any] | None = None) -> Path:
    """A FLUX.1-dev-shaped pipeline folder in ``dtype`` (as the Hub's FLUX.1 repos, bf16): the transformer has
    the real width (one block of each kind, seeded), the VAE (no quant convs, as Flux's) and both text encoders
    are tiny; the T5 is 32 wide (joint_attention_dim), CLIP's pooled output 32 (pooled_projection_dim)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTokenizer,
        T5Config,
        T5EncoderModel,
        T5TokenizerFast,
    )

    tokenizer = CLIPTokenizer.from_pretrained(clip_tokenizer)
    tokenizer_2 = T5TokenizerFast.from_pretrained(t5_tokenizer)
    torch.manual_seed(seed)
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**(transformer_config or FLUX_TRANSFORMER))
    shapes = {k: v.shape for k, v in transformer.state_dict().items()}
    transformer.load_state_dict(_seeded_like(shapes, dtype, seed), assign=True)
    vae = AutoencoderKL(block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=4, sample_size=32, use_quant_conv=False,
                        use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611).eval()
    te = CLIPTextModel(CLIPTextConfig(
        hidden_size=32, num_hidden_layers=2, intermediate_size=37, num_attention_heads=4, projection_dim=32,
        max_position_embeddings=77, hidden_act="gelu", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).eval()
    te2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                  relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                                  is_encoder_decoder=False, use_cache=False)).eval()
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae.to(dtype),
                        text_encoder=te.to(dtype), tokenizer=tokenizer, text_encoder_2=te2.to(dtype),
                        tokenizer_2=tokenizer_2, transformer=transformer)
    if out.exists():
        shutil.rmtree(out)
    pipe.save_pretrained(out)
    return out


def flux_checkpoint(folder: Path, *, layout: str = "bfl", transformer_delta: float = 0.0, vae_delta: float = 0.0,
                    dtype: torch.dtype | None = None, full: bool = False) -> dict[str, torch.Tensor]:
    """A Flux single-file checkpoint (as a state dict) of the pipeline ``folder``: the transformer in BFL
    layout (``layout="bfl"``: bare keys; ``"comfy"``: under ``model.diffusion_model.``) or in diffusers' own
    keys (``"diffusers"``); ``full`` adds the VAE (``vae.``, LDM layout), CLIP-L and T5 (``text_encoders.clip_l.
    transformer.``, ``text_encoders.t5xxl.transformer.``) as ComfyUI's full Flux files hold them."""
    state = _state(folder, "transformer")
    if transformer_delta:
        state = {k: v + transformer_delta for k, v in state.items()}
    if layout == "diffusers":
        out = dict(state)
    else:
        out = flux_to_bfl(state, "model.diffusion_model." if layout == "comfy" else "")
    del state
    if full:
        vae = {k: v + vae_delta for k, v in _state(folder, "vae").items()} if vae_delta else _state(folder, "vae")
        out.update({"vae." + k.removeprefix("first_stage_model."): v
                    for k, v in vae_to_ldm(vae, _config(folder, "vae")).items()})
        out.update(clip_to_ldm(_state(folder, "text_encoder"), "text_encoders.clip_l.transformer."))
        out.update({"text_encoders.t5xxl.transformer." + k: v for k, v in _state(folder, "text_encoder_2").items()})
    if dtype is not None:
        out = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in out.items()}
    return out


# --- SD3 / SD3.5 (MMDiT) ----------------------------------------------------------------------------------------
_SD3_FIXED = {"pos_embed.proj": "x_embedder.proj", "context_embedder": "context_embedder",
              "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
              "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
              "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
              "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2", "proj_out": "final_layer.linear"}
_SD3_BLOCK = {"attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
              "attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
              "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
              "attn2.to_out.0": "x_block.attn2.proj", "attn2.norm_q": "x_block.attn2.ln_q",
              "attn2.norm_k": "x_block.attn2.ln_k", "norm1.linear": "x_block.adaLN_modulation.1",
              "norm1_context.linear": "context_block.adaLN_modulation.1", "ff.net.0.proj": "x_block.mlp.fc1",
              "ff.net.2": "x_block.mlp.fc2", "ff_context.net.0.proj": "context_block.mlp.fc1",
              "ff_context.net.2": "context_block.mlp.fc2"}
_SD3_QKV = {"attn.to_": "x_block.attn.qkv", "attn.add_": "context_block.attn.qkv", "attn2.to_": "x_block.attn2.qkv"}


def _sd3_swap_halves(t: torch.Tensor) -> torch.Tensor:
    """SD3's original AdaLayerNormContinuous splits into (shift, scale), diffusers' into (scale, shift)."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a]).contiguous()


def sd3_transformer_to_original(state: Mapping[str, torch.Tensor], prefix: str = "model.diffusion_model."
                                ) -> dict[str, torch.Tensor]:
    """The MMDiT layout (``joint_blocks.N.{x,context}_block``, fused qkv) of a diffusers SD3Transformer2DModel:
    the reverse of diffusers' ``convert_sd3_transformer_checkpoint_to_diffusers``."""
    last = max(int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks."))
    out: dict[str, torch.Tensor] = {prefix + "pos_embed": state["pos_embed.pos_embed"]}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for key, v in state.items():
        head, _, leaf = key.rpartition(".")
        if head in _SD3_FIXED:
            out[f"{prefix}{_SD3_FIXED[head]}.{leaf}"] = v
        elif head == "norm_out.linear":
            out[f"{prefix}final_layer.adaLN_modulation.1.{leaf}"] = _sd3_swap_halves(v)
        elif key.startswith("transformer_blocks."):
            _, i, rest = key.split(".", 2)
            part = rest.rpartition(".")[0]
            qkv = re.fullmatch(r"(attn\.to_|attn\.add_|attn2\.to_)([qkv])(?:_proj)?", part)
            if qkv and part not in _SD3_BLOCK:
                fused.setdefault(f"{prefix}joint_blocks.{i}.{_SD3_QKV[qkv[1]]}.{leaf}", {})[qkv[2]] = v
                continue
            if part == "norm1_context.linear" and int(i) == last:
                v = _sd3_swap_halves(v)
            out[f"{prefix}joint_blocks.{i}.{_SD3_BLOCK[part]}.{leaf}"] = v
        elif key != "pos_embed.pos_embed":
            raise KeyError(f"no MMDiT name for SD3 tensor {key}")
    for name, parts in fused.items():
        out[name] = torch.cat([parts["q"], parts["k"], parts["v"]]).contiguous()
    return out


def sd3_checkpoint_from_pipeline(folder: Path, *, transformer_delta: float = 0.0, dtype: torch.dtype | None = None,
                                 components: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """A single-file SD3 checkpoint (as a state dict) of the diffusers SD3 pipeline ``folder``, in the layout of
    Stability's files: ``model.diffusion_model.`` (MMDiT), ``first_stage_model.``, ``text_encoders.clip_l.``
    (no text_projection: diffusers sets it to the identity), ``text_encoders.clip_g.``, ``text_encoders.t5xxl.``."""
    parts = {
        "transformer": lambda: sd3_transformer_to_original(
            {k: v + transformer_delta for k, v in _state(folder, "transformer").items()}),
        "vae": lambda: vae_to_ldm(_state(folder, "vae"), _config(folder, "vae")),
        "text_encoder": lambda: {"text_encoders.clip_l.transformer." + k: v
                                 for k, v in _state(folder, "text_encoder").items() if k != "text_projection.weight"},
        "text_encoder_2": lambda: {"text_encoders.clip_g.transformer." + k: v
                                   for k, v in _state(folder, "text_encoder_2").items()},
        "text_encoder_3": lambda: {"text_encoders.t5xxl.transformer." + k: v
                                   for k, v in _state(folder, "text_encoder_3").items()},
    }
    out: dict[str, torch.Tensor] = {}
    for name, make in parts.items():
        if components is None or name in components:
            out.update(make())
    if dtype is not None:
        out = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in out.items()}
    return out


def build_tiny_sd3(out: Path, clip_tokenizer_from: Path, t5_tokenizer_from: Path, seed: int = 0,
                   num_layers: int = 38) -> Path:
    """A tiny SD3.5-shaped pipeline folder (float32, seeded; ``fp16`` variant files too). 38 MMDiT blocks by
    default: diffusers detects SD3.5 large by ``joint_blocks.37`` (SD3 / 3.5 medium by their real 1536 width,
    out of reach of a tiny fixture); RMS qk-norm and dual attention in the first two blocks (3.5 medium's
    layout) so that every branch of diffusers' converter runs; CLIP-L and CLIP-G of different widths
    (diffusers tells them apart by width); CLIP-L's projection is the identity (as diffusers sets it)."""
    import copy

    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        CLIPTokenizer,
        T5Config,
        T5EncoderModel,
        T5Tokenizer,
    )

    tokenizer = CLIPTokenizer.from_pretrained(clip_tokenizer_from)
    t5_tokenizer = T5Tokenizer.from_pretrained(t5_tokenizer_from)
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=num_layers, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=16, pooled_projection_dim=56,
        pos_embed_max_size=16, dual_attention_layers=(0, 1), qk_norm="rms_norm").eval()
    vae = AutoencoderKL(block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=16,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=4, sample_size=32, use_quant_conv=False,
                        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5305).eval()
    common = {"intermediate_size": 37, "num_attention_heads": 4, "max_position_embeddings": 77,
              "hidden_act": "gelu", "layer_norm_eps": 1e-5, "vocab_size": len(tokenizer),
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
              "pad_token_id": tokenizer.pad_token_id}
    clip_l = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=32, num_hidden_layers=2, projection_dim=32,
                                                        **common)).eval()
    with torch.no_grad():
        clip_l.text_projection.weight.copy_(torch.eye(32))
    clip_g = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=24, num_hidden_layers=2, projection_dim=24,
                                                        **common)).eval()
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=64, d_kv=8, d_ff=37, num_layers=2,
                                 num_heads=4, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                                 pad_token_id=t5_tokenizer.pad_token_id, eos_token_id=t5_tokenizer.eos_token_id,
                                 decoder_start_token_id=t5_tokenizer.pad_token_id)).eval()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=clip_l, tokenizer=tokenizer, text_encoder_2=clip_g, tokenizer_2=tokenizer,
        text_encoder_3=t5, tokenizer_3=t5_tokenizer)
    if out.exists():
        shutil.rmtree(out)
    copy.deepcopy(pipe).to(torch.float16).save_pretrained(out, variant="fp16")
    pipe.save_pretrained(out)  # last: the configs say float32 (from_pretrained's "auto" reads them)
    return out


# --- raw headers: dtypes and shapes torch cannot make (sub-byte dtypes, shapes declared over no data) -------------
_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}
BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "F8_E8M0": 8}


def write_raw(path: Path, tensors: Mapping[str, tuple[str, list[int], bytes]],
              metadata: Mapping[str, str] | None = None) -> Path:
    """A safetensors file from ``{name: (dtype code, shape, data)}`` as given (no check that shape and data agree:
    the reader's budgets are what is under test), tensors in name order, the header padded to 8 bytes."""
    import struct

    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata is not None else {}
    blobs, at = [], 0
    for name in sorted(tensors):
        code, shape, data = tensors[name]
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path


def raw_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, list[int], bytes]]:
    """``state`` as :func:`write_raw` takes it."""
    return {k: (_CODES[t.dtype], list(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            for k, t in state.items()}


def retyped(state: Mapping[str, torch.Tensor], key: str, code: str) -> dict[str, tuple[str, list[int], bytes]]:
    """``state`` with tensor ``key`` declared as dtype ``code`` (one of :data:`BITS`), its data resized to fit."""
    out = raw_tensors(state)
    shape = list(state[key].shape)
    n = state[key].numel()
    out[key] = (code, shape, b"\x11" * (n * BITS[code] // 8))
    return out
