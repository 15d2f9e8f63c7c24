"""The rules a fetched archive's entries meet as their bytes arrive (used by :mod:`.transfer`): one
:class:`Entry` per central directory entry, placed by its local header (checked against the central directory
and the index), hashed block by block, and judged once its last byte came: the index's sha256 where the index
pins it, else the central directory's CRC-32 (damage only), the sha256 recorded either way. No threads, no
files: the fetch hands in the bytes and keeps the locks."""

from __future__ import annotations

import hashlib
import struct
import threading
import zlib
from typing import TYPE_CHECKING

from ..errors import DDUFError, DDUFFormatError, DDUFIntegrityError, DDUFIOError
from ..format import spec
from .tail import MAX_LOCAL_SLACK, Tail

if TYPE_CHECKING:  # pragma: no cover
    from ..format.zipfmt import ZipEntry

HASH_BLOCK = 8 << 20  # bytes hashed at once (the hasher releases the GIL: other threads receive meanwhile)


class EntryMismatch(DDUFIntegrityError):
    """An entry's bytes do not match its hash: this transfer went wrong (a resume fetches the entry again);
    the archive itself is not refused for it. Callers see a plain :class:`DDUFIntegrityError`
    (:func:`public_error`)."""


class Entry:
    """One central directory entry being verified as its bytes arrive: placed once its local header is
    here, then hashed in order up to ``upto``. ``sha256`` is the index's (checked), else None (the CRC-32
    is checked and the sha256 recorded)."""

    def __init__(self, record: ZipEntry, sha256: str | None, index_offset: int | None):
        self.name, self.size, self.crc32, self.header_offset = record.name, record.size, record.crc32, record.header_offset
        self.name_bytes = record.name.encode("utf-8")
        self.head_end = record.header_offset + spec.LOCAL_HEADER_SIZE + len(self.name_bytes)
        self.offset: int | None = None  # the first data byte, once the local header has arrived
        self.end = self.head_end + MAX_LOCAL_SLACK + record.size  # an upper bound until then
        self.upto = self.end
        self.sha256, self.index_offset = sha256, index_offset
        self.hasher = hashlib.sha256()
        self.crc = 0
        self.digest: str | None = None
        self.ok = False
        self.lock = threading.Lock()  # one thread hashes an entry at a time


def make_entries(url: str, tail: Tail) -> list[Entry]:
    """Every central directory entry, in archive order, with what the index says of it (checked against the
    directory)."""
    files = tail.file_records()
    out = []
    for record in tail.records:
        info = files.get(record.name)
        info = info if isinstance(info, dict) else {}
        offset, size = info.get("offset"), info.get("size", record.size)
        if size != record.size or not (offset is None or isinstance(offset, int)):
            raise DDUFIntegrityError(f"{url}: the index and the central directory disagree about entry "
                                     f"{record.name!r} (I002)")
        out.append(Entry(record, tail.indexed_sha256(record.name), offset))
    return sorted(out, key=lambda e: e.header_offset)


def place(entry: Entry, head: bytes, url: str, cd_offset: int) -> None:
    """Where ``entry``'s data starts, from its local header's bytes ``head`` (``header_offset`` to
    ``head_end``), checked against the central directory's name and, where the index records one, the
    index's offset; ``entry`` is then hashed from there."""
    fields = struct.unpack_from(spec.LOCAL_HEADER_FMT, head) if len(head) >= spec.LOCAL_HEADER_SIZE else None
    where = f"{url}: entry {entry.name!r}"
    if (fields is None or fields[0] != spec.SIG_LOCAL or fields[9] != len(entry.name_bytes)
            or head[spec.LOCAL_HEADER_SIZE:] != entry.name_bytes):
        raise DDUFIntegrityError(f"{where}: no local header naming it at byte {entry.header_offset} (Z014)")
    offset = entry.head_end + fields[10]
    if offset + entry.size > cd_offset:
        raise DDUFIntegrityError(f"{where}: its data runs into the central directory (Z017)")
    if entry.index_offset is not None and entry.index_offset != offset:
        raise DDUFIntegrityError(f"{where}: the index places its data at {entry.index_offset}, its local "
                                 f"header at {offset} (I002)")
    entry.offset, entry.end, entry.upto = offset, offset + entry.size, offset


def hash_block(entry: Entry, block: memoryview) -> None:
    """The next ``block`` of ``entry``'s data into its hashes."""
    entry.hasher.update(block)  # releases the GIL: other threads receive meanwhile
    if entry.sha256 is None:  # no sha256 to check: the CRC-32 (damage), and the sha256 is recorded
        entry.crc = zlib.crc32(block, entry.crc)
    entry.upto += len(block)


def mismatch(entry: Entry, url: str, digest: str) -> EntryMismatch | None:
    """Why ``entry``, hashed to its end (sha256 ``digest``), is refused; None when it matches."""
    good = digest == entry.sha256 if entry.sha256 is not None else entry.crc == entry.crc32
    if good:
        return None
    what = "sha256 in the index" if entry.sha256 is not None else "CRC-32 in the central directory"
    return EntryMismatch(f"{url}: entry {entry.name!r} (bytes {entry.offset}-{entry.end - 1}) does not match its "
                         f"{what}: the server sent other bytes than the archive records")


def refused(error: BaseException | None) -> bool:
    """The archive itself is refused (its tail, its structure once opened, a local header): nothing of it is
    worth keeping. A mismatching entry, an I/O error or an interrupt keeps the partial for a resume."""
    return isinstance(error, DDUFFormatError) and not isinstance(error, EntryMismatch)


def public_error(error: BaseException) -> BaseException:
    """What a caller of the fetch catches for ``error``: a :class:`DDUFError` (the private mismatch kind only
    steers the resume)."""
    if isinstance(error, EntryMismatch):
        return DDUFIntegrityError(str(error))
    return error if isinstance(error, DDUFError) else DDUFIOError(f"fetch failed: {type(error).__name__}: {error}")
