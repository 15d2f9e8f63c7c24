"""The layout reader of the model-folder search (:mod:`dduf_plus.refs.model_dirs`): a component found in an app's
file in its original layout (an LDM UNet, OpenCLIP, SD3's MMDiT, BFL's Flux, transformers' CLIP and T5, an LDM
VAE), bare or as its part of a full checkpoint, with each of its diffusers tensors said as byte ranges of the
file (or a transposed 2-D tensor). Header only: nothing of the file's data is read here.

How: the part's tensors become meta tensors (nothing allocated) under the prefix diffusers' converter expects,
diffusers' own converter (the one ``from_single_file`` runs) names them as diffusers does, then
:func:`dduf_plus.format.original_layout.original_pieces` says how each original tensor is made from those
diffusers tensors (as it is, a 1x1 convolution, q/k/v concatenated, halves swapped, transposed), which is
inverted into ranges: every range is checked to lie inside the tensor it comes from. Cheap checks first (the
reference's config names the model class; a part's byte total must hold the reference's), so torch and
diffusers are imported only for a part that could fit; a converter's exception rejects the part with a reason.

:func:`install` registers the reader (called by the loading, packing and CLI entry points that search model
folders: refs/ imports no torch)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import DDUFError
from ..format import spec
from ..format.original_layout import Piece, original_pieces
from ..format.safetensors_header import SafetensorsHeader, TensorInfo
from ..refs import model_dirs
from ..refs.model_dirs import Part, Source
from .single_file_layout import FAMILIES

__all__ = ["install", "read_parts"]

# the model class a reference's config names -> the original layouts it may be in (format.original_layout.KINDS)
_BY_CLASS = {"UNet2DConditionModel": ("unet",), "AutoencoderKL": ("vae",), "CLIPTextModel": ("clip", "open_clip"),
             "CLIPTextModelWithProjection": ("clip", "open_clip"), "SD3Transformer2DModel": ("sd3_transformer",),
             "FluxTransformer2DModel": ("flux",), "T5EncoderModel": ("t5",)}
# the key prefix diffusers' converter for a kind strips (a part under another prefix, or bare, is put under it)
_CANONICAL = {"unet": "model.diffusion_model.", "vae": "first_stage_model.", "clip": "cond_stage_model.transformer.",
              "open_clip": "cond_stage_model.model.", "t5": "text_encoders.t5xxl.transformer.",
              "sd3_transformer": "model.diffusion_model.", "flux": "model.diffusion_model."}
_ALIAS = {"sd3_clip_l": "clip", "sd3_clip_g": "clip"}  # SD3's CLIPs are transformers' layout under their prefix
_NAMES = {"unet": "LDM UNet", "vae": "LDM VAE", "clip": "CLIP", "open_clip": "OpenCLIP text encoder", "t5": "T5",
          "sd3_transformer": "MMDiT transformer", "flux": "BFL Flux transformer"}
# a key (after the part's prefix) that a part of each kind has: a part without one is not tried (nothing said)
_MARKERS = {"unet": ("input_blocks.",), "vae": ("encoder.down.",), "clip": ("text_model.", "encoder.layers."),
            "open_clip": ("transformer.resblocks.",), "t5": ("encoder.block.",),
            "sd3_transformer": ("joint_blocks.",), "flux": ("double_blocks.",)}
_KNOWN = tuple(sorted({c.prefix for f in FAMILIES.values() for c in f.components.values() if c.prefix}))
# the most keys a part is converted with, whatever the (untrusted) reference's count says: the converters' work
# grows with keys x blocks (8,000 empty input_blocks.N keys: 30 s); SDXL's LDM UNet, the largest part read, has 1,680
_MAX_KEYS = 4096
_STRAY_SLACK = 16 << 20  # a part may hold this + 1/16 more than the reference (position ids, SD 2's last layer)


def install() -> None:
    """Let the model-folder search read original layouts (idempotent)."""
    model_dirs.add_layout_reader(read_parts)


def _prefixes(kind: str) -> list[str]:
    """Where a component of ``kind`` lies in the files apps keep: its prefix in each full-checkpoint family,
    then bare (a component file: ``models/unet``, ``models/diffusion_models``, ``models/text_encoders``)."""
    out = [c.prefix for f in FAMILIES.values() for c in f.components.values()
           if _ALIAS.get(c.kind, c.kind) == kind and c.prefix]
    out += ["model.diffusion_model."] if kind == "flux" else []
    return list(dict.fromkeys([*out, ""]))


def _owned(header: SafetensorsHeader, prefix: str) -> dict[str, TensorInfo]:
    """The tensors under ``prefix``; bare: every tensor under none of the families' prefixes."""
    if prefix:
        return {k: t for k, t in header.tensors.items() if k.startswith(prefix)}
    return {k: t for k, t in header.tensors.items() if not k.startswith(_KNOWN)}


def read_parts(header: SafetensorsHeader, config: Mapping[str, Any], count: int, nbytes: int) -> Iterator[Part | str]:
    """The parts of a file that may be the referenced component (config ``config``, ``count`` tensors of
    ``nbytes`` bytes in all), as :class:`~dduf_plus.refs.model_dirs.Part`, or why one that could fit does not map."""
    for kind in _BY_CLASS.get(_class_of(config), ()):
        for prefix in _prefixes(kind):
            owned = _owned(header, prefix)
            total = sum(t.nbytes for t in owned.values())
            marked = any(k.startswith(_MARKERS[kind], len(prefix)) for k in owned)
            if not marked or not nbytes <= total <= nbytes + nbytes // 16 + _STRAY_SLACK:
                continue  # plainly not it (nothing said, nothing imported)
            where = _NAMES[kind] + (f" under {prefix}" if prefix else "")
            cap = min(2 * count + 64, _MAX_KEYS)  # diffusers' converters scan every key once per block
            if len(owned) > cap:
                yield f"{where}: {len(owned)} tensors, more than {cap} (twice the reference's {count}, + 64; at most {_MAX_KEYS})"
                continue
            yield from _parts(kind, prefix, owned, header.data_start, config, where)


def _class_of(config: Mapping[str, Any]) -> str:
    """The model class a config names: diffusers' ``_class_name``, transformers' first ``architectures`` (the
    config text comes from an untrusted archive: anything else names none)."""
    name = config.get("_class_name")
    arch = config.get("architectures")
    if not isinstance(name, str) and isinstance(arch, list) and arch:
        name = arch[0]
    return name if isinstance(name, str) else ""


def _parts(kind: str, prefix: str, owned: dict[str, TensorInfo], data_start: int, config: Mapping[str, Any],
           where: str) -> Iterator[Part | str]:
    canon = _CANONICAL[kind]
    if kind == "open_clip" and _class_of(config) == "CLIPTextModelWithProjection":
        canon = "conditioner.embedders.1.model."  # SDXL's: diffusers ignores SD 2's projection, not this one
    back = {canon + k[len(prefix):]: k for k in owned}
    try:
        converted = _converted(kind, canon, {c: owned[k] for c, k in back.items()}, config)
    except DDUFError as e:
        yield f"{where}: {str(e).splitlines()[0]}"
        return
    except Exception as e:  # diffusers' converter on keys or shapes it does not expect (a hostile file)
        yield f"{where}: diffusers' converter refused it ({type(e).__name__}: {str(e)[:200]})"
        return
    why = ""
    for variant, shapes in _variants(kind, converted):
        try:
            pieces = original_pieces(kind, shapes, config)
        except (DDUFError, KeyError, IndexError, ValueError) as e:
            why = why or f"{where}: {e}"
            continue
        sources = _sources(pieces, {n: owned.get(back.get(canon + n, ""), None) for n in (p.name for p in pieces)},
                           shapes)
        if isinstance(sources, str):
            why = why or f"{where}: {sources}"
            continue
        yield Part(where + variant, data_start, sources)
    if why:
        yield why


def _converted(kind: str, canon: str, infos: dict[str, TensorInfo], config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """{diffusers name: shape} of the part, by diffusers' converter on meta tensors (nothing allocated)."""
    import torch

    from .single_file_convert import convert_component

    views = {k: torch.empty(t.shape, dtype=getattr(torch, t.dtype), device="meta") for k, t in infos.items()}
    base_keys = {"text_model.embeddings.token_embedding.weight"} if kind in ("clip", "open_clip") else set()
    out = convert_component(kind, canon, dict(views), config, base_keys)
    # strays: what a converter leaves unconverted (Flux's, with or without the prefix it strips itself) or
    # makes that no model holds (position ids)
    return {k: tuple(v.shape) for k, v in out.items() if not (kind == "flux" and (k in infos or canon + k in infos))
            and not k.endswith("position_ids")}


def _variants(kind: str, shapes: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, dict[str, tuple[int, ...]]]]:
    """The converted names as the reference may have them: a CLIP with or without ``text_model.`` (transformers
    >= 5.6 saves without) and with or without a projection (SD 2's OpenCLIP has one CLIPTextModel drops)."""
    yield "", shapes
    if kind not in ("clip", "open_clip"):
        return
    flat = {k.removeprefix("text_model."): s for k, s in shapes.items()}
    yield " (no text_model. prefix)", flat
    if "text_projection.weight" in shapes:
        for label, named in (("", shapes), (" (no text_model. prefix)", flat)):
            yield label + " (its projection unused)", {k: s for k, s in named.items() if k != "text_projection.weight"}


def _itemsize(dtype: str) -> int:
    bits = spec.DTYPE_BY_TORCH[dtype].bits
    if bits % 8:
        raise ValueError(f"{dtype}: packed sub-byte values")
    return bits // 8


def _sources(pieces: list[Piece], found: Mapping[str, TensorInfo | None],
             shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Source] | str:
    """Each diffusers tensor as ranges of the file, inverted from how each original tensor is made of them;
    or why the file does not hold exactly the original tensors the pieces name."""
    out: dict[str, Source] = {}
    for p in pieces:
        t = found.get(p.name)
        if t is None or tuple(t.shape) != tuple(p.shape):
            return f"{p.name} is {'missing' if t is None else list(t.shape)} (the layout needs {list(p.shape)})"
        try:
            made = _invert(p, t, shapes)
        except ValueError as e:
            return f"{p.name}: {e}"
        for name, src in made.items():
            if name in out:
                return f"{name} is made twice"
            out[name] = src
    missing = sorted(set(shapes) - set(out))
    if missing:  # made by the conversion (SD3's CLIP-L projection): not in the file
        return f"{missing[0]} is not in the file (diffusers makes it)"
    return out


def _invert(p: Piece, t: TensorInfo, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Source]:
    """The diffusers tensors of one original tensor ``t`` made by ``p``: ranges inside ``t``'s own bytes."""
    size = _itemsize(t.dtype)

    def info(name: str) -> TensorInfo:
        n = size
        for d in shapes[name]:
            n *= d
        return TensorInfo(name, t.dtype, tuple(shapes[name]), 0, n)

    if p.op in ("copy", "conv1x1", "swap", "T"):
        (src,) = p.sources
        i = info(src)
        if i.nbytes != t.nbytes:
            raise ValueError(f"{t.nbytes} bytes for {src}'s {i.nbytes}")
        if p.op == "swap":  # the two halves of dim 0, exchanged (an involution: the inverse is itself)
            if not t.shape or t.shape[0] % 2:
                raise ValueError("an odd first dimension cannot be halved")
            half = t.nbytes // 2
            return {src: Source(i, ((t.begin + half, t.end), (t.begin, t.begin + half)))}
        if p.op == "T":
            if len(t.shape) != 2:
                raise ValueError("a transpose of a tensor that is not 2-D")
            return {src: Source(i, ((t.begin, t.end),), rows=t.shape[0])}
        return {src: Source(i, ((t.begin, t.end),))}
    if p.op != "cat":
        raise ValueError(f"unknown op {p.op}")
    out, pos = {}, t.begin
    for src in p.sources:  # concatenated along dim 0: each source is a run of whole rows
        i = info(src)
        if tuple(shapes[src][1:]) != tuple(t.shape[1:]):
            raise ValueError(f"{src} is {list(shapes[src])}, not rows of {list(t.shape)}")
        out[src] = Source(i, ((pos, pos + i.nbytes),))
        pos += i.nbytes
    if pos != t.end:
        raise ValueError(f"its parts make {pos - t.begin} bytes of its {t.nbytes}")
    return out
