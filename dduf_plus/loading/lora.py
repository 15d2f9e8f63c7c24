"""Apply the LoRA adapters an archive stores (``_lora/``) to the pipeline just built, through diffusers' own
``load_lora_weights``: each adapter's tensors view the archive's mapping (no file extracted), under its name,
with its weight; optionally fused (docs/lora.md)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import DDUFLoadError
from ..format.archive import DDUFArchive, tensor_view
from ..format.findings import Finding
from ..format.json_budget import parse_json_entry
from ..format.lora import (
    LORA_CONFIG,
    LORA_METADATA_KEY,
    AdapterEntry,
    config_findings,
    lora_file_findings,
    read_lora,
)
from .gc_pause import collector_paused

logger = logging.getLogger(__name__)


def archive_adapters(archive: DDUFArchive) -> list[AdapterEntry]:
    """The adapters ``_lora/config.json`` lists, checked (A001); [] when the archive has none.

    Raises:
        DDUFLoadError: the config is malformed or names files the archive lacks.
    """
    if LORA_CONFIG not in archive.entries:
        return []
    config, code, why = parse_json_entry(archive.read_bytes(LORA_CONFIG), LORA_CONFIG)
    if code is not None:
        raise DDUFLoadError(f"{archive.path}: {code} [{LORA_CONFIG}]: {why}")
    adapters, problems = config_findings(config, archive.entries)
    _raise_first(archive.path, problems)
    return adapters


def _raise_first(path: Any, problems: Iterable[Finding]) -> None:
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise DDUFLoadError(f"{path}: {errors[0]}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))


def select_adapters(found: Sequence[AdapterEntry], adapters: Any, where: str) -> list[AdapterEntry]:
    """The adapters to apply: all (``adapters=None`` or True), none (False or []), or those named."""
    if adapters is None or adapters is True:
        return list(found)
    if adapters is False:
        return []
    names = [adapters] if isinstance(adapters, str) else list(adapters)
    by_name = {a.name: a for a in found}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        have = ", ".join(by_name) or "none"
        raise DDUFLoadError(f"{where}: adapters={unknown[0]!r} is not an adapter of this archive (it has: {have})")
    return [by_name[n] for n in names]


def adapter_tensors(archive: DDUFArchive, adapter: AdapterEntry) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The adapter's tensors viewing the archive's mapping, and diffusers' adapter metadata from its header
    (what ``load_lora_weights`` reads from a file's ``lora_adapter_metadata``), after A002-A004."""
    import torch

    header = archive.headers.get(adapter.file)
    if header is None:
        raise DDUFLoadError(f"{archive.path}: adapter {adapter.name!r}: {adapter.file} has no readable "
                            "safetensors header")
    entry = archive.entries[adapter.file]
    lora = read_lora(header)

    def read(info: Any) -> bytes:
        return archive.read_bytes(adapter.file, header.data_start + info.begin, info.nbytes)

    _raise_first(archive.path, lora_file_findings(lora, adapter.file, read))
    mm = archive.mmap
    start = entry.offset + header.data_start
    tensors = {name: tensor_view(mm, start + info.begin, info, torch) for name, info in header.tensors.items()}
    raw = (header.metadata or {}).get(LORA_METADATA_KEY)
    metadata = None
    if raw:
        value, code, why = parse_json_entry(raw.encode(), f"{adapter.file}:{LORA_METADATA_KEY}")
        if code is not None or not isinstance(value, dict):
            raise DDUFLoadError(f"{archive.path}: adapter {adapter.name!r}: {LORA_METADATA_KEY} in its header is "
                                f"not a JSON object ({why or type(value).__name__})")
        metadata = value
    return tensors, metadata


def load_adapter(pipe: Any, tensors: Mapping[str, Any], metadata: dict[str, Any] | None, name: str,
                 where: str) -> None:
    """``pipe.load_lora_weights(tensors, adapter_name=name)``, as from the file: diffusers takes the peft
    config (alpha, ranks) from a file's header, and from a dict it has no header to read. So for this call
    only, this pipeline's ``lora_state_dict`` hands diffusers the metadata the file carries (an attribute of
    this instance, shadowing the class's: no global state changes)."""
    cls_reader = type(pipe).lora_state_dict

    def with_metadata(state: Any, **kwargs: Any) -> Any:
        out = cls_reader(state, **kwargs)
        if metadata is not None and kwargs.get("return_lora_metadata") and isinstance(out, tuple):
            out = (*out[:-1], metadata)
        return out

    object.__setattr__(pipe, "lora_state_dict", with_metadata)
    try:
        pipe.load_lora_weights(dict(tensors), adapter_name=name)
    except Exception as e:
        raise DDUFLoadError(f"{where}: adapter {name!r} does not load into {type(pipe).__name__} (A006): "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    finally:
        object.__delattr__(pipe, "lora_state_dict")


def apply_adapters(pipe: Any, archive: Any, *, adapters: Any = None,
                   adapter_weights: Mapping[str, float] | None = None, fuse_lora: bool = False) -> list[str]:
    """Load the archive's adapters into ``pipe`` (see :func:`select_adapters`), each with its stored weight
    unless ``adapter_weights`` gives one; ``fuse_lora`` merges them into the weights and removes the LoRA
    layers. Returns the names applied.

    Raises:
        DDUFLoadError: a malformed adapter, one that does not fit the pipeline, a pipeline with no LoRA loader,
            an unknown name in ``adapters`` / ``adapter_weights``.
    """
    where = str(getattr(archive, "path", archive))
    found = archive_adapters(archive) if isinstance(archive, DDUFArchive) else []  # a folder has no _lora/
    chosen = select_adapters(found, adapters, where)
    weights = dict(adapter_weights or {})
    unknown = sorted(set(weights) - {a.name for a in chosen})
    if unknown:
        raise DDUFLoadError(f"{where}: adapter_weights names {unknown[0]!r}, which is not an adapter being applied "
                            f"({', '.join(a.name for a in chosen) or 'none'})")
    if not chosen:
        return []
    if not hasattr(pipe, "load_lora_weights"):
        raise DDUFLoadError(f"{where}: {type(pipe).__name__} has no LoRA loader in diffusers: its adapters "
                            f"({', '.join(a.name for a in chosen)}) cannot be applied; pass adapters=False")
    with collector_paused():  # peft creates a few objects per adapted layer: walked once, as the models were
        for adapter in chosen:
            tensors, metadata = adapter_tensors(archive, adapter)
            load_adapter(pipe, tensors, metadata, adapter.name, where)
    names = [a.name for a in chosen]
    scales = [float(weights.get(a.name, a.weight)) for a in chosen]
    if len(names) > 1 or any(s != 1.0 for s in scales):
        pipe.set_adapters(names, adapter_weights=scales)
    if fuse_lora:
        pipe.fuse_lora(adapter_names=names)
        pipe.unload_lora_weights()
    logger.info("%s: adapters %s applied%s", where, ", ".join(f"{n} ({s:g})" for n, s in zip(names, scales, strict=True)),
                " and fused" if fuse_lora else "")
    return names
