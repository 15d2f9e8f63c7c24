"""An archive's LoRA adapter written back as a single file, in kohya / A1111 layout, which A1111, Forge, ComfyUI
and diffusers all read: ``lora_unet_<module>`` / ``lora_te[1|2]_<module>`` with ``.lora_down`` / ``.lora_up``
and an ``.alpha`` per module. Torch-free and byte-faithful: tensor data is copied from the archive unchanged,
only names change; alphas come from the adapter's peft config (``lora_adapter_metadata``), so each module keeps
its scale (alpha / rank). A file already in kohya layout is written as it is stored."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import DDUFFormatError
from ..storage.confined import Confined
from ..storage.fd_io import COPY_BLOCK
from . import spec
from .json_budget import parse_json_entry
from .lora import LoraFile, LoraModule, read_lora
from .safetensors_header import SafetensorsHeader, TensorInfo

# diffusers component -> kohya prefix, per family (SDXL's two text encoders are te1 / te2)
_PREFIX = {"unet": "lora_unet_", "text_encoder_2": "lora_te2_",
           "text_encoder_3": "lora_te3_"}
_DTYPE_NAME = {d.torch: d.safetensors for d in spec.DTYPE_BY_TORCH.values()}


def _alpha_for(module: LoraModule, component: str, config: Mapping[str, Any]) -> float:
    """The module's alpha from the peft config: ``alpha_pattern`` (longest matching key), else ``lora_alpha``,
    else the rank (peft's default scale 1)."""
    rank = module.rank or 1
    stem = module.key.split(".", 1)[1] if "." in module.key else module.key
    pattern = config.get(f"{component}.alpha_pattern") or {}
    if isinstance(pattern, dict):
        hits = [k for k in pattern if isinstance(k, str) and (stem == k or stem.endswith("." + k))]
        if hits and isinstance(pattern[max(hits, key=len)], (int, float)):
            return float(pattern[max(hits, key=len)])
    alpha = config.get(f"{component}.lora_alpha")
    return float(alpha) if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) else float(rank)


def _kohya_stem(module: LoraModule, sdxl: bool) -> str | None:
    component, _, rest = module.key.partition(".")
    if component == "text_encoder":
        prefix = "lora_te1_" if sdxl else "lora_te_"
    else:
        prefix = _PREFIX.get(component, "")
    if not prefix or not rest:
        return None
    if component.startswith("text_encoder") and not rest.startswith("text_model."):
        rest = "text_model." + rest  # transformers 5 saves CLIP without it; A1111 and ComfyUI name it
    return prefix + rest.replace(".", "_")


def kohya_names(lora: LoraFile, sdxl: bool) -> dict[str, tuple[str, str]]:
    """{kohya stem: (down tensor, up tensor)} for a diffusers-layout adapter; raises when a module has no kohya
    name (a layout kohya files do not have)."""
    out: dict[str, tuple[str, str]] = {}
    for m in lora.modules.values():
        stem = _kohya_stem(m, sdxl)
        if stem is None or m.down is None or m.up is None:
            raise DDUFFormatError(f"adapter module {m.key!r} has no kohya name (layout {lora.layout})")
        out[stem] = (m.down.name, m.up.name)
    return out


def _header_bytes(tensors: dict[str, dict[str, Any]], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    header.update(tensors)
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    return raw + b" " * (-len(raw) % 8)


def kohya_file_parts(header: SafetensorsHeader, sdxl: bool) -> tuple[bytes, list[tuple[TensorInfo, bytes | None]]]:
    """The kohya file's header bytes and its data, in order: (tensor copied from the adapter, None) or (alpha
    info, its 4 bytes). The trainer's metadata is kept; diffusers' peft config becomes the ``.alpha`` tensors."""
    lora = read_lora(header)
    metadata = dict(header.metadata or {})
    config: dict[str, Any] = {}
    raw = metadata.get("lora_adapter_metadata")
    if raw:
        value, code, _why = parse_json_entry(raw.encode(), "lora_adapter_metadata")
        config = value if code is None and isinstance(value, dict) else {}
    tensors: dict[str, dict[str, Any]] = {}
    plan: list[tuple[TensorInfo, bytes | None]] = []
    offset = 0
    for stem, (down, up) in sorted(kohya_names(lora, sdxl).items()):
        for suffix, name in ((".lora_down.weight", down), (".lora_up.weight", up)):
            info = header.tensors[name]
            tensors[stem + suffix] = {"dtype": _DTYPE_NAME[info.dtype], "shape": list(info.shape),
                                      "data_offsets": [offset, offset + info.nbytes]}
            plan.append((info, None))
            offset += info.nbytes
        module = next(m for m in lora.modules.values() if m.down is not None and m.down.name == down)
        alpha = struct.pack("<f", _alpha_for(module, module.key.split(".", 1)[0], config))
        tensors[stem + ".alpha"] = {"dtype": "F32", "shape": [], "data_offsets": [offset, offset + 4]}
        plan.append((TensorInfo(stem + ".alpha", "float32", (), offset, offset + 4), alpha))
        offset += 4
    metadata.pop("lora_adapter_metadata", None)  # its alphas are the .alpha tensors now (diffusers refuses both)
    return _header_bytes(tensors, metadata), plan


def write_kohya(header: SafetensorsHeader, read: Any, out: str | os.PathLike, *, sdxl: bool) -> Path:
    """Write the adapter (``header``; ``read(info)`` gives a tensor's bytes) in kohya layout to ``out``
    atomically; a kohya-layout adapter must be copied as stored instead (the caller's job)."""
    head, plan = kohya_file_parts(header, sdxl)
    path = Path(out)
    # the one atomic writer: an exclusive temporary file (a link planted at a fixed ".OUT.tmp" was written
    # through before 0.13.0), removed when a read or write fails, renamed over OUT when whole
    with Confined(path.parent).atomic(path, fsync=False, mode=0o644, suffix=".tmp") as dst:
        dst.file.write(struct.pack("<Q", len(head)) + head)
        for info, data in plan:
            dst.file.write(data if data is not None else read(info))
    return path


def export_adapter(archive: Any, name: str | None, out: str | os.PathLike) -> Path:
    """Write adapter ``name`` of a LoRA archive (the only one when None) to ``out`` in kohya / A1111 layout
    (``dduf export L.dduf --adapter NAME -o OUT.safetensors``): copied as stored when it is already kohya,
    renamed and given its alphas when it is diffusers/peft.

    Raises:
        DDUFFormatError: the archive has no such adapter, or its layout has no kohya form.
    """
    from .lora import LORA_CONFIG, config_findings, pipeline_family

    if LORA_CONFIG not in archive.entries:
        raise DDUFFormatError(f"{archive.path}: no LoRA adapters (no {LORA_CONFIG})")
    adapters, problems = config_findings(archive.read_json(LORA_CONFIG), archive.entries)
    if problems:
        raise DDUFFormatError(f"{archive.path}: {problems[0]}")
    chosen = [a for a in adapters if name is None or a.name == name]
    if len(chosen) != 1:
        names = ", ".join(a.name for a in adapters)
        raise DDUFFormatError(f"{archive.path}: " + (f"no adapter {name!r}" if name else "several adapters")
                              + f" (it has: {names}); name one with --adapter")
    entry = chosen[0].file
    header = archive.headers[entry]
    path = Path(out)
    lora = read_lora(header)
    # kohya's own names for MMDiT / Flux transformers are BFL's (fused qkv): not written; apps (ComfyUI, Forge)
    # read those adapters in diffusers' layout, so they are written as stored
    if lora.layout == "kohya" or any(m.key.startswith("transformer.") for m in lora.modules.values()):
        length = archive.entries[entry].length
        with Confined(path.parent).atomic(path, fsync=False, mode=0o644, suffix=".tmp") as dst:
            for start in range(0, length, COPY_BLOCK):  # in blocks: an adapter can be a GB
                dst.file.write(archive.read_bytes(entry, start, min(COPY_BLOCK, length - start)))
        return path
    sdxl = pipeline_family(archive.model_index.get("_class_name")) == "sdxl"
    return write_kohya(header, lambda i: archive.read_bytes(entry, header.data_start + i.begin, i.nbytes), path,
                       sdxl=sdxl)
