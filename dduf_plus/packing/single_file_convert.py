"""Converting one component of a single-file checkpoint to diffusers' layout with diffusers' own mapping
functions (the ones ``from_single_file`` uses), from zero-copy views of the mapped file; checked first on the
header's shapes alone (meta tensors, nothing allocated) against BASE; compared with BASE tensor by tensor; and
streamed as a safetensors file laid out as ``dduf pack --dtype`` lays files out."""

from __future__ import annotations

import mmap
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

from ..errors import DDUFError, DDUFPackError
from ..format.safetensors_header import SafetensorsHeader, TensorInfo, parse_header
from .mapped_views import Dropper, bytes_of, mapped, view
from .single_file_base import Base, BaseTensors, base_tensors, base_variants
from .single_file_layout import FLUX_DIFFUSERS_MARK, Component

__all__ = ["Job", "check_declared", "component_chunks", "component_views", "convert_component",
           "converted_or_refused", "converted_tensors", "file_header", "fit", "identical", "identical_variant"]


class Job(NamedTuple):
    """Everything needed to convert one component again while the archive is written."""

    checkpoint: Path
    header: SafetensorsHeader
    name: str
    component: Component
    config: dict[str, Any]
    base_keys: set[str]



def component_views(job: Job, mm: mmap.mmap | None) -> dict[str, Any]:
    """The component's checkpoint tensors as views of ``mm`` (its keys in the checkpoint's layout)."""
    return {k: view(mm, job.header.data_start, t) for k, t in job.header.tensors.items() if job.component.owns(k)}


def convert_component(kind: str, prefix: str, views: dict[str, Any], config: Mapping[str, Any],
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
    if FLUX_DIFFUSERS_MARK.issubset(views):
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


def converted_or_refused(job: Job, views: dict[str, Any], where: str) -> dict[str, Any]:
    """:func:`convert_component` of ``views``; what diffusers' converter raises on keys it does not expect is refused."""
    try:
        return convert_component(job.component.kind, job.component.prefix, views, job.config, job.base_keys)
    except DDUFError:
        raise
    except Exception as e:  # diffusers' converter on keys or shapes it does not expect
        raise DDUFPackError(f"{where}: {job.name} cannot be converted to diffusers' layout "
                            f"({type(e).__name__}: {e})") from None


def check_declared(job: Job, base: BaseTensors, where: str) -> int:
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
    converted = converted_or_refused(job, dict(declared), where)

    def source(t: Any) -> str | None:  # the checkpoint tensor an output is (a view of), when it is one
        return origin.get(id(t)) or origin.get(id(t._base))

    fresh = {k: t.numel() * t.element_size() for k, t in converted.items() if source(t) is None}
    named = {k: _from_checkpoint(source(t), job.header) for k, t in converted.items()}
    fit(job.name, converted, base, where, named)
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


def fit(name: str, converted: dict[str, Any], base: BaseTensors, where: str,
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


def identical(converted: Mapping[str, Any], base: BaseTensors, mine_map: mmap.mmap | None = None) -> str | None:
    """None when every converted tensor equals BASE's (dtype and bytes), else the first difference."""
    import torch

    for k in sorted(converted):
        if str(converted[k].dtype).removeprefix("torch.") != base.tensors[k][2].dtype:
            return f"{k} is {str(converted[k].dtype).removeprefix('torch.')} here, {base.tensors[k][2].dtype} in BASE"
    by_file: dict[Path, list[str]] = {}
    for k in sorted(converted):
        by_file.setdefault(base.tensors[k][0], []).append(k)
    for path, names in sorted(by_file.items()):
        with mapped(path) as mm:
            dropper = Dropper(mm, mine_map)
            for k in names:
                _p, start, info = base.tensors[k]
                theirs = view(mm, start, info)
                mine = converted[k]
                same = torch.equal(bytes_of(mine), bytes_of(theirs))
                del theirs
                dropper.read(2 * info.nbytes)
                if not same:
                    return f"{k} differs"
    return None


def identical_variant(name: str, converted: Mapping[str, Any], base: Base, mine_map: mmap.mmap | None) -> str | None:
    """The first of BASE's weight variants of ``name`` whose tensors ``converted`` equals, or None."""
    for variant in base_variants(base, name):
        theirs = base_tensors(base, name, variant)
        fits = theirs.tensors.keys() == converted.keys() and all(
            tuple(converted[k].shape) == theirs.tensors[k][2].shape for k in converted)
        if fits and identical(converted, theirs, mine_map) is None:
            return variant
    return None


def file_header(converted: Mapping[str, Any], entry: str) -> tuple[bytes, SafetensorsHeader, list[Any], int]:
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


def converted_tensors(job: Job, mm: mmap.mmap | None) -> dict[str, Any]:
    """The component converted (views of ``mm``), with the tensors BASE has no place for dropped."""
    views = component_views(job, mm)
    out = convert_component(job.component.kind, job.component.prefix, views, job.config, job.base_keys)
    return {k: v for k, v in out.items() if k in job.base_keys}


def component_chunks(job: Job, head: bytes, planned: list[Any]) -> Iterator[Any]:
    """The component's file: header, then each tensor's bytes straight from the checkpoint's map
    (q/k/v of an OpenCLIP encoder are split copies, made once per pass, one component at a time)."""
    yield head
    with mapped(job.checkpoint) as mm:
        converted = converted_tensors(job, mm)
        dropper = Dropper(mm)
        try:
            for p in planned:
                data = bytes_of(converted[p.info.name])
                if data.numel() != p.end - p.begin:  # pragma: no cover - the file changed under us
                    raise DDUFPackError(f"{job.checkpoint}: {p.info.name} changed while packing")
                yield data.numpy()
                del data
                dropper.read(p.end - p.begin)
        finally:
            converted.clear()

