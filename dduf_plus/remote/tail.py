"""The tail of a remote archive: end records, central directory and the dduf_plus index, read in one or
two range requests, parsed and checked *before* anything is written for it.

The checks are the validator's own ZIP rules (:mod:`dduf_plus.format.zipfmt`: end records, bounded
central directory, names, STORED only, no encryption) plus what the directory alone proves about the file:
``model_index.json`` is there (D001) and the entries, at their declared sizes, tile the whole file with
no room for foreign bytes (Z015/Z016/Z017). So a server's ``Content-Range`` size is believed only once
the archive's own records account for every byte of it: a server cannot make a fetch preallocate 2 GiB
for a file whose directory lists 1 KB.

**What identifies the archive** (:attr:`Tail.key`, the name of its cache file): when the index records a
sha256 for every entry, the tail's bytes (with the size) pin every entry's content, so the key is
``sha256(size + tail)`` and the cache file may serve any URL whose tail is equal (each entry is checked
against that sha256 as it arrives). Otherwise (no index, an index missing entries or hashes) the entries
are known only by their CRC-32, which an adversary forges with 4 bytes: the key then also covers the URL
(:attr:`Tail.shared` is False), so bytes fetched from one URL never serve another."""

from __future__ import annotations

import hashlib
import re
import zlib
from typing import Any, NamedTuple

from ..errors import DDUFIntegrityError, DDUFValidationError
from ..format import spec
from ..format.findings import Finding, finding
from ..format.structure import parse_json

# The validator's ZIP record checks, applied to the tail's bytes alone (no entry data is read).
from ..format.zipfmt import ZipEntry, parse_central_directory, read_central_directory, read_end_records
from ..storage.http_range import SUFFIX_BYTES
from .readers import RangeReader

# First guess at the tail: end records, directory and index of most archives. The same span an http(s) reader's
# opening request (a suffix range) already brought: reading it sends nothing, and what lies before the tail
# (all of a small archive) is entry data the fetch keeps.
SUFFIX = SUFFIX_BYTES
MAX_TAIL = spec.MAX_CENTRAL_DIRECTORY + (16 << 20) + (1 << 20)
MAX_INDEX = 16 << 20
MAX_LOCAL_SLACK = spec.U16_MAX + 24  # a local header's extra field, and a data descriptor, past its fixed part
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class Tail(NamedTuple):
    start: int  # first byte of the tail (the index's local header, else the central directory)
    data: bytes  # bytes [start, size)
    cd_offset: int
    records: list[ZipEntry]  # central directory records (``data_offset`` unknown: -1)
    dduf_index: dict[str, Any] | None  # the parsed dduf_plus index (None: none, or unreadable)
    key: str  # the cache file's name: see the module docstring
    fetched_at: int = 0  # every byte read, from here to the end (the first guess may reach before ``start``)
    fetched: bytes = b""
    shared: bool = False  # the index holds a sha256 for every entry: the key may serve several URLs

    def file_records(self) -> dict[str, dict[str, Any]]:
        files = (self.dduf_index or {}).get("files")
        return files if isinstance(files, dict) else {}

    def indexed_sha256(self, name: str) -> str | None:
        """The sha256 the index records for entry ``name`` (lower-case hex), or None."""
        record = self.file_records().get(name)
        sha = record.get("sha256") if isinstance(record, dict) else None
        return sha.lower() if isinstance(sha, str) and _SHA256.match(sha.lower()) else None


def content_key(size: int, data: bytes) -> str:
    """The key of an archive whose tail pins every entry by sha256: equal for every URL serving it."""
    return hashlib.sha256(size.to_bytes(8, "little") + data).hexdigest()


def url_key(url: str, size: int, data: bytes) -> str:
    """The key of any other archive: its URL, size and tail (never equal to a :func:`content_key`)."""
    raw = url.encode("utf-8", "surrogatepass")
    return hashlib.sha256(b"dduf_plus.remote.url-bound\0" + len(raw).to_bytes(8, "little") + raw
                          + size.to_bytes(8, "little") + data).hexdigest()


class _TailBytes:
    """A :class:`~dduf_plus.storage.source.ByteSource` over the fetched suffix ``[at, size)`` of the file:
    reading before it is an error (the parsers then know the tail guess was short)."""

    def __init__(self, url: str, size: int, at: int, data: bytes):
        self.name, self.size, self.at, self.data, self.bytes_read = url, size, at, data, 0

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < self.at or length < 0 or offset + length > self.size:
            raise _Short(offset)
        return self.data[offset - self.at:offset - self.at + length]

    def close(self) -> None:
        pass


class _Short(Exception):
    """A parser asked for bytes before the fetched suffix (``offset``)."""

    def __init__(self, offset: int):
        super().__init__(offset)
        self.offset = offset


def _refuse(url: str, findings: list[Finding]) -> DDUFValidationError:
    return DDUFValidationError(f"{url} (its tail, checked before anything is fetched)", findings)


def _directory(url: str, reader: RangeReader, start: int, data: bytes) -> tuple[int, bytes, list[ZipEntry], int]:
    """(start, data, records, cd_offset): the end records and directory, validated; ``data`` grows to cover
    the directory when the first guess was short (one more request)."""
    size = reader.size
    findings: list[Finding] = []
    try:
        directory = read_end_records(_TailBytes(url, size, start, data), findings)
    except _Short:  # it looked before the guess: no end record in the last 22 bytes (DDUF has no comment)
        directory = None
        findings.append(finding("Z001", None, "no end-of-central-directory record at the end of the file"))
    if directory is None or any(f.severity == "error" for f in findings):
        raise _refuse(url, findings)
    if directory.cd_offset < start:  # the directory did not fit in the guess
        if size - directory.cd_offset > MAX_TAIL or directory.cd_size > spec.MAX_CENTRAL_DIRECTORY:
            raise _refuse(url, [finding("Z005", None, f"central directory of {directory.cd_size} bytes at "
                                        f"{directory.cd_offset} is out of bounds")])
        data = reader.read_at(directory.cd_offset, start - directory.cd_offset) + data
        start = directory.cd_offset
    cd = read_central_directory(_TailBytes(url, size, start, data), directory, findings)
    records = parse_central_directory(cd, directory.entry_count, findings) if cd is not None else None
    findings.extend(_check_tiling(records or [], directory.cd_offset))
    if records is None or any(f.severity == "error" for f in findings):
        raise _refuse(url, findings)
    return start, data, records, directory.cd_offset


def _check_tiling(records: list[ZipEntry], cd_offset: int) -> list[Finding]:
    """What the central directory alone proves: model_index.json is listed, and the entries at their declared
    sizes tile ``[0, cd_offset)``: the first at 0, each local header and data (whose extra field adds at
    most 64 KiB) ending at or before the next, none leaving more room than an extra field could fill."""
    out: list[Finding] = []
    if not any(r.name == spec.MODEL_INDEX for r in records):
        out.append(finding("D001", None, "the central directory lists no model_index.json: not a DDUF archive"))
    position = 0  # the least end of the entries so far
    for record in sorted(records, key=lambda r: r.header_offset):
        if record.header_offset < position:
            out.append(finding("Z015", record.name, "entry overlaps the previous one (by the central directory)"))
        elif record.header_offset > position + (MAX_LOCAL_SLACK if position else 0):
            out.append(finding("Z016", record.name, f"{record.header_offset - position} bytes before this entry "
                                                    "that no ZIP record accounts for"))
        position = record.header_offset + spec.LOCAL_HEADER_SIZE + len(record.name.encode()) + record.size
        if position > cd_offset:
            out.append(finding("Z017", record.name, "entry data runs into the central directory or past the file"))
    if records and position + MAX_LOCAL_SLACK < cd_offset:
        out.append(finding("Z016", None, f"{cd_offset - position} bytes before the central directory that no ZIP "
                                         "record accounts for"))
    return out[:50]


def local_data_offset(url: str, header: bytes, header_offset: int) -> int:
    """Where an entry's data starts, from the first bytes of its local header."""
    if len(header) < spec.LOCAL_HEADER_SIZE or int.from_bytes(header[:4], "little") != spec.SIG_LOCAL:
        raise DDUFIntegrityError(f"{url}: not a readable DDUF archive: no local header at {header_offset}")
    nlen, xlen = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
    return header_offset + spec.LOCAL_HEADER_SIZE + nlen + xlen


def read_tail(reader: RangeReader, start_hint: int | None = None) -> Tail:
    """Read, check and parse the tail: no request beyond an http(s) reader's opening (its suffix range holds
    the first guess), one for other readers, when the end records, directory and index fit in the first
    guess (``start_hint``: where the tail began the last time: exactly that), else one or two more.

    Raises:
        DDUFValidationError: the tail breaks a ZIP or DDUF rule (the findings carry the codes).
        DDUFIntegrityError: the index entry does not match its CRC-32.
    """
    url, size = reader.name, reader.size
    start = max(0, size - SUFFIX) if start_hint is None or not 0 <= start_hint < size else start_hint
    data = reader.read_at(start, size - start)
    start, data, records, cd_offset = _directory(url, reader, start, data)
    index_record = max(records, key=lambda r: r.header_offset, default=None)
    index = None
    if index_record is not None and index_record.name == spec.INDEX_NAME and index_record.size <= MAX_INDEX:
        if index_record.header_offset < start:
            data = reader.read_at(index_record.header_offset, start - index_record.header_offset) + data
            start = index_record.header_offset
        index = _parse_index(url, data, start, index_record, cd_offset)
        start = index_record.header_offset
    fetched_at, fetched = size - len(data), data
    data = data[start - fetched_at:]
    shared = _pins_every_entry(index, records)
    key = content_key(size, data) if shared else url_key(url, size, data)
    return Tail(start, data, cd_offset, records, index, key, fetched_at, fetched, shared)


def _pins_every_entry(index: dict[str, Any] | None, records: list[ZipEntry]) -> bool:
    """True when the index records a well-formed sha256 and the directory's size for every other entry."""
    files = (index or {}).get("files")
    if not isinstance(files, dict):
        return False
    for record in records:
        if record.name == spec.INDEX_NAME:
            continue
        rec = files.get(record.name)
        if not isinstance(rec, dict):
            return False
        sha = rec.get("sha256")
        if not (isinstance(sha, str) and _SHA256.match(sha.lower()) and rec.get("size") == record.size):
            return False
    return True


def _parse_index(url: str, data: bytes, start: int, record: ZipEntry, cd_offset: int) -> dict[str, Any] | None:
    at = record.header_offset - start
    offset = local_data_offset(url, data[at:at + spec.LOCAL_HEADER_SIZE], record.header_offset) - start
    if start + offset + record.size > cd_offset:
        raise _refuse(url, [finding("Z017", spec.INDEX_NAME, "entry data runs into the central directory")])
    raw = data[offset:offset + record.size]
    if zlib.crc32(raw) != record.crc32:
        raise DDUFIntegrityError(f"{url}: entry {spec.INDEX_NAME!r} does not match its CRC-32 (bytes "
                                 f"{start + offset}-{start + offset + record.size - 1}: damaged or changed)")
    index, problems = parse_json(raw, spec.INDEX_NAME, code="I001")  # the validator's budgeted parse (D013)
    return index if not problems and isinstance(index, dict) else None  # else opening reports it; no key sharing
