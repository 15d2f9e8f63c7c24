"""What an archive or a pipeline folder holds, per component: classes, dtypes, sizes, alignment,
references. Headers only, no torch: this backs ``dduf info``."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from . import spec
from .archive import DDUFArchive
from .index import summarize
from .pack import plan_folder
from .pipeline_kinds import mark_parts, unsaved_for_info
from .weights import classify, select_weights, tensor_files

logger = logging.getLogger(__name__)


def _variant_used(component: str, weights: list[str], variant: str | None) -> str | None:
    """The variant of the weights chosen for ``variant``; says so once when a component that has weights
    lacks it (a component without weights, a scheduler or tokenizer, has nothing to say)."""
    used = {w.variant for f in weights if (w := classify(f.rsplit("/", 1)[-1]))}
    if variant and weights and variant not in used:
        logger.info("%s: no %s variant, using the default weights", component, variant)
    return next(iter(used)) if len(used) == 1 else None


def _component_record(library: str | None, cls: str | None, summary: dict[str, Any], files: dict[str, int],
                      external: Any, **extra: Any) -> dict[str, Any]:
    return {
        "library": library,
        "class": cls,
        "dtype": summary.get("dtype"),
        "dtypes": summary.get("dtypes", {}),
        "parameters": summary.get("parameters", 0),
        "bytes": summary.get("bytes", 0),
        "external": external if external else False,
        "files": files,
        **extra,
    }


def describe_archive(archive: DDUFArchive, variant: str | None = None) -> dict[str, Any]:
    components: dict[str, Any] = {}
    null: list[str] = []
    for name, comp in archive.components.items():
        if comp.library is None:
            null.append(name)
            continue
        entries = {f"{name}/{f}": archive.entry(f"{name}/{f}") for f in comp.files}
        weights = archive.weight_files(name, variant) if comp.files else []
        summary = summarize(archive.headers[w] for w in weights if w in archive.headers)
        aligned = all(
            (entries[w].offset + archive.headers[w].data_start) % spec.TENSOR_ALIGNMENT == 0
            for w in weights if w in archive.headers
        )
        record = _component_record(comp.library, comp.class_name, summary, {f: e.length for f, e in entries.items()},
                                   comp.external, aligned=aligned, weight_files=weights,
                                   variant=_variant_used(name, weights, variant))
        if archive.stored_index is not None:
            components_index = archive.stored_index.get("components")
            indexed = components_index.get(name) if isinstance(components_index, dict) else None
            indexed = indexed if isinstance(indexed, dict) else {}  # the index is untrusted: any shape
            for key in ("storage_dtype", "compute_dtype", "quantization"):
                if key in indexed:
                    record[key] = indexed[key]
        components[name] = record
    mark_parts(archive.model_index, components)
    info = {
        "path": archive.path,
        "kind": "archive",
        "pipeline": archive.model_index.get("_class_name"),
        "size": archive._source.size,
        "indexed": archive.stored_index is not None,
        "components": components,
        "null_components": null,
    }
    adapters = _adapters(archive)
    if adapters:
        info["adapters"] = adapters
    return info


def _adapters(archive: DDUFArchive) -> list[dict[str, Any]]:
    """The archive's LoRA adapters (format/lora.py), [] when it has none or its config does not parse."""
    from .json_budget import parse_json_entry
    from .lora import LORA_CONFIG, describe_adapters

    e = archive.entries.get(LORA_CONFIG)
    if e is None or e.name in archive.compressed:
        return []
    config, code, _why = parse_json_entry(archive.read_bytes(LORA_CONFIG), LORA_CONFIG)
    return [] if code is not None else describe_adapters(config, archive.entries, archive.headers)


def describe_folder(folder: str | os.PathLike, variant: str | None = None) -> dict[str, Any]:
    plan = plan_folder(folder, variant=variant, unsaved=unsaved_for_info)
    by_component: dict[str, list] = {}
    for source in plan.sources:
        by_component.setdefault(source.name.split("/")[0], []).append(source)
    from .structure import component_specs

    components: dict[str, Any] = {}
    null: list[str] = []
    for name, (library, cls) in component_specs(plan.model_index).items():
        if library is None:
            null.append(name)
            continue
        sources = by_component.get(name, [])
        files = [s.name.split("/", 1)[1] for s in sources]
        weights = {f"{name}/{f}" for f in tensor_files(select_weights(files, variant))}
        summary = summarize(s.header for s in sources if s.name in weights and s.header is not None)
        # plan_folder has already logged which components with weights lack the variant
        used = {w.variant for f in weights if (w := classify(f.rsplit("/", 1)[-1]))}
        components[name] = _component_record(library, cls, summary, {s.name: s.nbytes for s in sources}, False,
                                             weight_files=sorted(weights),
                                             variant=next(iter(used)) if len(used) == 1 else None)
    mark_parts(plan.model_index, components)
    return {
        "path": str(Path(folder)),
        "kind": "folder",
        "pipeline": plan.model_index.get("_class_name"),
        "components": components,
        "null_components": null,
        "skipped": [{"path": s.path, "reason": s.reason} for s in plan.skipped],
    }


def describe(source: str | os.PathLike, variant: str | None = None) -> dict[str, Any]:
    """Describe a ``.dduf`` archive or a diffusers pipeline folder."""
    if os.path.isdir(source):
        return describe_folder(source, variant)
    with DDUFArchive(source) as archive:
        return describe_archive(archive, variant)
