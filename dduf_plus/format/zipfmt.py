"""ZIP structures for DDUF: parse (end records, ZIP64 records, central directory, local headers, all
cross-checked) and build (aligned local headers, central directory, end records).

Parsing never raises on bad bytes: it returns what it could read plus :class:`Finding` records, and
stops early only when nothing further can be trusted."""

from __future__ import annotations

import itertools
import re
import struct
import unicodedata
from collections.abc import Callable
from typing import NamedTuple

from ..storage.source import ByteSource
from . import spec
from .findings import Finding, finding


class ZipEntry(NamedTuple):
    name: str
    header_offset: int  # local header
    data_offset: int  # first byte of the entry's data
    size: int
    crc32: int
    method: int
    flags: int
    zip64: bool  # a ZIP64 extra field is present in the central record
    # bytes the entry's data takes in the file: ``size`` when STORED, the compressed size otherwise (a
    # compressed entry, Z011, still has a place: its neighbours are checked against it, never against ``size``)
    stored_size: int = -1

    @property
    def span(self) -> int:
        return self.size if self.stored_size < 0 else self.stored_size

    @property
    def compressed(self) -> bool:
        return self.method != spec.METHOD_STORED


# Called with the vetted entries and the central directory's offset, before any local header is read.
DirectoryHook = Callable[[list[ZipEntry], int], None]


class ZipLayout(NamedTuple):
    entries: list[ZipEntry]
    cd_offset: int
    cd_size: int
    zip64_end: bool


def _u16(data: bytes, at: int) -> int:
    return data[at] | (data[at + 1] << 8)


def parse_extra(extra: bytes) -> dict[int, bytes] | None:
    """Split an extra field into {header id: payload}; None when it is malformed."""
    fields: dict[int, bytes] = {}
    at = 0
    while at < len(extra):
        if at + 4 > len(extra):
            return None
        header_id, length = _u16(extra, at), _u16(extra, at + 2)
        if at + 4 + length > len(extra):
            return None
        fields.setdefault(header_id, extra[at + 4 : at + 4 + length])
        at += 4 + length
    return fields


def _zip64_values(payload: bytes, wanted: list[str]) -> dict[str, int] | None:
    """The ZIP64 extra field holds, in order, those of usize/csize/offset/disk whose 32-bit slot is full."""
    out: dict[str, int] = {}
    at = 0
    for key in wanted:
        width = 4 if key == "disk" else 8
        if at + width > len(payload):
            return None
        out[key] = int.from_bytes(payload[at : at + width], "little")
        at += width
    return out


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DOT_SEGMENT = re.compile(r"(?:^|/)\.{0,2}(?:/|$)")  # an empty, '.' or '..' path segment


def check_name(name_bytes: bytes, flags: int) -> tuple[str | None, list[Finding]]:
    """Decode and vet an entry name: UTF-8, no control characters, relative, '/'-separated, no '..'."""
    shown = name_bytes.decode("utf-8", "backslashreplace")
    try:
        name = name_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return None, [finding("Z007", shown, "entry name is not valid UTF-8")]
    if _CONTROL.search(name):
        return None, [finding("Z007", repr(name), "entry name holds NUL or control characters")]
    if "\\" in name or name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return None, [finding("Z008", name, "entry name is absolute or uses backslashes")]
    if not name or name.endswith("/"):
        return None, [finding("Z013", name, "directory records are not allowed in DDUF")]
    if _DOT_SEGMENT.search(name):
        return None, [finding("Z008", name, "entry name has empty, '.' or '..' path segments")]
    return name, []


class _Directory(NamedTuple):
    """Where the end records say the central directory lies."""

    entry_count: int
    cd_offset: int
    cd_size: int
    end_of_cd: int  # where the central directory must end: the ZIP64 end record, else the end record
    zip64_end: bool


class _CentralRecord(NamedTuple):
    """The fixed 46 bytes of a central directory record, as stored (ZIP64 values not yet applied)."""

    sig: int
    made_by: int
    needed: int
    flags: int
    method: int
    time: int
    date: int
    crc32: int
    csize: int
    usize: int
    name_len: int
    extra_len: int
    comment_len: int
    disk_start: int
    int_attr: int
    ext_attr: int
    header_offset: int


def parse_layout(source: ByteSource, before_local_headers: DirectoryHook | None = None,
                 ) -> tuple[ZipLayout | None, list[Finding]]:
    """Read and cross-check every ZIP structure of ``source``. Reads only records, never entry data.

    Steps: end records (and ZIP64 end records) -> bounded central directory -> one vetted entry per
    central record -> local headers, in file order. A step returns None when nothing after it can be
    trusted; the findings so far are returned either way. ``before_local_headers(entries, cd_offset)`` runs once
    the central directory is parsed (:func:`dduf_plus.format.open_plan.prefetch_hook` plans a remote source's
    reads there), so that this module knows nothing of planning."""
    findings: list[Finding] = []
    directory = read_end_records(source, findings)
    if directory is None:
        return None, findings
    cd = read_central_directory(source, directory, findings)
    if cd is None:
        return None, findings
    entries = parse_central_directory(cd, directory.entry_count, findings)
    if entries is None:
        return None, findings
    if before_local_headers is not None:  # e.g. a remote source fetching what comes next in merged requests
        before_local_headers(entries, directory.cd_offset)
    checked = _check_local_headers(source, entries, directory.cd_offset, findings)
    return ZipLayout(checked, directory.cd_offset, directory.cd_size, directory.zip64_end), findings


# --- end records -------------------------------------------------------------------------------------
def _not_zip(source: ByteSource, jargon: str) -> str:
    """Z001's message: what the file is instead (a safetensors checkpoint, JSON, an empty file...) and what
    to do, when its first bytes say so (:mod:`.sniff`); else ``jargon``, the ZIP-level fact."""
    from .sniff import HEAD_BYTES, non_zip_kind

    what = non_zip_kind(source.read_at(0, min(HEAD_BYTES, source.size)), source.size, str(getattr(source, "name", "")))
    return f"the file is {what}" if what else f"{jargon}: the file is truncated or not a DDUF archive"


def _find_end_record(source: ByteSource, findings: list[Finding]) -> tuple[int, bytes] | None:
    """(offset, bytes) of the end-of-central-directory record; reports trailing bytes (Z002)."""
    size = source.size
    if size < spec.EOCD_SIZE:
        findings.append(finding("Z001", None, _not_zip(source, f"file is {size} bytes: too small to be a ZIP archive")))
        return None
    # The fast path is a comment-free archive, the only kind DDUF writers produce.
    eocd_offset = size - spec.EOCD_SIZE
    record = source.read_at(eocd_offset, spec.EOCD_SIZE)
    if int.from_bytes(record[:4], "little") != spec.SIG_EOCD:
        window = min(size, spec.EOCD_SIZE + spec.MAX_COMMENT)
        tail = source.read_at(size - window, window)
        at = tail.rfind(struct.pack("<I", spec.SIG_EOCD))
        if at < 0:
            findings.append(finding("Z001", None, _not_zip(source, "no end-of-central-directory record in the last 64 KiB")))
            return None
        eocd_offset = size - window + at
        record = tail[at : at + spec.EOCD_SIZE]
        if len(record) < spec.EOCD_SIZE:
            findings.append(finding("Z001", None, "end-of-central-directory record is truncated"))
            return None
    comment_len = struct.unpack(spec.EOCD_FMT, record)[-1]
    trailing = size - (eocd_offset + spec.EOCD_SIZE)
    if trailing:
        what = f"a {trailing}-byte archive comment" if comment_len == trailing else f"{trailing} bytes"
        findings.append(finding("Z002", None, f"{what} after the end record", eocd_offset + spec.EOCD_SIZE))
    elif comment_len:  # a comment longer than the file: zipfile ignores it, Go's archive/zip refuses the file
        findings.append(finding("Z002", None, f"the end record declares a {comment_len}-byte archive comment, "
                                "but the file ends right after it", eocd_offset + spec.EOCD_SIZE - 2))
    return eocd_offset, record


def read_end_records(source: ByteSource, findings: list[Finding]) -> _Directory | None:
    """The end record, and the ZIP64 end record when a locator precedes it: where the central directory is."""
    found = _find_end_record(source, findings)
    if found is None:
        return None
    eocd_offset, record = found
    _, disk, cd_disk, n_here, n_total, cd_size, cd_offset, _ = struct.unpack(spec.EOCD_FMT, record)
    directory = _Directory(n_total, cd_offset, cd_size, eocd_offset, zip64_end=False)
    if eocd_offset >= spec.LOCATOR_SIZE:
        locator = source.read_at(eocd_offset - spec.LOCATOR_SIZE, spec.LOCATOR_SIZE)
        if int.from_bytes(locator[:4], "little") == spec.SIG_EOCD64_LOCATOR:
            return _read_zip64_end(source, locator, directory, findings)
    if spec.U16_MAX in (n_here, n_total) or spec.U32_MAX in (cd_size, cd_offset):
        findings.append(finding("Z003", None, "end record needs ZIP64 values but no ZIP64 end record exists"))
        return None
    if disk != 0 or cd_disk != 0 or n_here != n_total:
        findings.append(finding("Z004", None, "archive spans several disks"))
        return None
    return directory


def _read_zip64_end(source: ByteSource, locator: bytes, short: _Directory, findings: list[Finding]) -> _Directory | None:
    """The ZIP64 end record ``locator`` points to, cross-checked with the 32-bit end record ``short``."""
    _, disk64, eocd64_offset, total_disks = struct.unpack(spec.LOCATOR_FMT, locator)
    locator_offset = short.end_of_cd - spec.LOCATOR_SIZE
    if disk64 != 0 or total_disks > 1:
        findings.append(finding("Z004", None, "archive spans several disks"))
        return None
    if eocd64_offset + spec.EOCD64_SIZE > locator_offset:
        findings.append(finding("Z003", None, "ZIP64 end record offset is out of bounds"))
        return None
    record = source.read_at(eocd64_offset, spec.EOCD64_SIZE)
    sig, rec_size, _, _, disk, cd_disk, n64_here, n64_total, cd64_size, cd64_offset = struct.unpack(
        spec.EOCD64_FMT, record
    )
    if sig != spec.SIG_EOCD64:
        findings.append(finding("Z003", None, "ZIP64 locator points to no ZIP64 end record"))
        return None
    if eocd64_offset + 12 + rec_size != locator_offset:
        findings.append(finding("Z003", None, "ZIP64 end record is not directly before its locator"))
        return None
    if n64_here != n64_total:
        findings.append(finding("Z004", None, "entry counts differ per disk"))
        return None
    for value, value64, label, full in (
        (short.entry_count, n64_total, "entry count", spec.U16_MAX),
        (short.cd_size, cd64_size, "central directory size", spec.U32_MAX),
        (short.cd_offset, cd64_offset, "central directory offset", spec.U32_MAX),
    ):
        if value != full and value != value64:
            findings.append(finding("Z003", None, f"{label} differs between the end records ({value} vs {value64})"))
    if disk != 0 or cd_disk != 0:
        findings.append(finding("Z004", None, "archive spans several disks"))
        return None
    return _Directory(n64_total, cd64_offset, cd64_size, eocd64_offset, zip64_end=True)


# --- central directory -------------------------------------------------------------------------------
def read_central_directory(source: ByteSource, directory: _Directory, findings: list[Finding]) -> bytes | None:
    """The central directory's bytes, bounded (entry count, size, position) before they are read."""
    n_total, cd_offset, cd_size, end_of_cd = directory.entry_count, directory.cd_offset, directory.cd_size, directory.end_of_cd
    if n_total > spec.MAX_ENTRIES:
        findings.append(finding("Z005", None, f"{n_total} entries is more than the {spec.MAX_ENTRIES} allowed"))
        return None
    if cd_size > spec.MAX_CENTRAL_DIRECTORY or cd_size < n_total * spec.CENTRAL_HEADER_SIZE:
        findings.append(finding("Z005", None, f"central directory size {cd_size} cannot hold {n_total} entries"))
        return None
    if cd_offset + cd_size > end_of_cd:
        findings.append(finding("Z005", None, "central directory runs past the end records"))
        return None
    if cd_offset + cd_size < end_of_cd:
        findings.append(finding("Z016", None, f"{end_of_cd - cd_offset - cd_size} bytes between the central directory and the end records"))
    return source.read_at(cd_offset, cd_size)


def parse_central_directory(cd: bytes, count: int, findings: list[Finding]) -> list[ZipEntry] | None:
    """One entry per sound central record with a unique name, in directory order; None when a record
    cannot be delimited (nothing after it can be found)."""
    entries: list[ZipEntry] = []
    seen: set[str] = set()
    folded: dict[str, str] = {}  # NFC + casefold key -> first name with it
    at = 0
    for i in range(count):
        if at + spec.CENTRAL_HEADER_SIZE > len(cd):
            findings.append(finding("Z005", None, f"central directory ends inside record {i}"))
            return None
        record = _CentralRecord._make(struct.unpack_from(spec.CENTRAL_HEADER_FMT, cd, at))
        if record.sig != spec.SIG_CENTRAL:
            findings.append(finding("Z006", None, f"central directory record {i} has a bad signature"))
            return None
        name_at = at + spec.CENTRAL_HEADER_SIZE
        extra_at = name_at + record.name_len
        at = extra_at + record.extra_len + record.comment_len
        if at > len(cd):
            findings.append(finding("Z005", None, f"central directory record {i} runs past the directory"))
            return None
        if record.name_len > spec.MAX_NAME_BYTES:
            findings.append(finding("Z007", None, f"entry {i} has a {record.name_len}-byte name"))
            continue
        entry = _vet_central_record(record, cd[name_at:extra_at], cd[extra_at : extra_at + record.extra_len], findings)
        if entry is not None and _is_new_name(entry.name, seen, folded, findings):
            entries.append(entry)
    if at != len(cd):
        findings.append(finding("Z016", None, f"{len(cd) - at} unexplained bytes inside the central directory"))
    return entries


def _vet_central_record(record: _CentralRecord, name_bytes: bytes, extra: bytes,
                        findings: list[Finding]) -> ZipEntry | None:
    """The entry ``record`` (with its name and extra field) describes, after the name, ZIP64, disk and
    DDUF-rule checks; None when it has no usable name or its sizes/offset cannot be known."""
    flags = record.flags
    name, problems = check_name(name_bytes, flags)
    findings.extend(problems)
    if name is not None and not flags & spec.FLAG_UTF8 and not name.isascii():
        # zipfile (so huggingface_hub) decodes such a name as CP437: readers would disagree on it.
        findings.append(finding("Z020", name, "non-ASCII name without the UTF-8 flag (bit 11): other "
                                f"readers see {name_bytes.decode('cp437')!r}"))
    label = name or name_bytes.decode("utf-8", "backslashreplace")
    fields = parse_extra(extra)
    if fields is None:
        findings.append(finding("Z006", label, "extra field is malformed"))
        return None
    sizes = _central_zip64(record, fields, label, findings)
    if sizes is None:
        return None
    usize, csize, header_offset = sizes
    _check_dduf_rules(record, csize, usize, label, findings)
    zip64 = spec.EXTRA_ZIP64 in fields
    if not zip64:
        findings.append(finding("Z018", label, "entry has no ZIP64 extra field"))
    if name is None:
        return None
    return ZipEntry(name, header_offset, -1, usize, record.crc32, record.method, flags, zip64, csize)


# The ZIP64 extra field holds, in this order, those values whose 32-bit (disk: 16-bit) slot is full:
# {(usize full, csize full, offset full, disk full): the keys to read}.
# A table, not a list built per record: the central directory may hold 10,000 of them.
_ZIP64_SLOTS = {
    full: [key for key, is_full in zip(("usize", "csize", "offset", "disk"), full, strict=True) if is_full]
    for full in itertools.product((False, True), repeat=4)
}


def _central_zip64(record: _CentralRecord, fields: dict[int, bytes], label: str,
                   findings: list[Finding]) -> tuple[int, int, int] | None:
    """(usize, csize, header offset) with full 32-bit slots taken from the ZIP64 extra field; None (reported)
    when that field is missing or short, or the entry starts on another disk."""
    usize, csize, header_offset, disk_start = record.usize, record.csize, record.header_offset, record.disk_start
    wanted = _ZIP64_SLOTS[usize == spec.U32_MAX, csize == spec.U32_MAX, header_offset == spec.U32_MAX,
                          disk_start == spec.U16_MAX]
    if wanted:
        values = _zip64_values(fields.get(spec.EXTRA_ZIP64, b""), wanted)
        if values is None:
            findings.append(finding("Z003", label, "ZIP64 extra field missing or too short"))
            return None
        usize, csize = values.get("usize", usize), values.get("csize", csize)
        header_offset, disk_start = values.get("offset", header_offset), values.get("disk", disk_start)
    if disk_start != 0:
        findings.append(finding("Z004", label, "entry starts on another disk"))
        return None
    return usize, csize, header_offset


def _check_dduf_rules(record: _CentralRecord, csize: int, usize: int, label: str, findings: list[Finding]) -> None:
    """What DDUF forbids in an otherwise sound record: encryption, compression, links and directories."""
    if record.flags & (spec.FLAG_ENCRYPTED | spec.FLAG_STRONG_ENCRYPTION | spec.FLAG_MASKED_HEADER):
        findings.append(finding("Z012", label, "entry is encrypted"))
    if record.method != spec.METHOD_STORED:
        findings.append(finding("Z011", label, f"compression method {record.method} (DDUF requires 0, STORED)"))
    if csize != usize and record.method == spec.METHOD_STORED:  # compressed: Z011 says what is wrong
        findings.append(finding("Z019", label, f"sizes differ: {csize} stored vs {usize} uncompressed"))
    mode = (record.ext_attr >> 16) & spec.S_IFMT
    if (record.made_by >> 8) == spec.MADE_BY_UNIX and mode in (spec.S_IFLNK, spec.S_IFDIR):
        kind = "symbolic link" if mode == spec.S_IFLNK else "directory"
        findings.append(finding("Z013", label, f"entry is a {kind}"))


def _is_new_name(name: str, seen: set[str], folded: dict[str, str], findings: list[Finding]) -> bool:
    """False (Z009) for a repeated name; a name equal to an earlier one after NFC + case folding is kept
    but reported (Z010)."""
    if name in seen:
        findings.append(finding("Z009", name, "entry name appears more than once"))
        return False
    seen.add(name)
    key = unicodedata.normalize("NFC", name).casefold()
    if key in folded:
        findings.append(finding("Z010", name, f"collides with {folded[key]!r} after case folding / NFC"))
    folded.setdefault(key, name)
    return True


# --- local headers -----------------------------------------------------------------------------------
def _check_local_headers(source: ByteSource, entries: list[ZipEntry], cd_offset: int, findings: list[Finding]) -> list[ZipEntry]:
    """Read every local header once, in file order; compare it with its central record; check the entries
    tile ``[0, cd_offset)``: no prefix (polyglots), no overlap, no holes.

    An entry that overlaps the one before is reported (Z015) and dropped as soon as its fixed 30-byte
    header says where it ends, before its name and extra field are read: so the bytes read (and every later
    read of entry data: configs, safetensors headers) add up to at most the file's size, however many
    central records point into the same bytes. An entry whose data runs past the central directory is
    dropped too: nothing may read its bytes."""
    checked: list[ZipEntry] = []
    position = 0  # end of the bytes the entries so far account for
    for entry in sorted(entries, key=lambda e: e.header_offset):
        placed = place_local_header(source, entry, cd_offset, findings)
        if placed is None:
            continue
        head, data_offset, end = placed
        if entry.header_offset < position:
            findings.append(finding("Z015", entry.name, "entry overlaps the previous one", entry.header_offset))
            position = max(position, end)  # its bytes are accounted for (as an error), not foreign
            continue
        if not local_header_agrees(source, entry, head, findings):
            continue
        if entry.header_offset > position:
            where = "before the first entry" if position == 0 else "before this entry"
            findings.append(finding("Z016", entry.name, f"{entry.header_offset - position} foreign bytes {where}",
                                    position))
        descriptor = head[2] & spec.FLAG_DATA_DESCRIPTOR
        if descriptor:
            size, agrees = _read_descriptor(source, entry, end, cd_offset)
            if not agrees:  # readers that stream local records take the descriptor's values: a differential
                findings.append(finding("Z014", entry.name, "data descriptor and central directory disagree on "
                                        "CRC-32 or sizes", end))
            end += size
            if not agrees:
                position = end
                continue
        position = end
        checked.append(entry._replace(data_offset=data_offset, flags=entry.flags | descriptor))
    if checked and position < cd_offset:
        findings.append(finding("Z016", None, f"{cd_offset - position} foreign bytes before the central directory",
                                position))
    order = {e.name: i for i, e in enumerate(entries)}
    return sorted(checked, key=lambda e: order[e.name])  # central directory order, as before


def place_local_header(source: ByteSource, entry: ZipEntry, cd_offset: int,
                        findings: list[Finding]) -> tuple[tuple, int, int] | None:
    """(the fixed header's fields, data offset, data end) when ``entry``'s local header and data lie before
    the central directory; None (reported) otherwise. Reads the fixed 30 bytes only."""
    if entry.header_offset + spec.LOCAL_HEADER_SIZE > cd_offset:
        findings.append(finding("Z017", entry.name, "local header lies past the central directory", entry.header_offset))
        return None
    head = struct.unpack(spec.LOCAL_HEADER_FMT, source.read_at(entry.header_offset, spec.LOCAL_HEADER_SIZE))
    if head[0] != spec.SIG_LOCAL:
        findings.append(finding("Z014", entry.name, "no local header where the central directory points",
                                entry.header_offset))
        return None
    data_offset = entry.header_offset + spec.LOCAL_HEADER_SIZE + head[9] + head[10]  # + name + extra
    if data_offset > cd_offset:
        findings.append(finding("Z017", entry.name, "local header runs past the central directory",
                                entry.header_offset))
        return None
    end = data_offset + entry.span
    if end > cd_offset:
        findings.append(finding("Z017", entry.name, "entry data runs into the central directory or past the file",
                                data_offset))
        return None
    return head, data_offset, end


def local_header_agrees(source: ByteSource, entry: ZipEntry, head: tuple, findings: list[Finding]) -> bool:
    """Compare the local header (fixed fields ``head``, then its name and extra, read here) with the central
    record: a different name, or CRC-32/sizes (when no data descriptor defers them), is fatal to the entry;
    method or flags differing only reported."""
    _sig, _ver, flags, method, _t, _d, crc, csize, usize, nlen, xlen = head
    rest = source.read_at(entry.header_offset + spec.LOCAL_HEADER_SIZE, nlen + xlen)
    local_name, extra = rest[:nlen], rest[nlen:]
    at = entry.header_offset
    if local_name != entry.name.encode("utf-8"):
        findings.append(finding("Z014", entry.name, f"local header names it {local_name.decode('utf-8', 'replace')!r}",
                                at))
        return False
    if method != entry.method:
        findings.append(finding("Z014", entry.name, "local header and central directory disagree on the method", at))
    if (flags ^ entry.flags) & ~spec.FLAG_UTF8 & 0xFFFF:
        findings.append(finding("Z014", entry.name, "local header and central directory disagree on the flags", at))
    deferred = bool(flags & spec.FLAG_DATA_DESCRIPTOR)  # CRC-32 and sizes follow the data (checked there)
    if spec.U32_MAX in (csize, usize):
        fields = parse_extra(extra) or {}
        wanted = [k for k, v in (("usize", usize), ("csize", csize)) if v == spec.U32_MAX]
        values = _zip64_values(fields.get(spec.EXTRA_ZIP64, b""), wanted)
        if values is None and not deferred:
            findings.append(finding("Z014", entry.name, "local ZIP64 extra field missing or too short", at))
            return False
        usize, csize = (0, 0) if values is None else (values.get("usize", usize), values.get("csize", csize))
    if deferred and crc == csize == usize == 0:
        return True
    if crc != entry.crc32 or usize != entry.size or csize != entry.span:
        findings.append(finding("Z014", entry.name, "local header and central directory disagree on CRC-32 or sizes",
                                at))
        return False
    return True


def _read_descriptor(source: ByteSource, entry: ZipEntry, at: int, limit: int) -> tuple[int, bool]:
    """(size, agrees) of the data descriptor at ``at``: signed or not, 32- or 64-bit sizes (ZIP64 entries
    first), the form whose CRC-32 and sizes are the central record's. When none is (the descriptor lies),
    the smallest size its signature allows (a larger guess would make the next entry overlap it and drop
    an honest neighbour), within ``limit``; gap detection reports what is left."""
    head = source.read_at(at, min(24, limit - at))
    signed = len(head) >= 4 and int.from_bytes(head[:4], "little") == spec.SIG_DATA_DESCRIPTOR
    for skip in ((4, 0) if signed else (0,)):  # an unsigned descriptor whose CRC-32 is the signature's value
        body = head[skip:]
        for width in ((8, 4) if entry.zip64 else (4, 8)):
            size = 4 + 2 * width
            if len(body) < size:
                continue
            crc, csize = int.from_bytes(body[:4], "little"), int.from_bytes(body[4 : 4 + width], "little")
            if (crc, csize, int.from_bytes(body[4 + width : size], "little")) == (entry.crc32, entry.span, entry.size):
                return size + skip, True
    return min(12 + 4 * signed, limit - at), False


# --- writing -----------------------------------------------------------------------------------------
def local_header(name: bytes, size: int, crc: int, padding: int) -> bytes:
    """A STORED local header with a ZIP64 extra (both sizes) and ``padding`` bytes of alignment extra."""
    extra = struct.pack("<HHQQ", spec.EXTRA_ZIP64, 16, size, size)
    if padding:
        extra += struct.pack("<HHH", spec.EXTRA_ALIGN, padding - 4, spec.TENSOR_ALIGNMENT) + bytes(padding - 6)
    return struct.pack(
        spec.LOCAL_HEADER_FMT, spec.SIG_LOCAL, spec.ZIP_VERSION, spec.FLAG_UTF8, spec.METHOD_STORED,
        spec.DOS_TIME, spec.DOS_DATE, crc, spec.U32_MAX, spec.U32_MAX, len(name), len(extra),
    ) + name + extra


def local_header_padding(header_offset: int, name_len: int, inner_offset: int, alignment: int) -> int:
    """Extra-field padding so that byte ``inner_offset`` of the entry's data lands on ``alignment``."""
    unpadded = header_offset + spec.LOCAL_HEADER_SIZE + name_len + 20 + inner_offset
    padding = -unpadded % alignment
    while 0 < padding < spec.EXTRA_ALIGN_MIN:
        padding += alignment
    return padding


def central_header(name: bytes, size: int, crc: int, header_offset: int) -> bytes:
    extra = struct.pack("<HHQQQ", spec.EXTRA_ZIP64, 24, size, size, header_offset)
    return struct.pack(
        spec.CENTRAL_HEADER_FMT, spec.SIG_CENTRAL, (spec.MADE_BY_UNIX << 8) | spec.ZIP_VERSION, spec.ZIP_VERSION,
        spec.FLAG_UTF8, spec.METHOD_STORED, spec.DOS_TIME, spec.DOS_DATE, crc, spec.U32_MAX, spec.U32_MAX,
        len(name), len(extra), 0, 0, 0, spec.UNIX_FILE_MODE << 16, spec.U32_MAX,
    ) + name + extra


def end_records(n_entries: int, cd_offset: int, cd_size: int) -> bytes:
    eocd64_offset = cd_offset + cd_size
    eocd64 = struct.pack(
        spec.EOCD64_FMT, spec.SIG_EOCD64, spec.EOCD64_SIZE - 12, (spec.MADE_BY_UNIX << 8) | spec.ZIP_VERSION,
        spec.ZIP_VERSION, 0, 0, n_entries, n_entries, cd_size, cd_offset,
    )
    locator = struct.pack(spec.LOCATOR_FMT, spec.SIG_EOCD64_LOCATOR, 0, eocd64_offset, 1)
    eocd = struct.pack(spec.EOCD_FMT, spec.SIG_EOCD, 0, 0, spec.U16_MAX, spec.U16_MAX, spec.U32_MAX, spec.U32_MAX, 0)
    return eocd64 + locator + eocd
