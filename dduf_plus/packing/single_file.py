"""Single-file checkpoints in: ``pack(CKPT.safetensors, OUT, base=BASE)``.

A single-file checkpoint (A1111 / LDM / SGM key layout: ``model.diffusion_model.*``, ``first_stage_model.*``,
``cond_stage_model.*`` / ``conditioner.embedders.N.*``) becomes a partial archive against BASE, a diffusers
pipeline folder or a Hub repo (offline from the cache): the architecture is detected from the keys with
diffusers' single-file machinery (``infer_diffusers_model_type``), each component the file holds is converted
to diffusers' layout with diffusers' own mapping functions, one component at a time, from zero-copy views of
the memory-mapped file; a converted component whose tensors are identical to BASE's (names, dtypes, shapes,
bytes) becomes a content-verified reference to BASE, as do the components the file does not hold (and the
tokenizers and scheduler); only what differs is stored, written deterministically and streamed.

The file is untrusted: its header is parsed with the format layer's budgets before any byte is mapped."""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

from ..errors import DDUFError, DDUFNotFoundError, DDUFPackError
from ..format import spec
from ..format.json_budget import read_json
from ..format.pack import EntrySource, FolderPlan, PackResult, write_archive
from ..format.safetensors_header import SafetensorsHeader, TensorInfo, parse_header, read_file_header
from ..format.structure import component_specs, model_index_object
from ..format.weights import classify, select_weights, variants

logger = logging.getLogger(__name__)

__all__ = ["FAMILIES", "describe_checkpoint", "detect_architecture", "is_single_file", "pack_single_file",
           "plan_single_file"]


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
    if _FLUX_DIFFUSERS_MARK.issubset(keys):  # diffusers' own keys: from_single_file is given the config, no detection
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
_FLUX_DIFFUSERS_MARK = frozenset({"x_embedder.weight", "context_embedder.weight",
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
    if _FLUX_DIFFUSERS_MARK.issubset(t):
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


def _family(model_type: str, where: str) -> Family:
    family = FAMILIES.get(model_type)
    if family is None:
        known = ", ".join(f"{f.name} ({k})" for k, f in FAMILIES.items())
        raise DDUFPackError(f"{where}: detected diffusers model type {model_type!r}, which dduf pack does not "
                            f"convert yet (supported: {known})")
    return family


def _held(header: SafetensorsHeader, family: Family) -> dict[str, list[TensorInfo]]:
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
    for infos in _held(header, family).values():
        for t in infos:
            why = unconverted_dtype(t)
            if why is not None:
                code = spec.DTYPE_BY_TORCH[t.dtype].safetensors
                return f"{t.name} is {code} ({t.dtype}: {why}); {DTYPE_RULE}"
    return None


def _shown_prefix(comp: Component, infos: list[TensorInfo]) -> str:
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
    for name, infos in _held(header, family).items():
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
            "prefix": _shown_prefix(family.components[name], infos), "tensors": len(infos), "parameters": params,
            "bytes": sum(dtypes.values()), "dtypes": dtypes, "dtype": max(dtypes, key=lambda d: dtypes[d])}
    info["other_tensors"] = len(header.tensors) - claimed
    info["absent"] = sorted(set(family.components) - set(info["components"]))
    unconverted = unconverted_tensor(header, family)
    if unconverted is not None:  # described, but a pack would refuse it: said instead of "pack it"
        info["problem"] = f"dduf pack would refuse it: {unconverted}"
    return info


# --- BASE --------------------------------------------------------------------------------------------------
class _Base(NamedTuple):
    folder: Path  # a local folder holding BASE's files (the folder, or its Hugging Face cache snapshot), or the .dduf
    spec: str  # what the references name: the folder, the repo id[@revision], the archive
    model_index: dict[str, Any]
    model_index_bytes: bytes
    archive: Any = None  # an open DDUFArchive when BASE is a .dduf
    hosted: bool = False  # BASE is a hosted .dduf (a URL): configs and headers by range reads, weights not compared

    def files(self, name: str) -> list[str]:
        """The file names of BASE's component folder ``name``."""
        if self.archive is not None:
            comps = self.archive.components
            return sorted(comps[name].files) if name in comps else []
        return _listing(self.folder / name)

    def read(self, name: str, filename: str) -> bytes:
        if self.archive is not None:
            return bytes(self.archive.read_bytes(f"{name}/{filename}"))
        return (self.folder / name / filename).read_bytes()


def _open_base(base: str, token: str | bool | None, local_files_only: bool) -> _Base:
    from ..refs.resolve import parse_spec

    try:
        kind = parse_spec(base).kind
    except DDUFError as e:
        raise DDUFPackError(f"--base {base!r}: {e}") from None
    if kind == "url":
        from ..remote.hub import _env_offline

        if _env_offline(local_files_only):  # as hosted references are never fetched then
            raise DDUFPackError(f"--base {base}: a hosted archive is read over the network, which HF_HUB_OFFLINE / "
                                "local_files_only forbids; give a local copy of it")
    if kind in ("dduf", "url"):
        return _open_base_archive(base, token if kind == "url" else None)
    if kind == "folder":
        folder = Path(base)
        if not folder.is_dir():
            raise DDUFNotFoundError(f"--base {base!r}: {folder} does not exist", str(folder))
    else:
        folder = _hub_base_folder(base, token, local_files_only)
    mi_path = folder / spec.MODEL_INDEX
    if not mi_path.is_file():
        raise DDUFPackError(f"--base {base!r}: {folder} has no model_index.json (BASE is a diffusers pipeline)")
    raw = mi_path.read_bytes()
    return _Base(folder, base, model_index_object(raw, str(mi_path), DDUFPackError), raw)


def _open_base_archive(base: str, token: str | bool | None = None) -> _Base:
    """BASE as a local ``.dduf`` or a hosted one (a URL: its directory, index and the JSON entries read by range
    requests, with the storage layer's budgets): opened with the strict reader (refused if ``dduf validate``
    would refuse it)."""
    from ..format.archive import DDUFArchive
    from ..storage.urls import is_url

    hosted = is_url(base)
    if not hosted and not os.path.isfile(base):
        raise DDUFNotFoundError(f"--base {base!r}: {base} does not exist", base)
    options: dict[str, Any] = {"token": token} if token not in (None, False) and base.startswith("hf://") else {}
    archive = DDUFArchive(base, **options)
    if archive.references:
        archive.close()
        raise DDUFPackError(f"--base {base}: a partial archive (it references components elsewhere); use a "
                            "complete one (dduf complete) or the folder or repo it references")
    raw = bytes(archive.read_bytes(spec.MODEL_INDEX))
    return _Base(Path(base), base, model_index_object(raw, f"{base}:{spec.MODEL_INDEX}", DDUFPackError), raw, archive,
                 hosted)


open_base = _open_base  # BASE for other packers (LoRA archives): a folder, snapshot or archive


def _hub_base_folder(base: str, token: str | bool | None, local_files_only: bool) -> Path:
    """BASE ``org/repo[@revision]``: its snapshot in the Hugging Face cache (the one the references are checked
    against, as ``dduf pack --base`` reads it), else what ``dduf pack org/repo`` would download."""
    from ..refs import cache as _cache
    from ..remote.hub import split_revision
    from .pack import pack_source

    repo, revision = split_revision(base)
    for cache in _cache.hf_cache_dirs(None):
        snap = _cache.snapshot_dir(cache, repo, revision)
        if snap is not None and (snap / spec.MODEL_INDEX).is_file():
            return snap
    return Path(pack_source(base, token=token, local_files_only=local_files_only, quiet=True))


def _check_base(family: Family, model_type: str, base: _Base, where: str) -> None:
    """Refuse a BASE of another pipeline family (an SDXL checkpoint against an SD 1.5 base)."""
    cls = base.model_index.get("_class_name")
    if cls not in family.pipelines:
        others = [f.name for f in FAMILIES.values() if cls in f.pipelines]
        hint = f" (a pipeline for {' / '.join(others)} checkpoints)" if others else ""
        raise DDUFPackError(f"{where} is an {family.name} checkpoint ({model_type}, detected from its keys) but "
                            f"--base {base.spec} is a {cls}{hint}: use a {family.name} base "
                            f"({' or '.join(family.pipelines)})")
    specs = component_specs(base.model_index)
    missing = [n for n in family.components if specs.get(n, (None, None))[0] is None]
    if missing:
        raise DDUFPackError(f"--base {base.spec}: its model_index.json has no {', '.join(missing)}, which a "
                            f"{family.name} pipeline needs")


class _BaseTensors(NamedTuple):
    tensors: dict[str, tuple[Path, int, TensorInfo]]  # name -> (file, data start, info)
    files: list[str]


def _base_variants(base: _Base, name: str) -> list[str]:
    """The weight variants (``fp16``...) BASE's component ``name`` has files of."""
    return sorted(variants(base.files(name)))


def _listing(folder: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(folder) if e.is_file()) if folder.is_dir() else []


def _base_tensors(base: _Base, name: str, variant: str | None = None) -> _BaseTensors:
    """BASE's weights of component ``name`` (the default ones, or ``variant``'s; every shard), from the headers."""
    folder = base.folder / name
    chosen = select_weights(base.files(name), variant)
    weights = [f for f in chosen if f.endswith(".safetensors")  # variant None: a BASE of variant files only too
               and (variant is None or ((w := classify(f)) is not None and w.variant == variant))]
    if not weights:
        where = "" if Path(base.spec) == base.folder else f" (the copy in {base.folder}: download it first)"
        raise DDUFPackError(f"--base {base.spec}: {name}/ holds no safetensors weights to compare with{where}")
    out: dict[str, tuple[Path, int, TensorInfo]] = {}
    for f in weights:
        if base.archive is not None:  # the whole archive is mapped; tensors at the entry's offset
            entry = base.archive.entry(f"{name}/{f}")
            header = base.archive.headers[f"{name}/{f}"]
            path, start = base.folder, entry.offset + header.data_start
        else:
            header = read_file_header(folder / f, f"{name}/{f}", DDUFPackError)
            path, start = folder / f, header.data_start
        for t in header.tensors.values():
            out[t.name] = (path, start, t)
    return _BaseTensors(out, weights)


# --- converting one component --------------------------------------------------------------------------------
@contextmanager
def _mapped(path: Path) -> Iterator[mmap.mmap | None]:
    """A private (copy-on-write) map of ``path``: writable for ``torch.frombuffer``, never written."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        try:
            yield mm
        finally:
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a consumer kept a view: the map goes with it
                    pass


_DROP_EVERY = 64 << 20  # bytes read through a map between two page drops


class _Dropper:
    """Drops the pages read so far from this process every :data:`_DROP_EVERY` bytes (``MADV_DONTNEED``;
    the maps are private and never written, so a page read again comes back from the file): RSS stays
    about one slice, not the whole checkpoint, as ``dduf pack --dtype`` does."""

    def __init__(self, *maps: mmap.mmap | None):
        self.maps = [m for m in maps if m is not None]
        self.pending = 0

    def read(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending < _DROP_EVERY:
            return
        self.pending = 0
        for m in self.maps:
            if hasattr(m, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                m.madvise(mmap.MADV_DONTNEED)


def _view(mm: mmap.mmap | None, data_start: int, info: TensorInfo) -> Any:
    """A torch tensor viewing ``info``'s bytes in the map (copied only when a foreign writer misaligned it)."""
    import torch

    dtype = getattr(torch, info.dtype)
    width = torch.empty((), dtype=dtype).element_size()
    offset, count = data_start + info.begin, info.nbytes // width
    if mm is None or count == 0:
        return torch.empty(info.shape, dtype=dtype)
    if offset % width:
        flat = torch.frombuffer(bytearray(mm[offset:offset + info.nbytes]), dtype=dtype)
    else:
        flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=offset)
    return flat.view(info.shape)


def _convert(kind: str, prefix: str, views: dict[str, Any], config: Mapping[str, Any],
             base_keys: set[str]) -> dict[str, Any]:
    """The component's tensors in diffusers' layout, by diffusers' own mapping functions (the ones
    ``from_single_file`` uses for this component), from ``views`` (the component's checkpoint keys)."""
    from diffusers.loaders import single_file_utils as sfu

    if kind == "unet":
        out = sfu.convert_ldm_unet_checkpoint(views, dict(config))
    elif kind == "vae":
        out = sfu.convert_ldm_vae_checkpoint(views, dict(config))
    elif kind == "clip":  # (the prefix: Flux's text_encoders.clip_l.transformer., not in diffusers' LDM list)
        out = sfu.convert_ldm_clip_checkpoint(views, prefix)
    elif kind == "flux":
        out = _convert_flux(views, config, base_keys)
    elif kind in _SD3_KINDS:
        out = _convert_sd3(kind, prefix, views)
    else:  # OpenCLIP: q/k/v are split out of in_proj (copies), text_projection transposed (a copy)
        model = SimpleNamespace(config=SimpleNamespace(hidden_size=config.get("hidden_size")))
        out = sfu.convert_open_clip_checkpoint(model, views, prefix=prefix)
    if kind in ("clip", "open_clip", "sd3_clip_l", "sd3_clip_g") and not any(k.startswith("text_model.") for k in base_keys):
        # transformers >= 5.6 flattened CLIPTextModel: no text_model. prefix (diffusers strips it the same way)
        out = {k.removeprefix("text_model."): v for k, v in out.items()}
    return dict(out)


def _convert_flux(views: dict[str, Any], config: Mapping[str, Any], base_keys: set[str]) -> dict[str, Any]:
    """A FLUX.1 transformer as ``FluxTransformer2DModel.from_single_file`` converts it: passed through when its
    keys are exactly the model's (diffusers' own layout), else BFL's (bare or under ``model.diffusion_model.``)
    by diffusers' converter, which splits the fused q/k/v and single-block ``linear1`` (copies: diffusers
    concatenates each chunk) and swaps the final adaLN's halves (a copy). Keys the converter leaves (strays
    diffusers ignores) are returned too, for the caller to drop and say."""
    from diffusers.loaders import single_file_utils as sfu

    guided = any("guidance" in k for k in views)  # diffusers' own test for a dev (guidance-distilled) transformer
    if guided != bool(config.get("guidance_embeds")):
        have, want = ("dev", "schnell") if guided else ("schnell", "dev")
        raise DDUFPackError(f"transformer: a FLUX.1 {have} transformer ({'a' if guided else 'no'} guidance "
                            f"embedder) but --base's transformer is FLUX.1 {want}'s (guidance_embeds "
                            f"{str(not guided).lower()}): use a FLUX.1 {have} base")
    if set(views) == base_keys:
        return dict(views)
    if _FLUX_DIFFUSERS_MARK.issubset(views):
        extra, missing = sorted(set(views) - base_keys), sorted(base_keys - set(views))
        raise DDUFPackError(f"transformer: in diffusers' key layout, but its keys are not exactly --base's "
                            f"transformer's (from_single_file would not load it either): {len(extra)} extra "
                            f"({', '.join(extra[:2]) or 'none'}), {len(missing)} missing ({', '.join(missing[:2]) or 'none'})")
    left = dict(views)  # diffusers' converter pops what it converts
    out = dict(sfu.convert_flux_transformer_checkpoint_to_diffusers(left))
    return {**left, **out}


_SD3_KINDS = ("sd3_transformer", "sd3_clip_l", "sd3_clip_g", "t5")


def _convert_sd3(kind: str, prefix: str, views: dict[str, Any]) -> dict[str, Any]:
    """An SD3 file's component, as diffusers' ``from_single_file`` converts it (``create_diffusers_clip_model_
    from_ldm`` for the CLIPs, ``create_diffusers_t5_model_from_checkpoint`` for T5)."""
    from diffusers.loaders import single_file_utils as sfu

    if kind == "sd3_transformer":  # q/k/v split out of the fused qkv and the last adaLN's halves swapped (copies)
        return dict(sfu.convert_sd3_transformer_checkpoint_to_diffusers(views))
    if kind == "t5":
        return dict(sfu.convert_sd3_t5_checkpoint_to_diffusers(views))
    out = dict(sfu.convert_ldm_clip_checkpoint(views, prefix))
    if kind == "sd3_clip_l":  # SD3 has no CLIP-L projection: diffusers loads the identity, in the file's dtype
        import torch

        position = views[prefix + "text_model.embeddings.position_embedding.weight"]
        # sized by a header's number: made where the views are (on the meta device for the shape check first)
        out["text_projection.weight"] = torch.eye(position.shape[-1], device=position.device).to(position.dtype)
    return out


def _converted_or_refused(job: _Job, views: dict[str, Any], where: str) -> dict[str, Any]:
    """:func:`_convert` of ``views``; what diffusers' converter raises on keys it does not expect is refused."""
    try:
        return _convert(job.component.kind, job.component.prefix, views, job.config, job.base_keys)
    except DDUFError:
        raise
    except Exception as e:  # diffusers' converter on keys or shapes it does not expect
        raise DDUFPackError(f"{where}: {job.name} cannot be converted to diffusers' layout "
                            f"({type(e).__name__}: {e})") from None


def check_declared(job: _Job, base: _BaseTensors, where: str) -> int:
    """Run the conversion on the header's shapes alone (meta tensors: no byte is read or allocated) and check
    what it gives against BASE before the real conversion runs. Returns the bytes the real conversion will
    allocate (its outputs that are not views of the file); the bound this enforces is BASE's element count
    for the component times the checkpoint's widest element (at most 8 bytes): a header's numbers
    (``[0, 20000]`` for a position embedding, 284 bytes) never size an allocation BASE does not.

    Raises:
        DDUFPackError: a component of more than twice BASE's tensors (+ 64: the converters' work grows with
            keys x blocks), a converted tensor whose shape is not BASE's (naming it, the checkpoint tensor it
            comes from and its declared shape, and BASE's shape), one BASE's model needs and the file lacks, or
            a conversion that would allocate past the bound (tensors BASE has no place for).
    """
    owned = [t for k, t in job.header.tensors.items() if job.component.owns(k)]
    cap = 2 * len(base.tensors) + 64  # real files hold BASE's count, fewer (fused q/k/v) or a few more (position_ids)
    if len(owned) > cap:  # diffusers' LDM converters scan every key once per block: keys x blocks of work
        raise DDUFPackError(f"{where}: {job.name}: the checkpoint holds {len(owned)} tensors for it, more than "
                            f"{cap} (twice BASE's {len(base.tensors)}, + 64): not converted (e.g. {owned[-1].name})")
    declared = {t.name: _meta(t, where) for t in owned}
    origin = {id(v): k for k, v in declared.items()}
    converted = _converted_or_refused(job, dict(declared), where)

    def source(t: Any) -> str | None:  # the checkpoint tensor an output is (a view of), when it is one
        return origin.get(id(t)) or origin.get(id(t._base))

    fresh = {k: t.numel() * t.element_size() for k, t in converted.items() if source(t) is None}
    named = {k: _from_checkpoint(source(t), job.header) for k, t in converted.items()}
    _fit(job.name, converted, base, where, named)
    width = max((t.element_size() for t in declared.values()), default=1)
    bound = width * sum(_numel(info.shape) for _p, _s, info in base.tensors.values())
    if sum(fresh.values()) > bound:
        biggest = max(fresh, key=lambda k: fresh[k])
        raise DDUFPackError(f"{where}: {job.name}: converting it would allocate {sum(fresh.values())} bytes, more "
                            f"than BASE's {job.name} holds at this width ({bound}); largest: {biggest} "
                            f"({fresh[biggest]} bytes{named[biggest]}), a tensor BASE has no place for")
    return sum(fresh.values())


def _meta(info: TensorInfo, where: str) -> Any:
    """A meta tensor of ``info``'s declared shape and dtype (nothing allocated)."""
    import torch

    try:
        return torch.empty(info.shape, dtype=getattr(torch, info.dtype), device="meta")
    except RuntimeError as e:  # a 0 beside dimensions whose strides overflow int64: [0, 2**40, 2**40]
        raise DDUFPackError(f"{where}: {info.name} is declared {list(info.shape)}, a shape torch cannot represent "
                            f"({e})") from None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _from_checkpoint(key: str | None, header: SafetensorsHeader) -> str:
    """Where a converted tensor comes from, for messages: the checkpoint tensor and its declared shape."""
    if key is None:
        return " (made by the conversion from the header's shapes)"
    return f" (the checkpoint's {key}, declared {list(header.tensors[key].shape)})"


class _Converted(NamedTuple):
    header: SafetensorsHeader  # the file this component is written as
    identical: bool
    report: str


def _fit(name: str, converted: dict[str, Any], base: _BaseTensors, where: str,
         named: Mapping[str, str] | None = None) -> list[str]:
    """Check the converted tensors against BASE's (names and shapes); drop the ones BASE's model has no
    place for (``position_ids``, EMA leftovers), as ``from_single_file`` ignores them. Returns the dropped.
    ``named``: for messages, where each converted tensor comes from (see :func:`check_declared`).

    Raises:
        DDUFPackError: a shape does not fit BASE's config, or a tensor BASE's model needs is missing.
    """
    extra = sorted(k for k in converted if k not in base.tensors)
    for k in extra:
        del converted[k]
    for k, t in converted.items():  # shapes first: the refusal names the tensor, its shape and BASE's
        want = base.tensors[k][2].shape
        if tuple(t.shape) != tuple(want):
            raise DDUFPackError(f"{where}: {name} does not fit --base's {name} config: {k} is "
                                f"{list(t.shape)} in the checkpoint{(named or {}).get(k, '')}, {list(want)} in "
                                "BASE (another model size?)")
    missing = sorted(k for k in base.tensors if k not in converted)
    if missing:
        raise DDUFPackError(f"{where}: {name} does not fit --base's {name} config: {len(missing)} tensor(s) its "
                            f"model needs are not in the checkpoint (first: {missing[0]}, {list(base.tensors[missing[0]][2].shape)} "
                            "in BASE)")
    return extra


def _identical(converted: Mapping[str, Any], base: _BaseTensors, mine_map: mmap.mmap | None = None) -> str | None:
    """None when every converted tensor equals BASE's (dtype and bytes), else the first difference."""
    import torch

    for k in sorted(converted):
        if str(converted[k].dtype).removeprefix("torch.") != base.tensors[k][2].dtype:
            return f"{k} is {str(converted[k].dtype).removeprefix('torch.')} here, {base.tensors[k][2].dtype} in BASE"
    by_file: dict[Path, list[str]] = {}
    for k in sorted(converted):
        by_file.setdefault(base.tensors[k][0], []).append(k)
    for path, names in sorted(by_file.items()):
        with _mapped(path) as mm:
            dropper = _Dropper(mm, mine_map)
            for k in names:
                _p, start, info = base.tensors[k]
                theirs = _view(mm, start, info)
                mine = converted[k]
                same = torch.equal(_bytes_of(mine), _bytes_of(theirs))
                del theirs
                dropper.read(2 * info.nbytes)
                if not same:
                    return f"{k} differs"
    return None


def _identical_variant(name: str, converted: Mapping[str, Any], base: _Base, mine_map: mmap.mmap | None) -> str | None:
    """The first of BASE's weight variants of ``name`` whose tensors ``converted`` equals, or None."""
    for variant in _base_variants(base, name):
        theirs = _base_tensors(base, name, variant)
        fits = theirs.tensors.keys() == converted.keys() and all(
            tuple(converted[k].shape) == theirs.tensors[k][2].shape for k in converted)
        if fits and _identical(converted, theirs, mine_map) is None:
            return variant
    return None


def _bytes_of(t: Any) -> Any:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def _file_header(converted: Mapping[str, Any], entry: str) -> tuple[bytes, SafetensorsHeader, list[Any], int]:
    """(header bytes with length prefix, parsed header, placements, file size) of the file written for
    ``converted``, laid out as ``dduf pack --dtype`` lays out files (64-byte aligned tensors first)."""
    from .convert import plan_file

    infos, position = {}, 0
    for k in sorted(converted):
        t = converted[k]
        size = t.numel() * t.element_size()
        infos[k] = TensorInfo(k, str(t.dtype).removeprefix("torch."), tuple(t.shape), position, position + size)
        position += size
    virtual = SafetensorsHeader(0, infos, {"format": "pt"})
    raw, planned, size = plan_file(virtual, {})
    header, problems = parse_header(raw, len(raw), size, entry)
    if header is None or any(p.severity == "error" for p in problems):  # pragma: no cover - our own bug
        raise DDUFPackError(f"{entry}: converted header does not check: {problems}")
    return len(raw).to_bytes(8, "little") + raw, header, planned, size


class _Job(NamedTuple):
    """Everything needed to convert one component again while the archive is written."""

    checkpoint: Path
    header: SafetensorsHeader
    name: str
    component: Component
    config: dict[str, Any]
    base_keys: set[str]


def _converted_tensors(job: _Job, mm: mmap.mmap | None) -> dict[str, Any]:
    """The component converted (views of ``mm``), with the tensors BASE has no place for dropped."""
    views = {k: _view(mm, job.header.data_start, t) for k, t in job.header.tensors.items()
             if job.component.owns(k)}
    out = _convert(job.component.kind, job.component.prefix, views, job.config, job.base_keys)
    return {k: v for k, v in out.items() if k in job.base_keys}


def _chunks(job: _Job, head: bytes, planned: list[Any]) -> Iterator[Any]:
    """The component's file: header, then each tensor's bytes straight from the checkpoint's map
    (q/k/v of an OpenCLIP encoder are split copies, made once per pass, one component at a time)."""
    yield head
    with _mapped(job.checkpoint) as mm:
        converted = _converted_tensors(job, mm)
        dropper = _Dropper(mm)
        try:
            for p in planned:
                data = _bytes_of(converted[p.info.name])
                if data.numel() != p.end - p.begin:  # pragma: no cover - the file changed under us
                    raise DDUFPackError(f"{job.checkpoint}: {p.info.name} changed while packing")
                yield data.numpy()
                del data
                dropper.read(p.end - p.begin)
        finally:
            converted.clear()


_HOSTED = "not compared: BASE is hosted, comparing would download its weights"


def _weights_name(library: str | None) -> str:
    return "model.safetensors" if library == "transformers" else "diffusion_pytorch_model.safetensors"


def _component(job: _Job, base: _Base, base_tensors: _BaseTensors,
               where: str) -> tuple[list[EntrySource], str, str | None]:
    """Convert one component; its entry sources when it differs from BASE (none when identical), a line
    for the report and the BASE variant it is identical to (an fp16 checkpoint, BASE's fp16 files)."""
    check_declared(job, base_tensors, where)  # shapes against BASE's, conversion memory bounded: nothing allocated
    with _mapped(job.checkpoint) as mm:
        views = {k: _view(mm, job.header.data_start, t) for k, t in job.header.tensors.items()
                 if job.component.owns(k)}
        converted = _converted_or_refused(job, views, where)
        dropped = _fit(job.name, converted, base_tensors, where)
        why = _HOSTED if base.hosted else _identical(converted, base_tensors, mm)
        library = component_specs(base.model_index)[job.name][0]
        entry = f"{job.name}/{_weights_name(library)}"
        head, header, planned, size = _file_header(converted, entry)
        nbytes = sum(t.numel() * t.element_size() for t in converted.values())
        variant = _identical_variant(job.name, converted, base, mm) if why not in (None, _HOSTED) else None
        converted.clear()
        views.clear()
    note = f"; dropped {len(dropped)} tensor(s) BASE's model has no place for ({dropped[0]}...)" if dropped else ""
    if why is None or variant is not None:
        which = f"BASE's {variant} variant" if variant else "BASE's"
        return [], f"{job.name}: {len(header.tensors)} tensors identical to {which} -> referenced{note}", variant
    config = f"{job.name}/config.json"
    config_source = (EntrySource(config, data=base.read(job.name, "config.json")) if base.archive is not None
                     else EntrySource(config, path=base.folder / config))
    sources = [config_source,
               EntrySource(entry, size=size, chunks=lambda: _chunks(job, head, planned), header=header)]
    return sources, f"{job.name}: converted, {len(header.tensors)} tensors, {nbytes} bytes, stored ({why}){note}", None


def pack_single_file(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    base: str | os.PathLike | None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    quiet: bool = False,
    fsync: bool = True,
) -> tuple[PackResult, Any]:
    """Pack a single-file checkpoint as a partial archive against ``base``. Returns the result and the
    reference plan (``.report``: the architecture found, what was stored and referenced).

    Raises:
        DDUFPackError: no BASE, an unknown or unsupported architecture, a BASE of another family, a
            component that does not fit BASE's configs, a broken file; nothing is written then.
    """
    started = time.perf_counter()
    prepared = _prepare(checkpoint, base, token, local_files_only)
    try:
        return _write(prepared, output, token=token, local_files_only=local_files_only, quiet=quiet, fsync=fsync,
                      started=started)
    finally:
        if prepared.base.archive is not None:
            prepared.base.archive.close()


class _Prepared(NamedTuple):
    base: _Base
    sources: list[EntrySource]  # what differs from BASE: stored
    by_variant: dict[str, list[str]]  # components identical to one of BASE's variants
    report: list[str]
    where: str
    model_type: str


def _prepare(checkpoint: str | os.PathLike, base: str | os.PathLike | None, token: str | bool | None,
             local_files_only: bool) -> _Prepared:
    """Detect, check BASE, convert and compare every component the checkpoint holds (nothing written)."""
    path = Path(checkpoint)
    where = str(path)
    if not base:
        raise DDUFPackError(f"{where} is a single-file checkpoint: give --base BASE (a diffusers pipeline folder "
                            "or Hub repo of the same family) for its configs, tokenizers and scheduler")
    header = read_checkpoint_header(path)
    _refuse_scaled_fp8(header, where)
    model_type = detect_architecture(header, where)
    family = _family(model_type, where)
    unconverted = unconverted_tensor(header, family)
    if unconverted is not None:  # before BASE is opened or any tensor viewed
        raise DDUFPackError(f"{where}: {unconverted}")
    the_base = _open_base(os.fspath(base), token, local_files_only)
    _check_base(family, model_type, the_base, where)
    held = _held(header, family)
    if not held:  # e.g. an MMDiT's bare keys: diffusers detects them, its pipeline loader reads prefixed ones
        prefixes = ", ".join(sorted({c.prefix for c in family.components.values()}))
        raise DDUFPackError(f"{where}: detected {family.name} ({model_type}) but none of its keys is under a "
                            f"component's prefix of that layout ({prefixes})")
    absent = sorted(set(family.components) - set(held))
    report = [f"detected {family.name} ({model_type}) from the keys of {path.name}; it holds "
              f"{', '.join(held) or 'no component'}" + (f", not {', '.join(absent)}" if absent else "")]
    sources: list[EntrySource] = []
    by_variant: dict[str, list[str]] = {}
    for name in sorted(held):
        base_tensors = _base_tensors(the_base, name)
        config = _read_json(the_base, name)
        job = _Job(path, header, name, family.components[name], config, set(base_tensors.tensors))
        stored, line, variant = _component(job, the_base, base_tensors, where)
        sources.extend(stored)
        report.append(line)
        if variant is not None:
            by_variant.setdefault(variant, []).append(name)
    return _Prepared(the_base, sources, by_variant, report, where, model_type)


_SCALED_FP8 = ("scaled_fp8", ".scale_weight", ".scale_input")  # ComfyUI's "fp8 scaled" files


def _refuse_scaled_fp8(header: SafetensorsHeader, where: str) -> None:
    """A "scaled fp8" file stores each weight as fp8 times its ``*.scale_weight``; diffusers' ``from_single_file``
    (0.42) has no such rule: it would load the fp8 numbers unscaled, a silently wrong model. Refused; plain fp8
    storage (no scales) is converted like any dtype."""
    scaled = next((k for k in header.tensors if k == "scaled_fp8" or k.endswith(_SCALED_FP8[1:])), None)
    if scaled is not None:
        raise DDUFPackError(f"{where}: a scaled-fp8 checkpoint ({scaled!r}: each fp8 weight is to be multiplied by "
                            "its '.scale_weight'), which diffusers' single-file loader does not read (it would load "
                            "the weights unscaled): not converted (rule: fp8 single files pack only as plain fp8 "
                            "storage); use the file's bf16/fp16 release, or dequantize it first")


def plan_single_file(checkpoint: str | os.PathLike, base: str | os.PathLike, *, token: str | bool | None = None,
                     local_files_only: bool = False) -> dict[str, Any]:
    """What :func:`pack_single_file` would store and reference against ``base``, without writing anything
    (``dduf info CKPT.safetensors --base BASE``): {architecture, stored: {component: bytes}, referenced:
    {component: variant or None}, report}. Converts and compares like a pack (reads the tensors)."""
    prepared = _prepare(checkpoint, base, token, local_files_only)
    if prepared.base.archive is not None:
        prepared.base.archive.close()
    stored: dict[str, int] = {}
    for source in prepared.sources:
        name = source.name.split("/")[0]
        stored[name] = stored.get(name, 0) + source.nbytes
    in_variant = {n: v for v, names in prepared.by_variant.items() for n in names}
    real = [n for n, (lib, _c) in component_specs(prepared.base.model_index).items() if lib is not None]
    return {"architecture": prepared.model_type, "base": prepared.base.spec, "stored": stored,
            "referenced": {n: in_variant.get(n) for n in sorted(real) if n not in stored},
            "report": prepared.report}


def _read_json(base: _Base, name: str) -> dict[str, Any]:
    """BASE's ``name/config.json``."""
    try:
        value = read_json(base.read(name, "config.json"), f"{name}/config.json", where=f"--base {base.spec}")
    except (OSError, DDUFError) as e:
        raise DDUFPackError(f"--base {base.spec}: {name}/config.json cannot be read as JSON ({e})") from None
    if not isinstance(value, dict):
        raise DDUFPackError(f"--base {base.spec}: {name}/config.json is not a JSON object")
    return value


def _write(prepared: _Prepared, output: str | os.PathLike, *, token: str | bool | None, local_files_only: bool,
           quiet: bool, fsync: bool, started: float) -> tuple[PackResult, Any]:
    """Reference everything not stored to BASE (content-verified, as ``--base`` does) and write."""
    from .partial import _model_index_with, make_references

    sources, base, report, by_variant, where = (prepared.sources, prepared.base, prepared.report,
                                                prepared.by_variant, prepared.where)
    stored = {s.name.split("/")[0] for s in sources}
    if not stored:
        raise DDUFPackError(f"{where}: every component it holds is identical to --base {base.spec}: the archive "
                            "would hold no component (nothing to ship); load or share BASE itself")
    real = [n for n, (lib, _c) in component_specs(base.model_index).items() if lib is not None]
    plan = FolderPlan(base.model_index, base.model_index_bytes, sources, [], base.folder)
    in_variant = {n for names in by_variant.values() for n in names}
    partial = make_references(plan, exclude=sorted(set(real) - stored - in_variant), refs={"*": base.spec},
                              token=token, local_files_only=local_files_only)
    references, lines = dict(partial.references), list(partial.report)
    for variant, names in sorted(by_variant.items()):  # references that record BASE's variant files
        extra = make_references(plan, exclude=sorted(names), refs={"*": base.spec}, token=token,
                                local_files_only=local_files_only, variant=variant)
        references.update({n: extra.references[n] for n in names})
        lines[-1:-1] = [line for line in extra.report if line.startswith("referenced ")]
    model_index, raw = _model_index_with(plan, references)
    partial = partial._replace(report=report + lines, references=references, model_index=model_index,
                               model_index_bytes=raw)
    for line in partial.report:
        logger.info("%s", line)
    result = write_archive(output, partial.model_index, partial.model_index_bytes, partial.sources,
                           skipped=partial.skipped, references=partial.references or None, quiet=quiet, fsync=fsync)
    return result._replace(seconds=time.perf_counter() - started), partial
