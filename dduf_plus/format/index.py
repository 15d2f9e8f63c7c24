"""The dduf_plus index: one root-level JSON entry (``dduf_plus.index.json``) recording, per file, its
size, sha256, CRC-32 and data offset; per tensor its dtype, shape and archive offset; per component a
precision summary and, for components stored elsewhere, a content-addressed reference.

Readers that don't know it ignore it (DDUF allows root-level .json entries). Unknown keys are
preserved and ignored, so later versions can add fields without breaking older readers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import compress, repeat
from math import prod
from operator import attrgetter, eq, sub
from typing import Any, NamedTuple

from . import spec
from .safetensors_header import SafetensorsHeader, TensorInfo
from .weights import select_weights, tensor_files, variants


class FileRecord(NamedTuple):
    name: str  # entry name, "unet/config.json"
    size: int
    data_offset: int  # absolute offset of the entry's first byte in the archive
    sha256: str | None
    crc32: int
    source_sha256: str | None = None  # set when the entry's bytes differ from the source (dtype conversion)


def summarize(headers: Iterable[SafetensorsHeader]) -> dict[str, Any]:
    """Parameter count, bytes per dtype and the dominant floating dtype of a set of weight files.
    Column-wise (C loops over each header's tensors): ``dduf info`` runs it over every tensor."""
    dtypes: dict[str, int] = {}
    parameters = 0
    for header in headers:
        infos = list(header.tensors.values())
        parameters += sum(map(prod, map(_SHAPE, infos)))
        kinds = list(map(_DTYPE, infos))
        sizes = list(map(sub, map(_END, infos), map(_BEGIN, infos)))
        for kind in set(kinds):  # a handful of dtypes per file
            dtypes[kind] = dtypes.get(kind, 0) + sum(compress(sizes, map(eq, kinds, repeat(kind))))
    floating = {k: v for k, v in dtypes.items() if spec.DTYPE_BY_TORCH[k].floating}
    dominant = max(sorted(floating), key=lambda k: floating[k]) if floating else None
    return {"parameters": parameters, "bytes": sum(dtypes.values()), "dtypes": dict(sorted(dtypes.items())), "dtype": dominant}


_SHAPE, _DTYPE, _BEGIN, _END = (attrgetter(field) for field in ("shape", "dtype", "begin", "end"))


ADAPTER_PREFIX = "_lora/"  # LoRA adapters' folder (format/lora.py)


def _tensor_record(t: TensorInfo, data_start: int) -> dict[str, Any]:
    return {"dtype": t.dtype, "shape": list(t.shape), "offset": data_start + t.begin, "nbytes": t.nbytes}


def build_index(
    model_index: Mapping[str, Any],
    files: Iterable[FileRecord],
    headers: Mapping[str, SafetensorsHeader],
    *,
    created_by: str,
    references: Mapping[str, Any] | None = None,
    extra_components: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Assemble the index. ``headers`` maps safetensors entry names to their parsed headers."""
    from .structure import component_specs

    file_map: dict[str, Any] = {}
    by_component: dict[str, list[str]] = {}
    for rec in files:
        entry: dict[str, Any] = {"size": rec.size, "offset": rec.data_offset, "sha256": rec.sha256, "crc32": f"{rec.crc32:08x}"}
        if rec.source_sha256 and rec.source_sha256 != rec.sha256:
            entry["source_sha256"] = rec.source_sha256
        header = headers.get(rec.name)
        if header is not None:
            data_start = rec.data_offset + header.data_start
            entry["tensor_data_offset"] = data_start
            # An adapter's tensor table stays in its own header only: LoRA files hold thousands of small tensors
            # (an SDXL LoRA ~2,200), and their records would outweigh the rest of the archive (docs/lora.md).
            if not rec.name.startswith(ADAPTER_PREFIX):
                entry["tensors"] = {n: _tensor_record(t, data_start) for n, t in sorted(header.tensors.items())}
            if header.metadata:
                entry["metadata"] = header.metadata
        file_map[rec.name] = entry
        if "/" in rec.name:
            by_component.setdefault(rec.name.split("/")[0], []).append(rec.name.split("/")[1])
    components: dict[str, Any] = {}
    references = references or {}
    for name, (library, cls) in sorted(component_specs(model_index).items()):
        comp: dict[str, Any] = {"library": library, "class": cls}
        if name in references:
            comp["external"] = references[name]
        elif library is not None:
            present = sorted(by_component.get(name, []))
            comp["files"] = [f"{name}/{f}" for f in present]
            comp.update(_summaries(name, present, headers))
        comp.update((extra_components or {}).get(name, {}))
        components[name] = comp
    return {
        "format": spec.INDEX_FORMAT,
        "format_version": spec.INDEX_VERSION,
        "created_by": created_by,
        "alignment": {"tensor_data": spec.TENSOR_ALIGNMENT, "entry": spec.ENTRY_ALIGNMENT},
        "components": components,
        "files": file_map,
    }


def _summaries(component: str, filenames: list[str], headers: Mapping[str, SafetensorsHeader]) -> dict[str, Any]:
    """Summary of the default weights, plus one per variant the component carries."""
    def summary_for(variant: str | None) -> dict[str, Any]:
        chosen = tensor_files(select_weights(filenames, variant))
        return summarize(headers[f"{component}/{f}"] for f in chosen if f"{component}/{f}" in headers)

    out: dict[str, Any] = {"summary": summary_for(None)}
    found = sorted(variants(filenames))
    if found:
        out["variants"] = {v: summary_for(v) for v in found}
    return out


def check_index(index: object) -> str | None:
    """Why ``index`` is not a usable dduf_plus index, or None."""
    if not isinstance(index, dict) or index.get("format") != spec.INDEX_FORMAT:
        return "not a dduf_plus index"
    version = index.get("format_version")
    if not isinstance(version, int) or version < 1:
        return f"bad format_version {version!r}"
    if version > spec.INDEX_VERSION:
        return None  # newer minor additions are ignorable by design; readers use what they know
    if not isinstance(index.get("files"), dict) or not isinstance(index.get("components"), dict):
        return "index lacks 'files' or 'components'"
    return None
