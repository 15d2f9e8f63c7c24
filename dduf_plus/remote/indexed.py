"""Open a remote archive from its tail alone: end records, central directory and dduf_plus index, which the
opening request (an http(s) suffix range) already brought. ``dduf info URL``, ``inspect_dtypes(URL)`` and
hosted references answer in **one** request instead of one more per weights file.

The index is a claim of the archive's writer. It is used only when it agrees with the central directory
(every entry and no other, sizes, CRC-32, each data offset where a local header of that name can put it, no
entry running into the next), each file's tensor records, written back as a safetensors header, pass the
safetensors rules (dtypes, shapes, offsets, coverage, tensor caps) at the index's header length, and the
entry names and ``model_index.json`` pass the DDUF structure rules. Anything
else (no index, a newer format version, one disagreement) falls back to :class:`DDUFArchive`'s full open
over the same source: the bytes already fetched are reused, and the verdict is the one it always gave.

``model_index.json`` is taken from the index's copy of its exact text (``model_index_json``) when that text
has the size, CRC-32 and sha256 the directory and index record for the entry; else from the bytes already
fetched, else with one exact range request (archives written before the index carried it).

What the tail cannot prove is checked when the bytes that hold it arrive: the first read of an entry's bytes
(:meth:`IndexedArchive.read_bytes`) also reads its local header and, for a safetensors file, its header, and
refuses the entry (:class:`DDUFIntegrityError`, rule Z014 or I002) unless they are the ones the index
described. ``dduf validate URL`` never uses this: a validator reads every header itself."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import zlib
from collections.abc import Mapping
from typing import Any

from ..errors import DDUFError, DDUFIntegrityError
from ..format import spec
from ..format.archive import DDUFArchive, Entry
from ..format.findings import Finding
from ..format.safetensors_header import SafetensorsHeader, parse_header, read_safetensors_header
from ..format.structure import check_structure, parse_json
from ..format.zipfmt import ZipEntry, local_header_agrees, place_local_header
from ..storage.prefetch_source import PrefetchSource
from ..storage.source import ByteSource, open_source
from .tail import Tail, read_tail

logger = logging.getLogger(__name__)

__all__ = ["IndexedArchive", "open_indexed"]

_TOGETHER = 1 << 20  # a first read starting this far into an entry brings its headers in the same request


class _SourceReader:
    """A ByteSource as the RangeReader :func:`~dduf_plus.remote.tail.read_tail` takes (the two methods it adds)."""

    def __init__(self, source: ByteSource):
        self.source, self.name, self.size = source, source.name, source.size

    @property
    def bytes_read(self) -> int:
        return self.source.bytes_read

    def read_at(self, offset: int, length: int) -> bytes:
        return self.source.read_at(offset, length)

    def read_into(self, offset: int, out: memoryview) -> None:
        out[:] = self.source.read_at(offset, len(out))

    def remaining(self) -> float:
        return float("inf")  # the source keeps its own deadline

    def close(self) -> None:
        pass  # the caller owns the source


def open_indexed(url: str, **storage_options: Any) -> DDUFArchive:
    """The archive at ``url`` opened from its tail (an :class:`IndexedArchive`) when its index agrees with its
    central directory, else :class:`DDUFArchive`'s full open over the same source (same reads as before).

    Raises what :class:`DDUFArchive` raises (the full open's verdict on an archive the index cannot answer for).
    """
    source = PrefetchSource(open_source(url, **storage_options))
    try:
        opened = _from_tail(source)
    except DDUFError as e:  # the full open gives the verdict, and says it as it always did
        logger.debug("%s: not opened from the index (%s)", url, e)
        opened = None
    except BaseException:
        source.close()
        raise
    return opened if opened is not None else DDUFArchive(source)


def _from_tail(source: PrefetchSource) -> IndexedArchive | None:
    if source.kept(0, source.size) is not None:
        return None  # the whole file is here already: the full open costs no request and checks everything
    tail = read_tail(_SourceReader(source))
    index = tail.dduf_index
    if index is None or index.get("format") != spec.INDEX_FORMAT or index.get("format_version") != spec.INDEX_VERSION:
        return None
    files = index.get("files")
    if not isinstance(files, dict) or not isinstance(index.get("components"), dict):
        return None
    by_name = {r.name: r for r in tail.records}
    if len(by_name) != len(tail.records) or set(files) != set(by_name) - {spec.INDEX_NAME}:
        return None
    entries, headers = _agreeing_entries(tail, files)
    if entries is None or headers is None:
        return None
    model_index = _model_index(source, index, by_name.get(spec.MODEL_INDEX), entries.get(spec.MODEL_INDEX),
                               tail.cd_offset)
    if model_index is None:
        return None
    first = min(tail.records, key=lambda r: r.header_offset).name
    problems = check_structure(list(by_name), model_index, first_entry=first, parsed=True)
    if any(p.severity == "error" for p in problems):
        return None  # the full open says what is wrong, as it always did
    opened = IndexedArchive(source, tail, model_index, entries, headers)
    opened.findings.extend(problems)
    return opened


def _agreeing_entries(tail: Tail, files: Mapping[str, Any]
                      ) -> tuple[dict[str, Entry], dict[str, SafetensorsHeader]] | tuple[None, None]:
    """Every entry placed where the index says, and every safetensors header the index describes, when both
    agree with the directory and the safetensors rules; (None, None) at the first disagreement."""
    records = sorted(tail.records, key=lambda r: r.header_offset)
    ends = [r.header_offset for r in records[1:]] + [tail.cd_offset]
    entries: dict[str, Entry] = {}
    headers: dict[str, SafetensorsHeader] = {}
    tensors_left = spec.MAX_TENSORS_PER_ARCHIVE
    for record, next_start in zip(records, ends, strict=True):
        if record.name == spec.INDEX_NAME:
            continue
        rec = files[record.name]
        offset = _placed(record, rec, next_start)
        if offset is None:
            return None, None
        sha = rec.get("sha256")
        entries[record.name] = Entry(record.name, offset, record.size, record.crc32, sha if isinstance(sha, str) else None)
        if record.name.endswith(".safetensors"):
            header = _indexed_header(record.name, rec, offset, record.size, tensors_left)
            if header is None:
                return None, None
            headers[record.name] = header
            tensors_left -= len(header.tensors)
    return entries, headers


def _placed(record: ZipEntry, rec: Any, next_start: int) -> int | None:
    """Where the index puts ``record``'s data, when a local header naming it could (its extra field is at
    most 64 KiB) and size and CRC-32 are the directory's; else None."""
    if not isinstance(rec, dict):
        return None
    offset, size, crc = rec.get("offset"), rec.get("size"), rec.get("crc32")
    head_end = record.header_offset + spec.LOCAL_HEADER_SIZE + len(record.name.encode("utf-8", "surrogateescape"))
    if type(offset) is not int or type(size) is not int or size != record.size:
        return None
    if crc is not None and crc != f"{record.crc32:08x}":
        return None
    if not head_end <= offset <= head_end + spec.U16_MAX or offset + size > next_start:
        return None
    return offset


def _indexed_header(name: str, rec: Mapping[str, Any], offset: int, size: int, cap: int) -> SafetensorsHeader | None:
    """The header the index describes for safetensors entry ``name``, checked by the safetensors rules as if
    the file held it (at the index's header length); None when it would break one."""
    data_at, tensors = rec.get("tensor_data_offset"), rec.get("tensors")
    if type(data_at) is not int or not isinstance(tensors, dict) or not offset + 8 <= data_at <= offset + size:
        return None
    header_length, allowed = data_at - offset - 8, min(spec.MAX_TENSORS_PER_FILE, cap)
    if header_length > spec.SAFETENSORS_MAX_HEADER or len(tensors) > allowed:
        return None
    out: dict[str, Any] = {}
    for tname, t in tensors.items():
        if not isinstance(t, dict) or t.get("dtype") not in spec.DTYPE_BY_TORCH:
            return None
        begin, nbytes = t.get("offset"), t.get("nbytes")
        if type(begin) is not int or type(nbytes) is not int:
            return None
        out[tname] = {"dtype": spec.DTYPE_BY_TORCH[t["dtype"]].safetensors, "shape": t.get("shape"),
                      "data_offsets": [begin - data_at, begin - data_at + nbytes]}
    metadata = rec.get("metadata")
    if metadata is not None:
        out["__metadata__"] = metadata
    raw = json.dumps(out, separators=(",", ":")).encode()
    if len(raw) > header_length:
        return None
    header, problems = parse_header(raw.ljust(header_length), header_length, size, name,
                                    max_tensors=allowed)
    if header is None or any(p.severity == "error" for p in problems):
        return None
    return header


def _model_index(source: PrefetchSource, index: Mapping[str, Any], record: ZipEntry | None,
                 entry: Entry | None, cd_offset: int) -> dict[str, Any] | None:
    """model_index.json's object: the index's copy of its text when that is the entry's (size, CRC-32, sha256),
    else its bytes (already fetched, or one exact range request; the local header is checked with them)."""
    if record is None or entry is None:
        return None
    budget = spec.json_budget(spec.MODEL_INDEX)
    if budget is not None and entry.length > budget.bytes:
        return None
    text = index.get("model_index_json")
    raw = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else None
    if raw is None or not _is_entry(raw, entry):
        head = source.read_at(record.header_offset, entry.offset + entry.length - record.header_offset)
        if _local_header_problem(head, record, entry.offset, cd_offset) is not None:
            return None
        raw = head[entry.offset - record.header_offset:]
        if zlib.crc32(raw) != entry.crc32:
            return None
    value, problems = parse_json(raw, spec.MODEL_INDEX, code="D002")
    return value if not problems and isinstance(value, dict) else None


def _is_entry(raw: bytes, entry: Entry) -> bool:
    """``raw`` has the entry's recorded size, CRC-32 and sha256 (no sha256 recorded: not provably the entry)."""
    return (entry.sha256 is not None and len(raw) == entry.length and zlib.crc32(raw) == entry.crc32
            and hashlib.sha256(raw).hexdigest() == entry.sha256.lower())


class _Blob:
    """A ByteSource over ``data`` fetched from ``at``: a read outside it raises :class:`_Outside`."""

    def __init__(self, at: int, data: bytes):
        self.name, self.at, self.data, self.size, self.bytes_read = "<fetched>", at, data, at + len(data), 0

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < self.at or offset + length > self.at + len(self.data):
            raise _Outside
        return self.data[offset - self.at:offset - self.at + length]

    def close(self) -> None:
        pass


class _Outside(Exception):
    pass


def _local_header_problem(head: bytes, record: ZipEntry, data_offset: int, cd_offset: int) -> str | None:
    """Why ``head`` (the bytes from ``record``'s local header on) is not a local header that the full open
    accepts for it (the validator's own checks: name, method, flags, CRC-32 and sizes) with its data at
    ``data_offset``, or None."""
    findings: list[Finding] = []
    blob = _Blob(record.header_offset, head)
    try:
        placed = place_local_header(blob, record, cd_offset, findings)
        agrees = placed is not None and local_header_agrees(blob, record, placed[0], findings)
    except _Outside:
        return f"its local header at byte {record.header_offset} does not end where the index places its data (I002)"
    errors = [f for f in findings if f.severity == "error"]
    if errors or placed is None or not agrees:
        return f"{errors[0].message} ({errors[0].code})" if errors else "its local header is not the directory's (Z014)"
    if placed[1] != data_offset:
        return f"the index places its data at {data_offset}, its local header at {placed[1]} (I002)"
    return None


class IndexedArchive(DDUFArchive):
    """A :class:`DDUFArchive` opened from the tail: entries placed and safetensors headers taken from the index
    (checked against the central directory). Each entry's local header, and a safetensors file's header, are
    checked against what the index said by the first read of its bytes, before those bytes are returned."""

    answered_from_index = True

    def __init__(self, source: PrefetchSource, tail: Tail, model_index: dict[str, Any], entries: dict[str, Entry],
                 headers: dict[str, SafetensorsHeader]):
        # DDUFArchive.__init__ is not called: it would read every local and safetensors header
        self._source: ByteSource = source
        self.path = source.name
        self._mmap = None
        self.findings = []
        self.headers = headers
        self.model_index = model_index
        self.stored_index = tail.dduf_index
        self._entries = entries
        self._components = None
        self._records = {r.name: r for r in tail.records}
        self._cd_offset = tail.cd_offset
        self._checked: set[str] = set()
        self._lock = threading.Lock()

    def read_bytes(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        """As :meth:`DDUFArchive.read_bytes`; the entry's first read checks its local header (and safetensors
        header) against the index, in the same request when the read starts near the entry's start."""
        e = self.entry(name)
        length = e.length - offset if length is None else length
        with self._lock:
            checked = name in self._checked
        if checked or offset < 0 or length < 0 or offset + length > e.length:
            return super().read_bytes(name, offset, length)  # (refuses a read outside the entry)
        record, header = self._records[name], self.headers.get(name)
        together = offset <= _TOGETHER  # near the start: the headers and the bytes asked in one request
        end = max(header.data_start if header is not None else 0, offset + length if together else 0)
        blob = self._source.read_at(record.header_offset, e.offset + end - record.header_offset)
        self._check_entry(name, record, e, blob)
        with self._lock:
            self._checked.add(name)
        if not together:
            return super().read_bytes(name, offset, length)
        start = e.offset - record.header_offset + offset
        return blob[start:start + length]

    def _check_entry(self, name: str, record: ZipEntry, e: Entry, blob: bytes) -> None:
        where = f"{self.path}: entry {name!r}"
        problem = _local_header_problem(blob, record, e.offset, self._cd_offset)
        if problem is not None:
            raise DDUFIntegrityError(f"{where}: {problem}; refused")
        expected = self.headers.get(name)
        if expected is None:
            return
        data = blob[e.offset - record.header_offset:]
        found, problems = read_safetensors_header(lambda at, n: data[at:at + n], 0, e.length, name)
        if (found is None or any(p.severity == "error" for p in problems) or found.header_length != expected.header_length
                or found.tensors != expected.tensors):
            raise DDUFIntegrityError(f"{where}: its safetensors header is not the one the index records (I002); "
                                     "refused")
