"""Archives out: ``export_single_file(ARCHIVE, OUT.safetensors)`` / ``dduf export``.

The archive's pipeline is written in its family's original single-file layout (SD 1.x/2.x: LDM; SDXL: SGM; SD3 /
SD3.5: Stability's; Flux: ComfyUI's full file, the transformer in BFL's layout), or with ``component=`` one model
in the layout an app's folder for it expects (a bare LDM VAE for ``models/vae``, transformers' CLIP / T5 for
``models/text_encoders``, the UNet / MMDiT (under ``model.diffusion_model.``) or BFL's bare Flux transformer for
``models/diffusion_models``).

A partial archive exports complete: each reference is resolved and verified by the reference resolver. The
file is planned from headers alone (names, shapes, dtypes: :mod:`dduf_plus.format.original_layout`), then each
output tensor is made from zero-copy views of the mapped sources one at a time (a fused q/k/v is the only copy)
and written, pages dropped as it goes; the bytes are deterministic (tensors by element width then name, header
keys sorted), the write atomic, and ModelSpec metadata names the architecture so apps identify the file."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

from ..assignments import closest
from ..dtype_names import STORAGE_DTYPES, canonical
from ..errors import DDUFPackError, DDUFUsageError
from ..format import spec
from ..format.archive import DDUFArchive
from ..format.json_budget import read_json
from ..format.original_layout import Piece, original_pieces
from ..format.safetensors_header import TensorInfo, parse_header, read_file_header
from ..format.structure import component_specs
from ..format.weights import select_weights, tensor_files
from ..storage.confined import Confined
from ..storage.fd_io import kernel_copy, write_all
from ..storage.urls import is_url
from .mapped_views import Dropper, bytes_of, mapped, view
from .single_file_layout import FAMILIES, Component

logger = logging.getLogger(__name__)

__all__ = ["ARCHITECTURES", "ExportResult", "export_single_file", "export_family"]

# ModelSpec (https://github.com/Stability-AI/ModelSpec) architecture ids of the families dduf exports
ARCHITECTURES = {"v1": "stable-diffusion-v1", "v2": "stable-diffusion-v2-512", "xl_base": "stable-diffusion-xl-v1-base",
                 "xl_refiner": "stable-diffusion-xl-v1-refiner", "sd3": "stable-diffusion-v3-medium",
                 "sd35_medium": "stable-diffusion-v3.5-medium", "sd35_large": "stable-diffusion-v3.5-large",
                 "flux-dev": "flux-1-dev", "flux-schnell": "flux-1-schnell"}
_IMPLEMENTATION = {"flux": "https://github.com/black-forest-labs/flux"}
_SGM = "https://github.com/Stability-AI/generative-models"
# In a full file the Flux transformer sits under ComfyUI's prefix (BFL's own files hold the transformer alone)
_FULL_PREFIX = {"flux": "model.diffusion_model."}
# --component: the kind an app's model folder expects for each kind of a full file (text encoders in
# transformers' layout: ComfyUI's clip_l / clip_g / t5xxl files)
_COMPONENT_KIND = {"open_clip": "clip", "sd3_clip_l": "clip", "sd3_clip_g": "clip"}
# --component: a UNet / MMDiT keeps ``model.diffusion_model.`` (diffusers' from_single_file reads only that for
# them, ComfyUI's loaders both; and dduf pack reads it back); a VAE, the text encoders and BFL's Flux are bare
_COMPONENT_PREFIX = {"unet": "model.diffusion_model.", "sd3_transformer": "model.diffusion_model."}


class ExportResult(NamedTuple):
    path: Path
    architecture: str  # ModelSpec id written
    model_type: str  # diffusers' model type (``xl_base``...)
    components: dict[str, str]  # exported component -> where its tensors came from
    tensors: int
    bytes: int
    seconds: float


class _Tensor(NamedTuple):
    """A source tensor: its bytes at ``start`` in the file ``path`` (a map opened once per path)."""

    path: Path
    start: int
    info: TensorInfo


class _Part(NamedTuple):
    name: str  # component
    kind: str
    prefix: str
    tensors: dict[str, _Tensor]
    config: dict[str, Any]
    where: str


def export_family(model_index: Mapping[str, Any], config: Any) -> str:
    """diffusers' model type of an archive's pipeline (``v1``, ``xl_base``, ``flux-dev``...), from its
    model_index class and its components' configs (``config(name)`` -> dict), as diffusers tells the
    checkpoints apart: the UNet's cross-attention width (SD 2.x: 1024), the text encoders an SDXL holds,
    the MMDiT's depth and position grid, Flux's guidance embedder."""
    cls = model_index.get("_class_name")
    specs = component_specs(model_index)
    if cls in FAMILIES["v1"].pipelines:
        return "v2" if config("unet").get("cross_attention_dim") == 1024 else "v1"
    if cls in FAMILIES["xl_base"].pipelines:
        return "xl_base" if specs.get("text_encoder", (None, None))[0] is not None else "xl_refiner"
    if cls in FAMILIES["sd3"].pipelines:
        t = config("transformer")
        if t.get("num_layers") == 38:
            return "sd35_large"
        return "sd35_medium" if t.get("pos_embed_max_size") == 384 else "sd3"
    if cls in FAMILIES["flux-dev"].pipelines:
        return "flux-dev" if config("transformer").get("guidance_embeds") else "flux-schnell"
    known = sorted({p for f in FAMILIES.values() for p in f.pipelines})
    raise DDUFPackError(f"a {cls} archive has no single-file layout dduf exports (it exports {', '.join(known)})")


def export_single_file(
    archive: str | os.PathLike,
    output: str | os.PathLike,
    *,
    component: str | None = None,
    dtype: str | None = None,
    title: str | None = None,
    refs: Mapping[str, str] | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    fsync: bool = True,
    model_dirs: Sequence[str | os.PathLike] | None = None,
) -> ExportResult:
    """Write ``archive``'s pipeline (or its ``component``) as one ``.safetensors`` file in the family's original
    layout (module docstring). ``dtype`` casts floating tensors (``"fp16"``, ``"bf16"``...; default: kept).
    ``refs`` overrides where references resolve, ``model_dirs`` adds app model folders to search (as
    ``load_dduf(refs=..., model_dirs=...)``).

    Raises:
        DDUFPackError: a pipeline family or component dduf does not export, a tensor without a place in the
            layout; DDUFReferenceError: a reference that does not resolve or verify. Nothing is written then.
    """
    started = time.perf_counter()
    target = _target_dtype(dtype)
    if is_url(os.fspath(archive)):
        raise DDUFUsageError(f"{archive}: export reads a local archive (download it first: hf download / curl)")
    with ExitStack() as stack:
        ark = stack.enter_context(DDUFArchive(archive))
        if ark.references:  # model folders walked and read once for every reference
            from ..refs.model_dirs import search_session

            stack.enter_context(search_session())
        model_index = ark.model_index
        parts, model_type = _parts(ark, model_index, component, refs=refs, token=token,
                                   local_files_only=local_files_only, model_dirs=model_dirs)
        plan = _plan(parts, target)
        arch = ARCHITECTURES[model_type] + (f"/{component}" if component else "")
        family = "flux" if model_type.startswith("flux") else "sgm"
        metadata = {"format": "pt", "modelspec.sai_model_spec": "1.0.0", "modelspec.architecture": arch,
                    "modelspec.implementation": _IMPLEMENTATION.get(family, _SGM),
                    "modelspec.title": title or Path(archive).name.removesuffix(".dduf")}
        head = _header(plan, metadata, Path(output).name)
        size = _write(Path(output), head, plan, parts, fsync=fsync)
    return ExportResult(Path(output), arch, model_type, {p.name: p.where for p in parts}, len(plan), size,
                        time.perf_counter() - started)


def _target_dtype(dtype: str | None) -> str | None:
    if dtype is None:
        return None
    name = canonical(dtype)
    if name not in STORAGE_DTYPES:
        raise DDUFUsageError(f"--dtype {dtype!r}: not a dtype export writes (one of {', '.join(STORAGE_DTYPES)})")
    return name


def _parts(ark: DDUFArchive, model_index: Mapping[str, Any], component: str | None, *, refs: Mapping[str, str] | None,
           token: str | bool | None, local_files_only: bool,
           model_dirs: Sequence[str | os.PathLike] | None) -> tuple[list[_Part], str]:
    """Every component the file holds, each with its tensors' places and config (references resolved)."""
    references = ark.references
    configs: dict[str, dict[str, Any]] = {}
    sources: dict[str, tuple[dict[str, _Tensor], str]] = {}

    def source(name: str) -> tuple[dict[str, _Tensor], str]:
        if name not in sources:
            sources[name] = _component_source(ark, name, references, refs=refs, token=token,
                                              local_files_only=local_files_only, configs=configs,
                                              model_dirs=model_dirs)
        return sources[name]

    def config(name: str) -> dict[str, Any]:
        source(name)
        return configs[name]

    model_type = export_family(model_index, config)
    family = FAMILIES[model_type]
    present = {n for n, (lib, _c) in component_specs(model_index).items() if lib is not None}
    wanted = [n for n in family.components if n in present]
    if component is not None:
        if component not in family.components:
            near = closest(component, family.components)
            raise DDUFUsageError(f"--component {component!r}: a {family.name} file holds "
                                 f"{', '.join(sorted(family.components))}" + (f" (did you mean {near}?)" if near else ""))
        if component not in present:
            raise DDUFUsageError(f"--component {component!r}: the archive's pipeline has none (it has: "
                                 f"{', '.join(n for n in family.components if n in present)})")
        wanted = [component]
    parts = []
    for name in wanted:
        comp: Component = family.components[name]
        kind = _COMPONENT_KIND.get(comp.kind, comp.kind) if component else comp.kind
        prefix = (_COMPONENT_PREFIX.get(comp.kind, "") if component
                  else comp.prefix or _FULL_PREFIX.get(comp.kind, ""))
        tensors, where = source(name)
        parts.append(_Part(name, kind, prefix, tensors, configs[name], where))
    return parts, model_type


def _component_source(ark: DDUFArchive, name: str, references: Mapping[str, Any], *, refs: Mapping[str, str] | None,
                      token: str | bool | None, local_files_only: bool, configs: dict[str, dict[str, Any]],
                      model_dirs: Sequence[str | os.PathLike] | None = None) -> tuple[dict[str, _Tensor], str]:
    """The places of component ``name``'s tensors: in the archive, or where its reference resolves (verified)."""
    if name not in references and f"{name}/config.json" in ark:
        configs[name] = _config(ark.read_bytes(f"{name}/config.json"), name, "the archive")
        out = {}
        for entry in ark.weight_files(name):
            e, header = ark.entry(entry), ark.headers[entry]
            for t in header.tensors.values():
                out[t.name] = _Tensor(Path(ark.path), e.offset + header.data_start, t)
        return out, "stored"
    if name not in references:
        raise DDUFPackError(f"component {name!r} is neither stored in the archive nor referenced")
    from ..refs.resolve import locate_component, with_files_on_disk
    from .model_dir_layouts import install

    install()  # model folders: original layouts and full checkpoints' parts are read too
    loc = locate_component(name, references[name], refs=refs, token=token, local_files_only=local_files_only,
                           verify=True, model_dirs=model_dirs)
    loc = with_files_on_disk(loc)  # a model-folder part in another layout: read from its diffusers-named copy
    if loc.archive is not None and loc.member is not None:
        with DDUFArchive(loc.archive) as other:
            configs[name] = _config(other.read_bytes(f"{loc.member}/config.json"), name, str(loc.archive))
            out = {}
            variant = references[name].get("variant")
            for entry in other.weight_files(loc.member, variant if isinstance(variant, str) else None):
                e, header = other.entry(entry), other.headers[entry]
                for t in header.tensors.values():
                    out[t.name] = _Tensor(Path(loc.archive), e.offset + header.data_start, t)
        return out, _where(loc)
    files = dict(loc.files) or {f: (loc.folder or Path()) / f for f in os.listdir(loc.folder or ".")}
    if "config.json" not in files:
        raise DDUFPackError(f"component {name!r}: {loc.source} has no config.json")
    configs[name] = _config(files["config.json"].read_bytes(), name, loc.source)
    out = {}
    variant = references[name].get("variant")  # the reference records BASE's variant files (fp16...)
    for f in tensor_files(select_weights(files, variant if isinstance(variant, str) else None)):
        header = read_file_header(files[f], f"{name}/{f}", DDUFPackError)
        for t in header.tensors.values():
            out[t.name] = _Tensor(files[f], header.data_start, t)
    return out, _where(loc)


def _where(loc: Any) -> str:
    """Where a reference resolved, said once: a folder's ``source`` already starts with how it was found."""
    return loc.source if loc.source.startswith(loc.how) else f"{loc.how}: {loc.source}"


def _config(raw: bytes, name: str, where: str) -> dict[str, Any]:
    value = read_json(raw, f"{name}/config.json", where=where)
    if not isinstance(value, dict):
        raise DDUFPackError(f"{where}: {name}/config.json is not a JSON object")
    return value


class _Out(NamedTuple):
    name: str  # in the file
    part: int  # index into the parts
    piece: Piece
    dtype: str  # torch name, as written


def _plan(parts: list[_Part], target: str | None) -> list[_Out]:
    """Every output tensor, in file order: by element width (widest first, so every tensor starts aligned for
    its dtype after the 8-aligned header), then by name."""
    out: list[_Out] = []
    for i, part in enumerate(parts):
        shapes = {k: t.info.shape for k, t in part.tensors.items()}
        for piece in original_pieces(part.kind, shapes, part.config):
            dtypes = {part.tensors[s].info.dtype for s in piece.sources}
            if len(dtypes) != 1:
                raise DDUFPackError(f"{part.name}: {piece.name} would join tensors of dtypes {sorted(dtypes)}")
            dtype = dtypes.pop()
            if target is not None and spec.DTYPE_BY_TORCH[dtype].floating:
                dtype = target
            out.append(_Out(part.prefix + piece.name, i, piece, dtype))
    names = [o.name for o in out]
    if len(set(names)) != len(names):  # pragma: no cover - prefixes are distinct per family
        raise DDUFPackError("two components map to the same tensor name")
    out.sort(key=lambda o: (-spec.DTYPE_BY_TORCH[o.dtype].bits, o.name))
    return out


def _nbytes(o: _Out) -> int:
    n = 1
    for d in o.piece.shape:
        n *= d
    return n * spec.DTYPE_BY_TORCH[o.dtype].bits // 8


def _header(plan: list[_Out], metadata: Mapping[str, str], where: str) -> bytes:
    """The safetensors header (length prefix included), checked with the format layer's own parser."""
    records: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    position = 0
    for o in plan:
        size = _nbytes(o)
        records[o.name] = {"dtype": spec.DTYPE_BY_TORCH[o.dtype].safetensors, "shape": list(o.piece.shape),
                           "data_offsets": [position, position + size]}
        position += size
    raw = json.dumps(records, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    header, problems = parse_header(raw, len(raw), 8 + len(raw) + position, where)
    errors = [p for p in problems if p.severity == "error"]
    if header is None or errors:
        raise DDUFPackError(f"{where}: the exported header does not check ({errors[:2]}): too many tensors?")
    return len(raw).to_bytes(8, "little") + raw


def _make(o: _Out, views: list[Any]) -> Any:
    """The output tensor ``o`` from its sources' views (a copy only for cat / swap / transpose / a cast)."""
    import torch

    if o.piece.op == "cat":
        t = torch.cat(views)
    elif o.piece.op == "swap":
        a, b = views[0].chunk(2, dim=0)
        t = torch.cat([b, a])
    elif o.piece.op == "T":
        t = views[0].T.contiguous()
    elif o.piece.op == "conv1x1":
        t = views[0][:, :, None, None]
    else:
        t = views[0]
    want = getattr(torch, o.dtype)
    return t.to(want) if t.dtype != want else t


def _check_projection(parts: list[_Part], maps: Mapping[Path, Any]) -> None:
    """SD3's CLIP-L file layout has no projection (diffusers loads the identity): refuse to drop another one."""
    import torch

    for part in parts:
        t = part.tensors.get("text_projection.weight")
        if part.kind != "sd3_clip_l" or t is None:
            continue
        w = view(maps[t.path], t.start, t.info)
        if w.ndim != 2 or not torch.equal(w.float(), torch.eye(w.shape[0], w.shape[1])):
            raise DDUFPackError(f"{part.name}: its text_projection is not the identity, which SD3's single-file "
                                "layout cannot carry (it has no place for it); export the component alone "
                                "(--component) instead")


def _write(output: Path, head: bytes, plan: list[_Out], parts: list[_Part], *, fsync: bool) -> int:
    """Write to a temporary file beside ``output`` and rename it into place (nothing left on failure); 0644 less
    the umask, as apps' model files are (mkstemp's 0600 made exported files private)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack, Confined(output.parent).atomic(output, fsync=fsync, mode=0o644, suffix=".tmp") as out:
        paths = sorted({t.path for p in parts for t in p.tensors.values()})
        maps = {p: stack.enter_context(mapped(p)) for p in paths}
        files = {p: stack.enter_context(open(p, "rb")) for p in paths}
        _check_projection(parts, maps)
        write_all(out.fd, head)
        _stream(plan, parts, maps, {p: h.fileno() for p, h in files.items()}, out.fd)
        size = os.fstat(out.fd).st_size
    return size


def _stream(plan: list[_Out], parts: list[_Part], maps: Mapping[Path, Any], fds: Mapping[Path, int], out: int) -> None:
    """Every planned tensor's bytes, in order: a tensor that is its source's bytes as they are (renamed, or a
    1x1 convolution's reshape) is copied by the kernel (``copy_file_range``: no pass through this process);
    the others are made from views of the maps, one at a time, and written (pages dropped as they go)."""
    dropper = Dropper(*maps.values())
    kernel = True
    for o in plan:
        part = parts[o.part]
        first = part.tensors[o.piece.sources[0]]
        copied = 0
        if kernel and o.piece.op in ("copy", "conv1x1") and o.dtype == first.info.dtype:
            src, at = fds[first.path], first.start + first.info.begin
            copied = kernel_copy(src, out, first.info.nbytes, at)
            if copied == first.info.nbytes:
                continue
            if os.fstat(src).st_size < at + first.info.nbytes:  # its map would fault past the end (SIGBUS)
                raise DDUFPackError(f"{o.name}: its source file ended early (changed while exporting?)")
            kernel = False  # not on this file system: bytes through the maps from now on
        t = _make(o, [view(maps[part.tensors[s].path], part.tensors[s].start, part.tensors[s].info)
                      for s in o.piece.sources])
        data = bytes_of(t)
        if data.numel() != _nbytes(o):  # pragma: no cover - a source changed under us
            raise DDUFPackError(f"{o.name}: {data.numel()} bytes, {_nbytes(o)} planned")
        write_all(out, data.numpy().data[copied:])  # what the kernel copied is not written twice
        dropper.read(data.numel())
        del data, t

