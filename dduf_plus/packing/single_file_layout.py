"""Single-file checkpoints: what a file is. The families dduf converts (diffusers' model-type names, each
component's key prefix in the original layout), detection of a file's architecture (diffusers' own
``infer_diffusers_model_type``, or a torch-free copy of its first marker checks for ``dduf info``), and what a
file holds per component. Headers only: no tensor byte is read here.

The file is untrusted: its header is parsed with the format layer's budgets before any byte is mapped."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from ..errors import DDUFNotFoundError, DDUFPackError
from ..format import spec
from ..format.safetensors_header import SafetensorsHeader, TensorInfo, read_file_header

__all__ = ["FAMILIES", "Component", "Family", "describe_checkpoint", "detect_architecture", "family_for",
           "held_tensors", "is_single_file", "quick_architecture", "read_checkpoint_header", "refuse_scaled_fp8",
           "unconverted_dtype", "unconverted_tensor"]


class Component(NamedTuple):
    kind: str  # "unet", "vae", "clip" (CLIP-L, transformers layout), "open_clip" (OpenCLIP layout); SD3: see _SD3
    prefix: str  # the component's key prefix in the checkpoint ("": every key not under ``exclude``)
    exclude: tuple[str, ...] = ()  # the other components' prefixes, where ``prefix`` is "" (Flux)

    def owns(self, key: str) -> bool:
        """Whether checkpoint key ``key`` is this component's."""
        return key.startswith(self.prefix) and not key.startswith(self.exclude)


class Family(NamedTuple):
    name: str  # in words
    pipelines: tuple[str, ...]  # BASE's model_index _class_name must be one of these
    components: dict[str, Component]


_UNET = Component("unet", "model.diffusion_model.")
_VAE = Component("vae", "first_stage_model.")
# Keyed by diffusers' infer_diffusers_model_type names.
FAMILIES: dict[str, Family] = {
    "v1": Family("SD 1.x", ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline"),
                 {"unet": _UNET, "vae": _VAE, "text_encoder": Component("clip", "cond_stage_model.transformer.")}),
    "v2": Family("SD 2.x", ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline"),
                 {"unet": _UNET, "vae": _VAE, "text_encoder": Component("open_clip", "cond_stage_model.model.")}),
    "xl_base": Family("SDXL base", ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline"),
                      {"unet": _UNET, "vae": _VAE,
                       "text_encoder": Component("clip", "conditioner.embedders.0.transformer."),
                       "text_encoder_2": Component("open_clip", "conditioner.embedders.1.model.")}),
    "xl_refiner": Family("SDXL refiner", ("StableDiffusionXLImg2ImgPipeline",),
                         {"unet": _UNET, "vae": _VAE,
                          "text_encoder_2": Component("open_clip", "conditioner.embedders.0.model.")}),
}
# SD3 / SD3.5 (Stability's and ComfyUI's files): MMDiT transformer, SD3 VAE in the LDM layout, CLIP-L and CLIP-G
# in transformers' layout, T5-XXL; diffusers tells the three sizes apart (one family for dduf pack).
_SD3 = {"transformer": Component("sd3_transformer", "model.diffusion_model."), "vae": _VAE,
        "text_encoder": Component("sd3_clip_l", "text_encoders.clip_l.transformer."),
        "text_encoder_2": Component("sd3_clip_g", "text_encoders.clip_g.transformer."),
        "text_encoder_3": Component("t5", "text_encoders.t5xxl.transformer.")}
_SD3_PIPELINES = ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline")
FAMILIES.update({"sd3": Family("SD3 medium", _SD3_PIPELINES, _SD3),
                 "sd35_medium": Family("SD3.5 medium", _SD3_PIPELINES, _SD3),
                 "sd35_large": Family("SD3.5 large", _SD3_PIPELINES, _SD3)})
# Flux (BFL layout): the transformer's keys are bare (``double_blocks.*``: BFL's own files, transformer-only) or
# under ``model.diffusion_model.`` (ComfyUI's full files, with ``vae.`` and ``text_encoders.*`` beside them);
# diffusers' converter strips that prefix itself, so the transformer owns every key no other component owns.
# A transformer-only file in diffusers' own keys (``transformer_blocks.*``) is passed through, as
# ``from_single_file`` does when the keys are exactly the model's.
_FLUX_OTHERS = {"vae": Component("vae", "vae."), "text_encoder": Component("clip", "text_encoders.clip_l.transformer."),
                "text_encoder_2": Component("t5", "text_encoders.t5xxl.transformer.")}
_FLUX = {"transformer": Component("flux", "", tuple(c.prefix for c in _FLUX_OTHERS.values())), **_FLUX_OTHERS}
_FLUX_PIPELINES = ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline")
FAMILIES.update({"flux-dev": Family("FLUX.1 dev", _FLUX_PIPELINES, _FLUX),
                 "flux-schnell": Family("FLUX.1 schnell", _FLUX_PIPELINES, _FLUX)})
# Prefixes other checkpoint layouts use: a file with none of these and no family prefix is of no known kind.
_FOREIGN_HINTS = ("double_blocks.", "joint_blocks.", "model.diffusion_model.double_blocks.",
                  "model.diffusion_model.joint_blocks.", "text_encoders.")


def is_single_file(path: str | os.PathLike) -> bool:
    """A local ``.safetensors`` file (not a folder): what ``pack`` treats as a single-file checkpoint."""
    return os.path.isfile(path) and os.fspath(path).endswith(".safetensors")


# --- reading the checkpoint ------------------------------------------------------------------------------
def read_checkpoint_header(path: str | os.PathLike) -> SafetensorsHeader:
    """The checked header (same budgets as an archive's weights; never the tensor data)."""
    if not os.path.exists(path):
        raise DDUFNotFoundError(f"{path} does not exist", os.fspath(path))
    if not os.path.isfile(path):
        raise DDUFPackError(f"{path} is not a file (a single-file .safetensors checkpoint)")
    return read_file_header(path, os.path.basename(path), DDUFPackError)


class _Shape:
    """What ``infer_diffusers_model_type`` reads of a tensor: its shape (no data is touched)."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape


def detect_architecture(header: SafetensorsHeader, where: str = "the checkpoint") -> str:
    """diffusers' model type of a checkpoint (``v1``, ``xl_base``, ...), from its keys and a few shapes.

    Raises:
        DDUFPackError: no key of a known layout (diffusers would call anything "v1"), or diffusers fails.
    """
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    keys = header.tensors
    if FLUX_DIFFUSERS_MARK.issubset(keys):  # diffusers' own keys: from_single_file is given the config, no detection
        return _flux_variant(keys, "time_text_embed.guidance_embedder.linear_1.bias", "x_embedder.weight")
    try:
        found = infer_diffusers_model_type({k: _Shape(v.shape) for k, v in keys.items()})
    except (KeyError, IndexError, TypeError, AttributeError, NameError) as e:  # a hostile mix of marker keys
        # (NameError: diffusers' SD3 branch leaves its model type unbound for an unknown position grid)
        raise DDUFPackError(f"{where}: cannot tell its architecture (diffusers' detection failed: "
                            f"{type(e).__name__}: {e})") from None
    family = FAMILIES.get(found)
    foreign = next((k for k in keys if k.startswith(_FOREIGN_HINTS)), None)
    if found == "v1" and foreign is not None:  # diffusers' fallback: it would convert an MMDiT as a UNet
        raise DDUFPackError(f"{where}: its keys are in a transformer layout ({foreign}) that diffusers' single-file "
                            "detection does not recognise at this size (it falls back to SD 1.x): a pruned or "
                            "resized model? (diffusers tells SD3 and SD3.5 medium by their 1536-wide blocks and "
                            "position grid, SD3.5 large by its 38th block)")
    if family is not None and any(c.owns(k) for c in family.components.values() for k in keys):
        return str(found)
    if found != "v1":
        return str(found)  # a diffusers model type dduf pack does not convert (said by the caller)
    sample = ", ".join(sorted({k.split(".")[0] for k in keys})[:5]) or "no tensors"
    raise DDUFPackError(f"{where}: unknown architecture: none of its {len(keys)} keys is in a layout diffusers' "
                        f"single-file loader knows (top-level names: {sample})")


# diffusers' CHECKPOINT_KEY_NAMES for the families above (dduf info must not import diffusers: ~2-9 s)
_MARK_INPAINT = "model.diffusion_model.input_blocks.0.0.weight"
_MARK_V2 = "model.diffusion_model.input_blocks.2.1.transformer_blocks.0.attn2.to_k.weight"
_MARK_XL_BASE = "conditioner.embedders.1.model.transformer.resblocks.9.mlp.c_proj.bias"
_MARK_XL_REFINER = "conditioner.embedders.0.model.transformer.resblocks.9.mlp.c_proj.bias"
_MARK_SD3 = ("joint_blocks.0.context_block.adaLN_modulation.1.bias",
             "model.diffusion_model.joint_blocks.0.context_block.adaLN_modulation.1.bias")
_MARK_SD35_LARGE = ("joint_blocks.37.x_block.mlp.fc1.weight", "model.diffusion_model.joint_blocks.37.x_block.mlp.fc1.weight")
_SD3_GRIDS = {36864: "sd3", 147456: "sd35_medium"}  # pos_embed positions: 192x192 (SD3 medium), 384x384 (3.5 medium)


def _quick_sd3(t: Mapping[str, TensorInfo]) -> str | None:
    """diffusers' SD3 branches: 1536-wide blocks (adaLN 6 x 1536) told apart by the position grid, else a 38th
    block (3.5 large); "" when neither applies (not SD3), None for a width-1536 file of another grid."""
    if any(k in t and t[k].shape[-1:] == (9216,) for k in _MARK_SD3):
        pos = t.get("model.diffusion_model.pos_embed" if "model.diffusion_model.pos_embed" in t else "pos_embed")
        return _SD3_GRIDS.get(pos.shape[1]) if pos is not None and len(pos.shape) > 1 else None
    return "sd35_large" if any(k in t for k in _MARK_SD35_LARGE) else ""


_MARK_FLUX = ("double_blocks.0.img_attn.norm.key_norm.scale",
              "model.diffusion_model.double_blocks.0.img_attn.norm.key_norm.scale")
_MARK_FLUX_OTHERS = ("single_stream_modulation.lin.weight", "early_stream_modulations.image.lin.weight",
                     "distilled_guidance_layer.in_proj.bias")  # FLUX.2, its successor, Chroma: checked first
# A FLUX.1 transformer in diffusers' own key layout (a transformer-only file saved by diffusers/OneTrainer)
FLUX_DIFFUSERS_MARK = frozenset({"x_embedder.weight", "context_embedder.weight",
                                  "transformer_blocks.0.attn.norm_added_k.weight",
                                  "single_transformer_blocks.0.proj_mlp.weight"})


def _flux_variant(t: Mapping[str, Any], guidance: str, img_in: str) -> str:
    """diffusers' FLUX.1 branch: a guidance embedder is dev (fill and depth by img_in's width), else schnell."""
    if guidance not in t:
        return "flux-schnell"
    width: int = t[img_in].shape[1] if img_in in t and len(t[img_in].shape) > 1 else 0
    return {384: "flux-fill", 128: "flux-depth"}.get(width, "flux-dev")


def _quick_flux(t: Mapping[str, TensorInfo]) -> str | None:
    """The FLUX.1 family key of a file in BFL (bare or ``model.diffusion_model.``) or diffusers layout, "" when
    it is not FLUX.1, None for a FLUX.1 variant or relative dduf pack does not convert (fill, depth, FLUX.2)."""
    if any(k.endswith(_MARK_FLUX_OTHERS) for k in t):
        return None
    if FLUX_DIFFUSERS_MARK.issubset(t):
        found = _flux_variant(t, "time_text_embed.guidance_embedder.linear_1.bias", "x_embedder.weight")
        return found if found in FAMILIES else None
    for prefix in ("", "model.diffusion_model."):
        if prefix + _MARK_FLUX[0] in t:
            found = _flux_variant(t, prefix + "guidance_in.in_layer.bias", prefix + "img_in.weight")
            return found if found in FAMILIES else None
    return ""


def quick_architecture(header: SafetensorsHeader) -> str | None:
    """The family key of a checkpoint, by the same marker keys and shapes diffusers'
    ``infer_diffusers_model_type`` checks first, without importing torch or diffusers (``dduf info``);
    None for anything else (another architecture, for which ``dduf pack`` names diffusers' type).
    tests/test_single_file.py checks it agrees with diffusers on every fixture."""
    t = header.tensors
    if _MARK_INPAINT in t and len(t[_MARK_INPAINT].shape) > 1 and t[_MARK_INPAINT].shape[1] == 9:
        return None  # an inpainting UNet: not converted yet
    if _MARK_V2 in t and t[_MARK_V2].shape[-1:] == (1024,):
        found = "v2"
    elif "edm_mean" in t:
        return None
    elif _MARK_XL_BASE in t:
        found = "xl_base"
    elif _MARK_XL_REFINER in t:
        found = "xl_refiner"
    elif (sd3 := _quick_sd3(t)) != "":
        if sd3 is None:
            return None
        found = sd3
    elif (flux := _quick_flux(t)) != "":
        if flux is None:
            return None
        found = flux
    elif any(k.startswith(_FOREIGN_HINTS) for k in t):
        return None
    else:
        found = "v1"
    family = FAMILIES[found]
    return found if any(c.owns(k) for c in family.components.values() for k in t) else None


def family_for(model_type: str, where: str) -> Family:
    family = FAMILIES.get(model_type)
    if family is None:
        known = ", ".join(f"{f.name} ({k})" for k, f in FAMILIES.items())
        raise DDUFPackError(f"{where}: detected diffusers model type {model_type!r}, which dduf pack does not "
                            f"convert yet (supported: {known})")
    return family


def held_tensors(header: SafetensorsHeader, family: Family) -> dict[str, list[TensorInfo]]:
    """{component: its tensors in the checkpoint} for the components the file holds."""
    held: dict[str, list[TensorInfo]] = {}
    for name, comp in family.components.items():
        infos = [t for k, t in header.tensors.items() if comp.owns(k)]
        if infos:
            held[name] = infos
    return held


# Dtypes safetensors knows that no diffusers model takes as weights element by element: the packed sub-byte
# floats (torch's float4_e2m1fn_x2 holds two values per item, so the file's shape, counted in values, does not
# view; torch has no float6 at all) and the exponent-only MX scale format (scales, never weights: diffusers would
# load it into a float16 parameter as garbage). ``dduf pack --dtype`` leaves the same ones alone (CONVERTIBLE).
_UNCONVERTED_DTYPES = {"float8_e8m0fnu": "an exponent-only scale format (MX block scales), not weights"}
DTYPE_RULE = ("rule: single-file checkpoints are converted from whole-byte tensor dtypes (F16, BF16, F32, F64, "
              "F8_E4M3, F8_E5M2, integers); sub-byte and scale-only dtypes are quantized formats diffusers' "
              "single-file loader does not read")


def unconverted_dtype(info: TensorInfo) -> str | None:
    """Why a checkpoint tensor's dtype cannot be converted for a pack (see :data:`DTYPE_RULE`), or None."""
    bits = spec.DTYPE_BY_TORCH[info.dtype].bits
    if bits % 8:
        return f"packed {bits}-bit values (torch has no dtype that views them one value per element)"
    return _UNCONVERTED_DTYPES.get(info.dtype)


def unconverted_tensor(header: SafetensorsHeader, family: Family) -> str | None:
    """The first tensor a pack would convert whose dtype it cannot (tensor name, dtype, why and the rule)."""
    for infos in held_tensors(header, family).values():
        for t in infos:
            why = unconverted_dtype(t)
            if why is not None:
                code = spec.DTYPE_BY_TORCH[t.dtype].safetensors
                return f"{t.name} is {code} ({t.dtype}: {why}); {DTYPE_RULE}"
    return None


def shown_prefix(comp: Component, infos: list[TensorInfo]) -> str:
    """The component's key prefix, or for a Flux transformer (every key no other component owns) the one its
    keys share: ``model.diffusion_model.`` (ComfyUI) or none (BFL's and diffusers' transformer-only files)."""
    if comp.prefix:
        return comp.prefix
    return "model.diffusion_model." if all(t.name.startswith("model.diffusion_model.") for t in infos) else "(none)"


def describe_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """What ``dduf info CKPT.safetensors`` shows: the detected architecture and, per component the file
    holds, its dtypes, parameters and bytes. Reads the header only; imports neither torch nor diffusers.

    Raises:
        DDUFPackError: not a valid safetensors file (DDUFNotFoundError when missing).
    """
    header = read_checkpoint_header(path)
    info: dict[str, Any] = {"path": os.fspath(path), "kind": "single-file checkpoint",
                            "size": os.path.getsize(path), "tensors": len(header.tensors)}
    model_type = quick_architecture(header)
    if model_type is None:
        problem = (f"not an {' / '.join(f.name for f in FAMILIES.values())} checkpoint (unknown architecture, or "
                   "one dduf pack does not convert yet: dduf pack names what diffusers detects)")
        return {**info, "architecture": None, "family": None, "pipeline": None, "components": {}, "problem": problem}
    family = FAMILIES[model_type]
    info.update(architecture=model_type, family=family.name, pipeline=family.pipelines[0], components={})
    claimed = 0
    for name, infos in held_tensors(header, family).items():
        dtypes: dict[str, int] = {}
        params = 0
        for t in infos:
            dtypes[t.dtype] = dtypes.get(t.dtype, 0) + t.nbytes
            n = 1
            for d in t.shape:
                n *= d
            params += n
        claimed += len(infos)
        info["components"][name] = {
            "prefix": shown_prefix(family.components[name], infos), "tensors": len(infos), "parameters": params,
            "bytes": sum(dtypes.values()), "dtypes": dtypes, "dtype": max(dtypes, key=lambda d: dtypes[d])}
    info["other_tensors"] = len(header.tensors) - claimed
    info["absent"] = sorted(set(family.components) - set(info["components"]))
    unconverted = unconverted_tensor(header, family)
    if unconverted is not None:  # described, but a pack would refuse it: said instead of "pack it"
        info["problem"] = f"dduf pack would refuse it: {unconverted}"
    return info



_SCALED_FP8 = ("scaled_fp8", ".scale_weight", ".scale_input")  # ComfyUI's "fp8 scaled" files


def refuse_scaled_fp8(header: SafetensorsHeader, where: str) -> None:
    """A "scaled fp8" file stores each weight as fp8 times its ``*.scale_weight``; diffusers' ``from_single_file``
    (0.42) has no such rule: it would load the fp8 numbers unscaled, a silently wrong model. Refused; plain fp8
    storage (no scales) is converted like any dtype."""
    scaled = next((k for k in header.tensors if k == "scaled_fp8" or k.endswith(_SCALED_FP8[1:])), None)
    if scaled is not None:
        raise DDUFPackError(f"{where}: a scaled-fp8 checkpoint ({scaled!r}: each fp8 weight is to be multiplied by "
                            "its '.scale_weight'), which diffusers' single-file loader does not read (it would load "
                            "the weights unscaled): not converted (rule: fp8 single files pack only as plain fp8 "
                            "storage); use the file's bf16/fp16 release, or dequantize it first")

