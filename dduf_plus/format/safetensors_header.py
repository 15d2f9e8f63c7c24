"""safetensors headers: parse and check them without touching tensor data."""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable
from itertools import chain, compress, repeat
from math import prod
from operator import attrgetter, itemgetter, methodcaller, mul, not_, sub
from typing import NamedTuple

from ..errors import DDUFFormatError
from ..storage.fd_io import open_regular
from . import spec
from .findings import Finding, finding
from .json_budget import depth_of, lone_surrogate, may_hold_lone_surrogate, skeleton, value_bound

MAX_RANK = 64
MAX_ELEMENTS = 1 << 62
# A header may hold at most HEADER_VALUES_PER_TENSOR JSON values per tensor it may declare, plus this many
# for __metadata__ (bounded from its bytes before it is parsed, see json_budget.value_bound).
HEADER_METADATA_VALUES = 4096
MAX_HEADER_DEPTH = spec.MAX_JSON_DEPTH  # valid headers nest 3 deep ({record: {"shape": [...]}})


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


# What the Rust reader (the `safetensors` library) refuses and Python's json reads: the integer literal -0 (and
# lone surrogates: json_budget.lone_surrogate). Searched on the bytes (a literal prefix: ~2.5 GB/s); only a
# header that matches ("-0" in a name too) is parsed the slow way, where the parser tells numbers apart.
_NEGATIVE_ZERO = re.compile(rb"-0(?![0-9.eE])")
_CONTROL_ESCAPE = re.compile(rb"\\(?:u00[01]|u007[fF]|[bfnrt])")  # JSON spells control characters only so
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _no_negative_zero(text: str) -> int:
    if text == "-0":
        raise ValueError("the number -0 (the safetensors library refuses it)")
    return int(text)


def _control_names(raw: bytes, header: dict, entry: str) -> list[Finding]:
    """S012: tensor names holding NUL or control characters (only spelled as escapes in valid JSON)."""
    if not _CONTROL_ESCAPE.search(raw):
        return []
    names = [k for k in header if k != spec.SAFETENSORS_METADATA_KEY and _CONTROL.search(k)]
    if not names:
        return []
    shown = ", ".join(repr(k) for k in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return [finding("S012", entry, f"tensor name(s) {shown} hold NUL or control characters")]


def _repeated_keys(text: str) -> list[str]:
    """Keys that some object of ``text`` (valid JSON) repeats, at most 10: the slow path, taken only when
    the member count says there is a repeat somewhere."""
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

    json.loads(text, object_pairs_hook=unique_keys, parse_constant=_no_constant)
    return repeated


def _members(header: dict) -> int:
    """Object members the parsed header holds where valid headers have objects: top level, records and
    __metadata__. Fewer than the text's means a repeated key (or an object somewhere no object belongs)."""
    count = len(header)
    for value in header.values():
        if type(value) is dict:
            count += len(value)
    return count


def parse_header(raw: bytes, header_length: int, file_size: int, entry: str, *,
                 max_tensors: int = spec.MAX_TENSORS_PER_FILE) -> tuple[SafetensorsHeader | None, list[Finding]]:
    """Check a safetensors JSON header against the file it heads (size ``file_size``).

    Bounded before parsing: at most HEADER_VALUES_PER_TENSOR JSON values per allowed tensor (S011: more
    cannot be ``max_tensors`` tensors of sane rank) and MAX_HEADER_DEPTH levels (S002); after parsing, at most
    ``max_tensors`` tensors (S011; the per-file cap, or less of it when the archive's cap leaves less).
    Work per tensor is a few C-level steps: no per-object parser hook (repeated keys are found by counting
    members, see :func:`_members`), records checked column-wise (:func:`_valid_records`)."""
    data_size = file_size - 8 - header_length
    raw = bytes(raw)  # no copy for bytes; memoryview/bytearray callers get one
    values = value_bound(raw)
    max_values = max_tensors * spec.HEADER_VALUES_PER_TENSOR + HEADER_METADATA_VALUES
    if values > max_values:
        return None, [finding("S011", entry, f"header holds up to {values} JSON values (commas and brackets): more "
                                             f"than {max_tensors} tensors need ({_cap_name(max_tensors)})")]
    marks = skeleton(raw)
    if depth_of(marks, MAX_HEADER_DEPTH) > MAX_HEADER_DEPTH:
        return None, [finding("S002", entry, f"header nests deeper than {MAX_HEADER_DEPTH} levels")]
    try:
        # Strict like the Rust reader: UTF-8 only (json.loads would also take UTF-16/32), no NaN/Infinity.
        text = raw.decode("utf-8")
        parse_int = _no_negative_zero if _NEGATIVE_ZERO.search(raw) else None
        header = json.loads(text, parse_constant=_no_constant, parse_int=parse_int)
        lone = lone_surrogate(header) if may_hold_lone_surrogate(raw) else None
        if lone is not None:
            raise ValueError(f"{lone} (the safetensors library refuses it)")
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        return None, [finding("S002", entry, f"header is not valid JSON: {e}")]
    if not isinstance(header, dict):
        return None, [finding("S002", entry, "header is not a JSON object")]
    findings: list[Finding] = []
    if _members(header) != marks.count(b"\x00"):
        repeated = _repeated_keys(text)
        if repeated:
            shown = ", ".join(repr(k) for k in repeated[:5])
            findings.append(finding("S010", entry, f"header repeats key(s) {shown}: readers may pick different ones"))
    findings += _control_names(raw, header, entry)
    metadata = header.pop(spec.SAFETENSORS_METADATA_KEY, None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        findings.append(finding("S007", entry, "__metadata__ must map strings to strings"))
        metadata = None
    if len(header) > max_tensors:
        return None, findings + [finding("S011", entry, f"{len(header)} tensors is more than the {max_tensors} "
                                                        f"allowed ({_cap_name(max_tensors)})")]
    tensors = _valid_records(header, data_size)
    if tensors is None:  # something is wrong: the record-by-record pass says what
        tensors = _check_records(header, data_size, entry, findings)
    return SafetensorsHeader(header_length, tensors, metadata), findings


_GET_DTYPE, _GET_SHAPE, _GET_OFFSETS = (methodcaller("get", key) for key in ("dtype", "shape", "data_offsets"))
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_BITS, _TORCH = attrgetter("bits"), attrgetter("torch")


def _valid_records(header: dict, data_size: int) -> dict[str, TensorInfo] | None:
    """The tensors of a header in which every record is valid and the spans tile the data section exactly,
    or None. Column-wise, in C (map over operator getters): ~1 us per tensor against ~7 for a Python loop,
    which is what keeps a header at the per-file cap well inside the time budget."""
    if not header:
        return {} if data_size == 0 else None
    names, records = list(header), list(header.values())
    try:
        if set(map(type, records)) != {dict}:
            return None
        dtypes = list(map(spec.DTYPE_BY_SAFETENSORS.get, map(_GET_DTYPE, records)))  # TypeError: unhashable
        shapes, offsets = list(map(_GET_SHAPE, records)), list(map(_GET_OFFSETS, records))
        if None in dtypes or set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list}:
            return None
        if max(map(len, shapes)) > MAX_RANK or set(map(len, offsets)) != {2}:
            return None
        dims = list(chain.from_iterable(shapes))
        begins, ends = list(map(_FIRST, offsets)), list(map(_SECOND, offsets))
        if dims and (set(map(type, dims)) != {int} or min(dims) < 0 or max(dims) > MAX_ELEMENTS):
            return None
        if set(map(type, begins)) != {int} or set(map(type, ends)) != {int} or min(begins) < 0 or max(ends) > data_size:
            return None
        sizes = list(map(sub, ends, begins))
        if min(sizes) < 0 or list(map(mul, map(prod, shapes), map(_BITS, dtypes))) != list(map(mul, sizes, repeat(8))):
            return None
    except TypeError:  # an unhashable dtype, or a comparison across types
        return None
    # The spans with bytes tile [0, data_size) exactly iff their sorted begins are 0 and their sorted ends but
    # the last, and the last end is data_size (the span ending first must be the one beginning first, and so
    # on). Sorting ints, not pairs: writers emit them in order, so timsort does one pass.
    starts, stops = sorted(compress(begins, sizes)), sorted(compress(ends, sizes))
    if (starts[:1] != [0] or stops[-1] != data_size or starts[1:] != stops[:-1]) if starts else data_size:
        return None  # an overlap, a hole or uncovered bytes: reported one by one
    if len(starts) < len(sizes):  # zero-size tensors: only at a boundary, not inside another tensor
        boundaries = {0, data_size, *starts}
        if not boundaries.issuperset(compress(begins, map(not_, sizes))):
            return None
    infos = map(tuple.__new__, repeat(TensorInfo), zip(names, map(_TORCH, dtypes), map(tuple, shapes), begins, ends, strict=True))
    return dict(zip(names, infos, strict=True))


def _check_records(header: dict, data_size: int, entry: str, findings: list[Finding]) -> dict[str, TensorInfo]:
    """Record by record: the valid tensors, and a finding for every problem (S002-S006)."""
    tensors: dict[str, TensorInfo] = {}
    dtypes = spec.DTYPE_BY_SAFETENSORS
    for name, info in header.items():
        if type(info) is not dict:
            findings.append(finding("S002", f"{entry}:{name}", "tensor record is not an object"))
            continue
        code = info.get("dtype")
        dtype = dtypes.get(code) if type(code) is str else None
        if dtype is None:
            findings.append(finding("S003", f"{entry}:{name}", f"unknown dtype {code!r}"))
            continue
        shape = info.get("shape")
        if type(shape) is not list or len(shape) > MAX_RANK or not all(type(d) is int and d >= 0 for d in shape):
            findings.append(finding("S004", f"{entry}:{name}", f"shape {shape!r} is not a list of non-negative integers"))
            continue
        numel = 1
        for d in shape:
            numel *= d
            if numel > MAX_ELEMENTS:
                break
        if numel > MAX_ELEMENTS:
            findings.append(finding("S004", f"{entry}:{name}", f"shape {shape} overflows"))
            continue
        offsets = info.get("data_offsets")
        if not (type(offsets) is list and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
            findings.append(finding("S006", f"{entry}:{name}", f"data_offsets {offsets!r} is not two non-negative integers"))
            continue
        begin, end = offsets
        if end < begin or end > data_size:
            findings.append(finding("S006", f"{entry}:{name}", f"data_offsets {offsets} out of bounds (data section is {data_size} bytes)"))
            continue
        bits = numel * dtype.bits
        if bits % 8 or bits // 8 != end - begin:
            findings.append(finding("S005", f"{entry}:{name}", f"{dtype.torch}{shape} needs {bits / 8:g} bytes, span holds {end - begin}"))
            continue
        tensors[name] = TensorInfo(name, dtype.torch, tuple(shape), begin, end)
    position = 0
    for info in sorted(tensors.values(), key=_SPAN):
        if info.begin < position:
            findings.append(finding("S006", f"{entry}:{info.name}", "tensor overlaps another"))
        elif info.begin > position:
            findings.append(finding("S006", f"{entry}:{info.name}", f"{info.begin - position}-byte hole before tensor"))
        position = max(position, info.end)
    if position != data_size and not any(f.code in ("S002", "S003", "S004", "S005", "S006") for f in findings):
        findings.append(finding("S006", entry, f"tensors cover {position} of {data_size} data bytes"))
    return tensors


_SPAN = itemgetter(3, 4)  # TensorInfo (begin, end)


def _cap_name(max_tensors: int) -> str:
    if max_tensors >= spec.MAX_TENSORS_PER_FILE:
        return "the per-file cap"
    return f"what the per-archive cap of {spec.MAX_TENSORS_PER_ARCHIVE} leaves for this file"


def read_safetensors_header(read_at: Callable[[int, int], bytes], entry_offset: int, entry_size: int, entry: str, *,
                            max_tensors: int = spec.MAX_TENSORS_PER_FILE) -> tuple[SafetensorsHeader | None, list[Finding]]:
    """Read and check the header of a safetensors file that occupies ``entry_size`` bytes at ``entry_offset``
    of a source whose ``read_at(offset, length)`` returns bytes; ``max_tensors`` as for :func:`parse_header`."""
    if entry_size < 8:
        return None, [finding("S001", entry, f"{entry_size} bytes cannot hold a safetensors header")]
    header_length = read_header_length(read_at(entry_offset, 8))
    if header_length > spec.SAFETENSORS_MAX_HEADER or 8 + header_length > entry_size:
        return None, [finding("S001", entry, f"header length {header_length} exceeds the entry or 100 MB")]
    raw = read_at(entry_offset + 8, header_length)
    return parse_header(raw, header_length, entry_size, entry, max_tensors=max_tensors)


def checked(header: SafetensorsHeader | None, problems: list[Finding], where: str,
            error: type[Exception] | None = None) -> SafetensorsHeader:
    """The header a :func:`read_safetensors_header` / :func:`parse_header` result holds, or ``error``
    (default :class:`DDUFFormatError`) saying ``where`` is not a valid safetensors file and why."""
    errors = [p for p in problems if p.severity == "error"]
    if header is None or errors:
        raise (error or DDUFFormatError)(f"{where} is not a valid safetensors file: {(errors or problems)[0]}")
    return header


def read_file_header(path: str | os.PathLike, entry: str, error: type[Exception] | None = None) -> SafetensorsHeader:
    """The checked header of the safetensors file at ``path`` (``entry``: its name in findings); reads the
    header only (positioned reads), never the tensor data."""
    opened = open_regular(path)  # a FIFO, device or folder in a file's place is refused, never waited on
    if opened is None:
        raise (error or DDUFFormatError)(f"not a regular file (a FIFO, a device, a folder): {os.fspath(path)}")
    fd, st = opened
    with open(fd, "rb") as f:
        size = st.st_size

        def read_at(offset: int, length: int) -> bytes:
            f.seek(offset)
            return f.read(length)

        header, problems = read_safetensors_header(read_at, 0, size, entry)
    return checked(header, problems, os.fspath(path), error)
