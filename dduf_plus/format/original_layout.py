"""The way out: each diffusers component's tensors named as in its family's original single-file layout (LDM
UNet / VAE, OpenCLIP, transformers' CLIP and T5, SD3's MMDiT, BFL's Flux transformer).

These are the reverses of diffusers' ``loaders/single_file_utils.py`` converters (``convert_ldm_unet_checkpoint``,
``convert_ldm_vae_checkpoint``, ``convert_ldm_clip_checkpoint``, ``convert_open_clip_checkpoint``,
``convert_sd3_transformer_checkpoint_to_diffusers``, ``convert_flux_transformer_checkpoint_to_diffusers``),
written from diffusers' key maps as facts. They work on names and shapes only (no torch): a :class:`Piece` says
how one original tensor is made from the component's diffusers tensors (as it is, concatenated, halves swapped,
transposed, or a 1x1 convolution), so the writer can make the bytes of one tensor at a time, and
tests/test_export.py checks that diffusers' own converters map every piece back exactly. One forward map is here
too, for the model-folder search (:mod:`dduf_plus.refs.model_dirs`): an LDM VAE file's names in diffusers'
naming (:func:`diffusers_vae_names`), checked against the reverse. Torch-free."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from ..errors import DDUFPackError

__all__ = ["KINDS", "Piece", "diffusers_vae_names", "original_pieces"]


class Piece(NamedTuple):
    """One tensor of the original layout: ``op`` applied to ``sources`` (the component's diffusers names)."""

    name: str  # without the component's prefix in a full file
    op: str  # "copy", "cat" (dim 0, in order), "swap" (the two halves of dim 0), "T" (2-D transpose), "conv1x1"
    sources: tuple[str, ...]
    shape: tuple[int, ...]


def _shape(op: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    first = shapes[0]
    if op == "cat":
        return (sum(s[0] for s in shapes),) + first[1:]
    if op == "T":
        return tuple(reversed(first))
    if op == "conv1x1":
        return first + (1, 1)
    return first


def _piece(name: str, op: str, sources: tuple[str, ...], shapes: Mapping[str, tuple[int, ...]]) -> Piece:
    return Piece(name, op, sources, _shape(op, [tuple(shapes[s]) for s in sources]))


# --- LDM UNet (diffusers' DIFFUSERS_TO_LDM_MAPPING["unet"] and the block arithmetic of its converter) ----------
_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
           "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
_UNET_FIXED = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
               "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
               "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
               "class_embedding.linear_1": "label_emb.0.0", "class_embedding.linear_2": "label_emb.0.2"}


def _resnet(rest: str, table: Mapping[str, str] = _RESNET) -> str:
    first, _, tail = rest.partition(".")
    return f"{table.get(first, first)}.{tail}"


def _unet_rules(config: Mapping[str, Any]) -> list[tuple[str, Callable[..., str]]]:
    """LDM numbers a UNet's blocks flat: ``input_blocks.N`` counts each level's resnets plus its downsampler."""
    n = int(config.get("layers_per_block", 2)) + 1
    attn_up = [str(t).startswith("CrossAttn") for t in config.get("up_block_types", ())]
    return [
        (r"down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", lambda b, j, r: f"input_blocks.{1 + b * n + j}.0.{_resnet(r)}"),
        (r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.*)", lambda b, j, r: f"input_blocks.{1 + b * n + j}.1.{r}"),
        (r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", lambda b, r: f"input_blocks.{b * n + n}.0.op.{r}"),
        (r"mid_block\.resnets\.(\d+)\.(.*)", lambda k, r: f"middle_block.{2 * k}.{_resnet(r)}"),
        (r"mid_block\.attentions\.0\.(.*)", lambda r: f"middle_block.1.{r}"),
        (r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", lambda b, j, r: f"output_blocks.{b * n + j}.0.{_resnet(r)}"),
        (r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.*)", lambda b, j, r: f"output_blocks.{b * n + j}.1.{r}"),
        (r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)",
         lambda b, r: f"output_blocks.{b * n + n - 1}.{2 if b < len(attn_up) and attn_up[b] else 1}.conv.{r}"),
    ]


def _match(rules: list[tuple[str, Callable[..., str]]], key: str) -> str | None:
    for pattern, build in rules:
        m = re.fullmatch(pattern, key)
        if m:
            return build(*[int(g) if g.isdigit() else g for g in m.groups()])
    return None


def _unet(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> list[Piece]:
    rules = _unet_rules(config)
    out = []
    for key in shapes:
        head, _, leaf = key.rpartition(".")
        name = f"{_UNET_FIXED[head]}.{leaf}" if head in _UNET_FIXED else _match(rules, key)
        if name is None:
            raise DDUFPackError(f"unet: {key} has no place in the LDM UNet layout (a UNet diffusers' single-file "
                                "converter does not know)")
        out.append(_piece(name, "copy", (key,), shapes))
    return out


# --- LDM VAE ---------------------------------------------------------------------------------------------------
_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _vae(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> list[Piece]:
    n_up = len(config.get("up_block_types", ()))
    short = {"conv_shortcut": "nin_shortcut"}
    rules: list[tuple[str, Callable[..., str]]] = [
        (r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)",
         lambda i, j, r: f"encoder.down.{i}.block.{j}.{_resnet(r, short)}"),
        (r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", lambda i, r: f"encoder.down.{i}.downsample.conv.{r}"),
        (r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)",
         lambda i, j, r: f"decoder.up.{n_up - 1 - i}.block.{j}.{_resnet(r, short)}"),
        (r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)", lambda i, r: f"decoder.up.{n_up - 1 - i}.upsample.conv.{r}"),
        (r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.*)", lambda x, k, r: f"{x}.mid.block_{k + 1}.{_resnet(r, short)}"),
        (r"(encoder|decoder)\.mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)\.(.*)",
         lambda x, p, r: f"{x}.mid.attn_1.{_VAE_ATTN[p]}.{r}"),
        (r"(encoder|decoder)\.conv_norm_out\.(.*)", lambda x, r: f"{x}.norm_out.{r}"),
    ]
    out = []
    for key, shape in shapes.items():
        name = _match(rules, key) or key  # conv_in, conv_out, quant_conv, post_quant_conv keep their names
        # diffusers' conv_attn_to_linear made LDM's 1x1 attention convolutions linear: made convolutions again
        op = "conv1x1" if ".mid.attn_1." in name and name.endswith(".weight") and len(shape) == 2 else "copy"
        out.append(_piece(name, op, (key,), shapes))
    return out


_UNSHORT = {"nin_shortcut": "conv_shortcut"}
_VAE_ATTN_BACK = {v: k for k, v in _VAE_ATTN.items()}


def _vae_forward(n_up: int) -> list[tuple[str, Callable[..., str]]]:
    return [
        (r"encoder\.down\.(\d+)\.block\.(\d+)\.(.*)",
         lambda i, j, r: f"encoder.down_blocks.{i}.resnets.{j}.{_resnet(r, _UNSHORT)}"),
        (r"encoder\.down\.(\d+)\.downsample\.conv\.(.*)", lambda i, r: f"encoder.down_blocks.{i}.downsamplers.0.conv.{r}"),
        (r"decoder\.up\.(\d+)\.block\.(\d+)\.(.*)",
         lambda i, j, r: f"decoder.up_blocks.{n_up - 1 - i}.resnets.{j}.{_resnet(r, _UNSHORT)}"),
        (r"decoder\.up\.(\d+)\.upsample\.conv\.(.*)", lambda i, r: f"decoder.up_blocks.{n_up - 1 - i}.upsamplers.0.conv.{r}"),
        (r"(encoder|decoder)\.mid\.block_(\d+)\.(.*)",
         lambda x, k, r: f"{x}.mid_block.resnets.{k - 1}.{_resnet(r, _UNSHORT)}"),
        (r"(encoder|decoder)\.mid\.attn_1\.(norm|q|k|v|proj_out)\.(.*)",
         lambda x, p, r: f"{x}.mid_block.attentions.0.{_VAE_ATTN_BACK[p]}.{r}"),
        (r"(encoder|decoder)\.norm_out\.(.*)", lambda x, r: f"{x}.conv_norm_out.{r}"),
    ]


def diffusers_vae_names(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """{LDM name: (diffusers name, shape)} for the tensors of a bare LDM VAE (ComfyUI's ``models/vae``), or None
    when they are not one: the result must map back to exactly ``shapes`` through the reverse (:func:`_vae`)."""
    ups = {int(m[1]) for k in shapes if (m := re.match(r"decoder\.up\.(\d+)\.", k))}
    if not ups or not any(k.startswith("encoder.down.") for k in shapes):
        return None
    n_up = max(ups) + 1
    rules = _vae_forward(n_up)
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        name = _match(rules, key) or key
        if ".mid_block.attentions.0." in name and name.endswith(".weight") and len(shape) == 4 and shape[2:] == (1, 1):
            shape = shape[:2]  # LDM's 1x1 attention convolutions are linear in diffusers (the same bytes)
        out[key] = (name, tuple(shape))
    try:
        back = _vae({n: s for n, s in out.values()}, {"up_block_types": [None] * n_up})
    except (KeyError, IndexError):  # pragma: no cover - the rules above only make names _vae knows
        return None
    return out if {p.name: p.shape for p in back} == {k: tuple(s) for k, s in shapes.items()} else None


# --- text encoders ---------------------------------------------------------------------------------------------
def _clip(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> list[Piece]:
    """transformers' CLIP layout, with the ``text_model.`` prefix transformers >= 5.6 flattened away put back
    (the layout of the released files; diffusers strips it again where the installed model has none)."""
    return [_piece(k if k.startswith("text_model.") or k == "text_projection.weight" else "text_model." + k,
                   "copy", (k,), shapes) for k in shapes]


def _sd3_clip_l(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> list[Piece]:
    """SD3's CLIP-L ships without its projection (diffusers loads the identity): checked by the writer."""
    return [p for p in _clip(shapes, config) if p.name != "text_projection.weight"]


_OPEN_CLIP_FIXED = {"embeddings.token_embedding.weight": "token_embedding.weight",
                    "embeddings.position_embedding.weight": "positional_embedding",
                    "final_layer_norm.weight": "ln_final.weight", "final_layer_norm.bias": "ln_final.bias"}
_OPEN_CLIP_LAYER = (("layer_norm1", "ln_1"), ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"),
                    ("mlp.fc2", "mlp.c_proj"), ("self_attn.out_proj", "attn.out_proj"))


def _open_clip(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> list[Piece]:
    """OpenCLIP's layout (``convert_open_clip_checkpoint`` reversed): q/k/v fused into ``in_proj``, the
    projection transposed."""
    out: list[Piece] = []
    fused: dict[str, dict[str, str]] = {}
    for key in shapes:
        k = key.removeprefix("text_model.")
        if k in _OPEN_CLIP_FIXED:
            out.append(_piece(_OPEN_CLIP_FIXED[k], "copy", (key,), shapes))
            continue
        if k == "text_projection.weight":
            out.append(_piece("text_projection", "T", (key,), shapes))
            continue
        m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.*)", k)
        if m is None:
            raise DDUFPackError(f"text encoder: {key} has no place in the OpenCLIP layout")
        layer, rest = m.groups()
        qkv = re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", rest)
        if qkv:
            fused.setdefault(f"transformer.resblocks.{layer}.attn.in_proj_{qkv[2]}", {})[qkv[1]] = key
            continue
        for new, old in _OPEN_CLIP_LAYER:
            rest = rest.replace(new, old)
        out.append(_piece(f"transformer.resblocks.{layer}.{rest}", "copy", (key,), shapes))
    for name, parts in sorted(fused.items()):
        if set(parts) != {"q", "k", "v"}:
            raise DDUFPackError(f"text encoder: {name} lacks one of q/k/v ({sorted(parts)})")
        out.append(_piece(name, "cat", (parts["q"], parts["k"], parts["v"]), shapes))
    return out


def _t5(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> list[Piece]:
    return [_piece(k, "copy", (k,), shapes) for k in shapes]


# --- SD3 MMDiT -------------------------------------------------------------------------------------------------
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


def _sd3(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> list[Piece]:
    """MMDiT (``joint_blocks.N.{x,context}_block``, fused qkv; the final and the last context adaLN's
    (shift, scale) halves, which diffusers swaps)."""
    blocks = [int(k.split(".")[1]) for k in shapes if k.startswith("transformer_blocks.")]
    last = max(blocks, default=-1)
    out: list[Piece] = []
    fused: dict[str, dict[str, str]] = {}
    for key in shapes:
        head, _, leaf = key.rpartition(".")
        if key == "pos_embed.pos_embed":
            out.append(_piece("pos_embed", "copy", (key,), shapes))
        elif head in _SD3_FIXED:
            out.append(_piece(f"{_SD3_FIXED[head]}.{leaf}", "copy", (key,), shapes))
        elif head == "norm_out.linear":
            out.append(_piece(f"final_layer.adaLN_modulation.1.{leaf}", "swap", (key,), shapes))
        elif key.startswith("transformer_blocks."):
            _, i, rest = key.split(".", 2)
            part = rest.rpartition(".")[0]
            qkv = re.fullmatch(r"(attn\.to_|attn\.add_|attn2\.to_)([qkv])(?:_proj)?", part)
            if qkv and part not in _SD3_BLOCK:
                fused.setdefault(f"joint_blocks.{i}.{_SD3_QKV[qkv[1]]}.{leaf}", {})[qkv[2]] = key
            elif part in _SD3_BLOCK:
                op = "swap" if part == "norm1_context.linear" and int(i) == last else "copy"
                out.append(_piece(f"joint_blocks.{i}.{_SD3_BLOCK[part]}.{leaf}", op, (key,), shapes))
            else:
                raise DDUFPackError(f"transformer: {key} has no place in the SD3 MMDiT layout")
        else:
            raise DDUFPackError(f"transformer: {key} has no place in the SD3 MMDiT layout")
    return out + _fused(fused, "qkv")


def _fused(fused: Mapping[str, Mapping[str, str]], what: str, order: tuple[str, ...] = ("q", "k", "v")) -> list[Piece]:
    out = []
    for name, parts in sorted(fused.items()):
        if set(parts) != set(order):
            raise DDUFPackError(f"transformer: {name} lacks a part of its fused {what} ({sorted(parts)})")
        out.append(Piece(name, "cat", tuple(parts[p] for p in order), ()))
    return out


# --- Flux (BFL) ------------------------------------------------------------------------------------------------
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
_FLUX_FUSED: dict[str, dict[str, tuple[str, ...]]] = {"transformer_blocks": {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                                      "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")},
               "single_transformer_blocks": {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}}
_FLUX_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")  # RMSNorm weights: BFL calls them ``scale``


def _flux(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> list[Piece]:
    out: list[Piece] = []
    done: set[str] = set()
    for kind, fused in _FLUX_FUSED.items():
        old = "double_blocks" if kind == "transformer_blocks" else "single_blocks"
        for i in sorted({int(k.split(".")[1]) for k in shapes if k.startswith(kind + ".")}):
            for target, parts in fused.items():
                for leaf in ("weight", "bias"):
                    names = tuple(f"{kind}.{i}.{p}.{leaf}" for p in parts)
                    if not all(n in shapes for n in names):
                        raise DDUFPackError(f"transformer: {old}.{i}.{target}.{leaf} lacks a part ({names})")
                    out.append(_piece(f"{old}.{i}.{target}.{leaf}", "cat", names, shapes))
                    done.update(names)
    for key in shapes:
        if key in done:
            continue
        head, _, leaf = key.rpartition(".")
        leaf = "scale" if head.endswith(_FLUX_NORMS) else leaf
        m = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.*)", head)
        table, old = (_FLUX_DOUBLE, "double_blocks") if m and m[1] == "transformer_blocks" else (_FLUX_SINGLE,
                                                                                                "single_blocks")
        if m and m[3] in table:
            out.append(_piece(f"{old}.{m[2]}.{table[m[3]]}.{leaf}", "copy", (key,), shapes))
        elif head == "norm_out.linear":  # BFL's final adaLN is (shift, scale), diffusers' (scale, shift)
            out.append(_piece(f"final_layer.adaLN_modulation.1.{leaf}", "swap", (key,), shapes))
        elif not m and head in _FLUX_FIXED:
            out.append(_piece(f"{_FLUX_FIXED[head]}.{leaf}", "copy", (key,), shapes))
        else:
            raise DDUFPackError(f"transformer: {key} has no place in BFL's Flux layout")
    return out


Layout = Callable[[Mapping[str, tuple[int, ...]], Mapping[str, Any]], list[Piece]]
# single_file_layout.Component.kind -> its reverse
KINDS: dict[str, Layout] = {"unet": _unet, "vae": _vae, "clip": _clip, "open_clip": _open_clip, "t5": _t5,
                            "sd3_transformer": _sd3, "sd3_clip_l": _sd3_clip_l, "sd3_clip_g": _clip, "flux": _flux}


def original_pieces(kind: str, shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> list[Piece]:
    """The original-layout tensors of a component of ``kind`` whose diffusers tensors have ``shapes``."""
    pieces = KINDS[kind](shapes, config)
    out = [p if p.shape or p.op != "cat" else _piece(p.name, p.op, p.sources, shapes) for p in pieces]
    names = [p.name for p in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise DDUFPackError(f"{kind}: two tensors map to {dup} in the original layout")
    return out
