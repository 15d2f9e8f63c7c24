"""The tail of a remote archive: end records, central directory and the dduf_plus index, read in one or
two range requests. Their bytes (and the size) are the archive's content key: the index holds every
entry's sha256, so equal keys mean equal archives. Only what the fetch needs is parsed here; the full
structural check happens when the fetched file is opened as a :class:`~dduf_plus.format.archive.DDUFArchive`."""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, NamedTuple

from ..errors import DDUFIntegrityError
from ..format import spec
from ..format.zipfmt import _zip64_values, parse_extra
from .readers import RangeReader

SUFFIX = 256 << 10  # first guess at the tail: end records, directory and index of most archives
MAX_TAIL = spec.MAX_CENTRAL_DIRECTORY + (16 << 20) + (1 << 20)


class CentralRecord(NamedTuple):
    name: str
    header_offset: int
    size: int
    crc32: int


class Tail(NamedTuple):
    start: int  # first byte of the tail (the index's local header, else the central directory)
    data: bytes  # bytes [start, size)
    cd_offset: int
    records: list[CentralRecord]
    dduf_index: dict[str, Any] | None  # the parsed dduf_plus index (None: none, or unreadable)
    key: str  # sha256 of the size and the tail bytes
    fetched_at: int = 0  # every byte read, from here to the end (the first guess may reach before ``start``)
    fetched: bytes = b""

    def file_records(self) -> dict[str, dict[str, Any]]:
        files = (self.dduf_index or {}).get("files")
        return files if isinstance(files, dict) else {}


def content_key(size: int, data: bytes) -> str:
    return hashlib.sha256(size.to_bytes(8, "little") + data).hexdigest()


def _bad(url: str, why: str) -> DDUFIntegrityError:
    return DDUFIntegrityError(f"{url}: not a readable DDUF archive: {why}")


def _end_records(url: str, size: int, suffix: bytes) -> tuple[int, int, int]:
    """(entries, cd_offset, cd_size) from the end records in ``suffix`` (the file's last bytes)."""
    base = size - len(suffix)
    at = suffix.rfind(struct.pack("<I", spec.SIG_EOCD))
    if at < 0 or at + spec.EOCD_SIZE > len(suffix):
        raise _bad(url, f"no end-of-central-directory record in the last {len(suffix)} bytes")
    _, _, _, _, n, cd_size, cd_offset, _ = struct.unpack_from(spec.EOCD_FMT, suffix, at)
    loc = at - spec.LOCATOR_SIZE
    if loc >= 0 and int.from_bytes(suffix[loc:loc + 4], "little") == spec.SIG_EOCD64_LOCATOR:
        _, _, eocd64, _ = struct.unpack_from(spec.LOCATOR_FMT, suffix, loc)
        if not base <= eocd64 <= base + loc - spec.EOCD64_SIZE:
            raise _bad(url, "the ZIP64 end record is not where its locator says")
        fields = struct.unpack_from(spec.EOCD64_FMT, suffix, eocd64 - base)
        if fields[0] != spec.SIG_EOCD64:
            raise _bad(url, "the ZIP64 locator points to no ZIP64 end record")
        n, cd_size, cd_offset = fields[7], fields[8], fields[9]
    if cd_offset + cd_size > size or n > spec.MAX_ENTRIES or cd_size > spec.MAX_CENTRAL_DIRECTORY:
        raise _bad(url, f"the central directory ({cd_size} bytes at {cd_offset}, {n} entries) is out of bounds")
    return n, cd_offset, cd_size


def _walk(url: str, cd: bytes, n: int) -> list[CentralRecord]:
    out, at = [], 0
    for i in range(n):
        if at + spec.CENTRAL_HEADER_SIZE > len(cd):
            raise _bad(url, f"the central directory ends inside record {i}")
        fields = struct.unpack_from(spec.CENTRAL_HEADER_FMT, cd, at)
        if fields[0] != spec.SIG_CENTRAL:
            raise _bad(url, f"central directory record {i} has a bad signature")
        crc, usize, nlen, xlen, clen, offset = fields[7], fields[9], fields[10], fields[11], fields[12], fields[16]
        name = cd[at + 46:at + 46 + nlen].decode("utf-8", "replace")
        extra = parse_extra(cd[at + 46 + nlen:at + 46 + nlen + xlen]) or {}
        wanted = [k for k, v in (("usize", usize), ("csize", fields[8]), ("offset", offset)) if v == spec.U32_MAX]
        if wanted:
            values = _zip64_values(extra.get(spec.EXTRA_ZIP64, b""), wanted) or {}
            usize, offset = values.get("usize", usize), values.get("offset", offset)
        out.append(CentralRecord(name, offset, usize, crc))
        at += spec.CENTRAL_HEADER_SIZE + nlen + xlen + clen
    return out


def local_data_offset(url: str, header: bytes, header_offset: int) -> int:
    """Where an entry's data starts, from the first bytes of its local header."""
    if len(header) < spec.LOCAL_HEADER_SIZE or int.from_bytes(header[:4], "little") != spec.SIG_LOCAL:
        raise _bad(url, f"no local header at {header_offset}")
    nlen, xlen = struct.unpack_from("<HH", header, 26)
    return header_offset + spec.LOCAL_HEADER_SIZE + nlen + xlen


def read_tail(reader: RangeReader, start_hint: int | None = None) -> Tail:
    """Read and parse the tail: one request when the end records, directory and index fit in the first
    guess (``start_hint``: where the tail began the last time), else two."""
    url, size = reader.url, reader.size
    start = max(0, size - SUFFIX) if start_hint is None or not 0 <= start_hint < size else start_hint
    data = reader.read(start, size - start)
    n, cd_offset, cd_size = _end_records(url, size, data[-min(len(data), 1 << 16 | spec.EOCD_SIZE):])
    if cd_offset < start:  # the directory did not fit in the guess
        if size - cd_offset > MAX_TAIL:
            raise _bad(url, "the central directory is too large")
        data = reader.read(cd_offset, start - cd_offset) + data
        start = cd_offset
    records = _walk(url, data[cd_offset - start:cd_offset - start + cd_size], n)
    index_record = max(records, key=lambda r: r.header_offset, default=None)
    index = None
    if index_record is not None and index_record.name == spec.INDEX_NAME and index_record.size <= 16 << 20:
        if index_record.header_offset < start:
            data = reader.read(index_record.header_offset, start - index_record.header_offset) + data
            start = index_record.header_offset
        index = _parse_index(url, data, start, index_record)
        start = index_record.header_offset
    fetched_at, fetched = size - len(data), data
    data = data[start - fetched_at:]
    return Tail(start, data, cd_offset, records, index, content_key(size, data), fetched_at, fetched)


def _parse_index(url: str, data: bytes, start: int, record: CentralRecord) -> dict[str, Any] | None:
    at = record.header_offset - start
    offset = local_data_offset(url, data[at:at + spec.LOCAL_HEADER_SIZE], record.header_offset) - start
    raw = data[offset:offset + record.size]
    import zlib

    if zlib.crc32(raw) != record.crc32:
        raise DDUFIntegrityError(f"{url}: entry {spec.INDEX_NAME!r} does not match its CRC-32 (bytes "
                                 f"{start + offset}-{start + offset + record.size - 1}: damaged or changed)")
    try:
        index = json.loads(raw)
    except (ValueError, RecursionError):
        return None  # the archive check reports it (I001); the fetch then verifies by CRC-32 only
    return index if isinstance(index, dict) else None
