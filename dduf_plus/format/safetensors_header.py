"""safetensors headers: parse and check them without touching tensor data."""

from __future__ import annotations

import json
import struct
from typing import NamedTuple

from . import spec
from .findings import Finding, finding

MAX_TENSORS = 1_000_000
MAX_RANK = 64
MAX_ELEMENTS = 1 << 62


class TensorInfo(NamedTuple):
    name: str
    dtype: str  # torch spelling: "float16"
    shape: tuple[int, ...]
    begin: int  # relative to the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsHeader(NamedTuple):
    header_length: int  # N: the JSON header's byte length
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None

    @property
    def data_start(self) -> int:
        """Offset of the tensor data section from the start of the file."""
        return 8 + self.header_length


def read_header_length(prefix: bytes) -> int:
    return struct.unpack("<Q", prefix[:8])[0]


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def parse_header(raw: bytes, header_length: int, file_size: int, entry: str) -> tuple[SafetensorsHeader | None, list[Finding]]:
    """Check a safetensors JSON header against the file it heads (size ``file_size``)."""
    data_size = file_size - 8 - header_length
    repeated: list[str] = []

    def unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
        obj = dict(pairs)
        if len(obj) != len(pairs) and len(repeated) < 10:
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    repeated.append(key)
                seen.add(key)
        return obj

    try:
        # Strict like the Rust reader: UTF-8 only (json.loads would also take UTF-16/32), no NaN/Infinity.
        header = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=unique_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        return None, [finding("S002", entry, f"header is not valid JSON: {e}")]
    if not isinstance(header, dict):
        return None, [finding("S002", entry, "header is not a JSON object")]
    findings: list[Finding] = []
    if repeated:
        shown = ", ".join(repr(k) for k in repeated[:5])
        findings.append(finding("S010", entry, f"header repeats key(s) {shown}: readers may pick different ones"))
    metadata = header.pop(spec.SAFETENSORS_METADATA_KEY, None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        findings.append(finding("S007", entry, "__metadata__ must map strings to strings"))
        metadata = None
    if len(header) > MAX_TENSORS:
        return None, findings + [finding("S002", entry, f"{len(header)} tensors is more than {MAX_TENSORS}")]
    tensors: dict[str, TensorInfo] = {}
    for name, info in header.items():
        where = f"{entry}:{name}"
        if not isinstance(info, dict):
            findings.append(finding("S002", where, "tensor record is not an object"))
            continue
        dtype = spec.DTYPE_BY_SAFETENSORS.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
        if dtype is None:
            findings.append(finding("S003", where, f"unknown dtype {info.get('dtype')!r}"))
            continue
        shape = info.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_RANK
            or not all(type(d) is int and d >= 0 for d in shape)
        ):
            findings.append(finding("S004", where, f"shape {shape!r} is not a list of non-negative integers"))
            continue
        numel = 1
        for d in shape:
            numel *= d
            if numel > MAX_ELEMENTS:
                break
        if numel > MAX_ELEMENTS:
            findings.append(finding("S004", where, f"shape {shape} overflows"))
            continue
        offsets = info.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
            findings.append(finding("S006", where, f"data_offsets {offsets!r} is not two non-negative integers"))
            continue
        begin, end = offsets
        if end < begin or end > data_size:
            findings.append(finding("S006", where, f"data_offsets {offsets} out of bounds (data section is {data_size} bytes)"))
            continue
        bits = numel * dtype.bits
        if bits % 8 or bits // 8 != end - begin:
            findings.append(finding("S005", where, f"{dtype.torch}{shape} needs {bits / 8:g} bytes, span holds {end - begin}"))
            continue
        tensors[name] = TensorInfo(name, dtype.torch, tuple(shape), begin, end)
    position = 0
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin < position:
            findings.append(finding("S006", f"{entry}:{info.name}", "tensor overlaps another"))
        elif info.begin > position:
            findings.append(finding("S006", f"{entry}:{info.name}", f"{info.begin - position}-byte hole before tensor"))
        position = max(position, info.end)
    if position != data_size and not any(f.code in ("S002", "S003", "S004", "S005", "S006") for f in findings):
        findings.append(finding("S006", entry, f"tensors cover {position} of {data_size} data bytes"))
    return SafetensorsHeader(header_length, tensors, metadata), findings


def read_safetensors_header(read_at, entry_offset: int, entry_size: int, entry: str) -> tuple[SafetensorsHeader | None, list[Finding]]:
    """Read and check the header of a safetensors file that occupies ``entry_size`` bytes at ``entry_offset``
    of a source whose ``read_at(offset, length)`` returns bytes."""
    if entry_size < 8:
        return None, [finding("S001", entry, f"{entry_size} bytes cannot hold a safetensors header")]
    header_length = read_header_length(read_at(entry_offset, 8))
    if header_length > spec.SAFETENSORS_MAX_HEADER or 8 + header_length > entry_size:
        return None, [finding("S001", entry, f"header length {header_length} exceeds the entry or 100 MB")]
    raw = read_at(entry_offset + 8, header_length)
    return parse_header(raw, header_length, entry_size, entry)
