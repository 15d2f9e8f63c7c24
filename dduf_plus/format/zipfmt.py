"""ZIP structures for DDUF: parse (end records, ZIP64 records, central directory, local headers, all
cross-checked) and build (aligned local headers, central directory, end records).

Parsing never raises on bad bytes: it returns what it could read plus :class:`Finding` records, and
stops early only when nothing further can be trusted."""

from __future__ import annotations

import re
import struct
import unicodedata
from typing import NamedTuple

from . import spec
from .findings import Finding, finding
from .source import ByteSource


class ZipEntry(NamedTuple):
    name: str
    header_offset: int  # local header
    data_offset: int  # first byte of the entry's data
    size: int
    crc32: int
    method: int
    flags: int
    zip64: bool  # a ZIP64 extra field is present in the central record


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


def parse_layout(source: ByteSource) -> tuple[ZipLayout | None, list[Finding]]:
    """Read and cross-check every ZIP structure of ``source``. Reads only records, never entry data."""
    findings: list[Finding] = []
    size = source.size
    if size < spec.EOCD_SIZE:
        return None, [finding("Z001", None, f"file is {size} bytes: too small to be a ZIP archive")]

    # End record: the fast path is a comment-free archive, the only kind DDUF writers produce.
    tail = source.read_at(size - spec.EOCD_SIZE, spec.EOCD_SIZE)
    eocd_offset = size - spec.EOCD_SIZE
    if int.from_bytes(tail[:4], "little") != spec.SIG_EOCD:
        window = min(size, spec.EOCD_SIZE + spec.MAX_COMMENT)
        tail = source.read_at(size - window, window)
        at = tail.rfind(struct.pack("<I", spec.SIG_EOCD))
        if at < 0:
            return None, [finding("Z001", None, "no end-of-central-directory record in the last 64 KiB")]
        eocd_offset = size - window + at
        tail = tail[at : at + spec.EOCD_SIZE]
        if len(tail) < spec.EOCD_SIZE:
            return None, [finding("Z001", None, "end-of-central-directory record is truncated")]
    _, disk, cd_disk, n_here, n_total, cd_size, cd_offset, comment_len = struct.unpack(spec.EOCD_FMT, tail)
    trailing = size - (eocd_offset + spec.EOCD_SIZE)
    if trailing:
        what = f"a {trailing}-byte archive comment" if comment_len == trailing else f"{trailing} bytes"
        findings.append(finding("Z002", None, f"{what} after the end record"))

    zip64_end = False
    needs64 = spec.U16_MAX in (n_here, n_total) or spec.U32_MAX in (cd_size, cd_offset)
    end_of_cd = eocd_offset  # where the central directory must end
    if eocd_offset >= spec.LOCATOR_SIZE:
        locator = source.read_at(eocd_offset - spec.LOCATOR_SIZE, spec.LOCATOR_SIZE)
        if int.from_bytes(locator[:4], "little") == spec.SIG_EOCD64_LOCATOR:
            _, disk64, eocd64_offset, total_disks = struct.unpack(spec.LOCATOR_FMT, locator)
            if disk64 != 0 or total_disks > 1:
                return None, findings + [finding("Z004", None, "archive spans several disks")]
            if eocd64_offset + spec.EOCD64_SIZE > eocd_offset - spec.LOCATOR_SIZE:
                return None, findings + [finding("Z003", None, "ZIP64 end record offset is out of bounds")]
            rec = source.read_at(eocd64_offset, spec.EOCD64_SIZE)
            sig, rec_size, _, _, disk, cd_disk, n64_here, n64_total, cd64_size, cd64_offset = struct.unpack(
                spec.EOCD64_FMT, rec
            )
            if sig != spec.SIG_EOCD64:
                return None, findings + [finding("Z003", None, "ZIP64 locator points to no ZIP64 end record")]
            if eocd64_offset + 12 + rec_size != eocd_offset - spec.LOCATOR_SIZE:
                return None, findings + [
                    finding("Z003", None, "ZIP64 end record is not directly before its locator")
                ]
            if n64_here != n64_total:
                return None, findings + [finding("Z004", None, "entry counts differ per disk")]
            for short, long, label in ((n_total, n64_total, "entry count"), (cd_size, cd64_size, "central directory size"), (cd_offset, cd64_offset, "central directory offset")):
                full = spec.U16_MAX if label == "entry count" else spec.U32_MAX
                if short != full and short != long:
                    findings.append(finding("Z003", None, f"{label} differs between the end records ({short} vs {long})"))
            n_total, cd_size, cd_offset = n64_total, cd64_size, cd64_offset
            end_of_cd = eocd64_offset
            zip64_end = True
    if needs64 and not zip64_end:
        return None, findings + [finding("Z003", None, "end record needs ZIP64 values but no ZIP64 end record exists")]
    if disk != 0 or cd_disk != 0 or n_here != n_total and not zip64_end:
        return None, findings + [finding("Z004", None, "archive spans several disks")]

    # Central directory: bounded before being read.
    if n_total > spec.MAX_ENTRIES:
        return None, findings + [finding("Z005", None, f"{n_total} entries is more than the {spec.MAX_ENTRIES} allowed")]
    if cd_size > spec.MAX_CENTRAL_DIRECTORY or cd_size < n_total * spec.CENTRAL_HEADER_SIZE:
        return None, findings + [finding("Z005", None, f"central directory size {cd_size} cannot hold {n_total} entries")]
    if cd_offset + cd_size > end_of_cd:
        return None, findings + [finding("Z005", None, "central directory runs past the end records")]
    if cd_offset + cd_size < end_of_cd:
        findings.append(finding("Z016", None, f"{end_of_cd - cd_offset - cd_size} bytes between the central directory and the end records"))
    cd = source.read_at(cd_offset, cd_size)

    entries: list[ZipEntry] = []
    seen: dict[str, int] = {}
    folded: dict[str, str] = {}
    at = 0
    for i in range(n_total):
        if at + spec.CENTRAL_HEADER_SIZE > len(cd):
            return None, findings + [finding("Z005", None, f"central directory ends inside record {i}")]
        (sig, made_by, _needed, flags, method, _time, _date, crc, csize, usize, nlen, xlen, clen, disk_start,
         _int_attr, ext_attr, header_offset) = struct.unpack_from(spec.CENTRAL_HEADER_FMT, cd, at)
        if sig != spec.SIG_CENTRAL:
            return None, findings + [finding("Z006", None, f"central directory record {i} has a bad signature")]
        end = at + spec.CENTRAL_HEADER_SIZE + nlen + xlen + clen
        if end > len(cd):
            return None, findings + [finding("Z005", None, f"central directory record {i} runs past the directory")]
        name_bytes = cd[at + 46 : at + 46 + nlen]
        extra = cd[at + 46 + nlen : at + 46 + nlen + xlen]
        at = end
        if nlen > spec.MAX_NAME_BYTES:
            findings.append(finding("Z007", None, f"entry {i} has a {nlen}-byte name"))
            continue
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
            continue
        wanted = [k for k, v in (("usize", usize), ("csize", csize), ("offset", header_offset)) if v == spec.U32_MAX]
        if disk_start == spec.U16_MAX:
            wanted.append("disk")
        zip64 = spec.EXTRA_ZIP64 in fields
        if wanted:
            values = _zip64_values(fields.get(spec.EXTRA_ZIP64, b""), wanted)
            if values is None:
                findings.append(finding("Z003", label, "ZIP64 extra field missing or too short"))
                continue
            usize, csize = values.get("usize", usize), values.get("csize", csize)
            header_offset, disk_start = values.get("offset", header_offset), values.get("disk", disk_start)
        if disk_start != 0:
            findings.append(finding("Z004", label, "entry starts on another disk"))
            continue
        if flags & (spec.FLAG_ENCRYPTED | spec.FLAG_STRONG_ENCRYPTION | spec.FLAG_MASKED_HEADER):
            findings.append(finding("Z012", label, "entry is encrypted"))
        if method != spec.METHOD_STORED:
            findings.append(finding("Z011", label, f"compression method {method} (DDUF requires 0, STORED)"))
        if csize != usize:
            findings.append(finding("Z019", label, f"sizes differ: {csize} stored vs {usize} uncompressed"))
        if (made_by >> 8) == spec.MADE_BY_UNIX and (ext_attr >> 16) & spec.S_IFMT in (spec.S_IFLNK, spec.S_IFDIR):
            kind = "symbolic link" if (ext_attr >> 16) & spec.S_IFMT == spec.S_IFLNK else "directory"
            findings.append(finding("Z013", label, f"entry is a {kind}"))
        if not zip64:
            findings.append(finding("Z018", label, "entry has no ZIP64 extra field"))
        if name is None:
            continue
        if name in seen:
            findings.append(finding("Z009", name, "entry name appears more than once"))
            continue
        seen[name] = i
        key = unicodedata.normalize("NFC", name).casefold()
        if key in folded:
            findings.append(finding("Z010", name, f"collides with {folded[key]!r} after case folding / NFC"))
        folded.setdefault(key, name)
        entries.append(ZipEntry(name, header_offset, -1, usize, crc, method, flags, zip64))
    if at != len(cd):
        findings.append(finding("Z016", None, f"{len(cd) - at} unexplained bytes inside the central directory"))

    return ZipLayout(_check_local_headers(source, entries, cd_offset, findings), cd_offset, cd_size, zip64_end), findings


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
        if entry.header_offset + spec.LOCAL_HEADER_SIZE > cd_offset:
            findings.append(finding("Z017", entry.name, "local header lies past the central directory"))
            continue
        head = source.read_at(entry.header_offset, spec.LOCAL_HEADER_SIZE)
        sig, _ver, flags, method, _t, _d, crc, csize, usize, nlen, xlen = struct.unpack(spec.LOCAL_HEADER_FMT, head)
        if sig != spec.SIG_LOCAL:
            findings.append(finding("Z014", entry.name, "no local header where the central directory points"))
            continue
        data_offset = entry.header_offset + spec.LOCAL_HEADER_SIZE + nlen + xlen
        if data_offset > cd_offset:
            findings.append(finding("Z017", entry.name, "local header runs past the central directory"))
            continue
        end = data_offset + entry.size
        if end > cd_offset:
            findings.append(finding("Z017", entry.name, "entry data runs into the central directory or past the file"))
            continue
        if entry.header_offset < position:
            findings.append(finding("Z015", entry.name, "entry overlaps the previous one"))
            position = max(position, end)  # its bytes are accounted for (as an error), not foreign
            continue
        rest = source.read_at(entry.header_offset + spec.LOCAL_HEADER_SIZE, nlen + xlen)
        local_name, extra = rest[:nlen], rest[nlen:]
        if local_name != entry.name.encode("utf-8"):
            findings.append(finding("Z014", entry.name, f"local header names it {local_name.decode('utf-8', 'replace')!r}"))
            continue
        if method != entry.method:
            findings.append(finding("Z014", entry.name, "local header and central directory disagree on the method"))
        if (flags ^ entry.flags) & ~spec.FLAG_UTF8 & 0xFFFF:
            findings.append(finding("Z014", entry.name, "local header and central directory disagree on the flags"))
        if not flags & spec.FLAG_DATA_DESCRIPTOR:
            if spec.U32_MAX in (csize, usize):
                fields = parse_extra(extra) or {}
                wanted = [k for k, v in (("usize", usize), ("csize", csize)) if v == spec.U32_MAX]
                values = _zip64_values(fields.get(spec.EXTRA_ZIP64, b""), wanted)
                if values is None:
                    findings.append(finding("Z014", entry.name, "local ZIP64 extra field missing or too short"))
                    continue
                usize, csize = values.get("usize", usize), values.get("csize", csize)
            if crc != entry.crc32 or usize != entry.size or csize != entry.size:
                findings.append(finding("Z014", entry.name, "local header and central directory disagree on CRC-32 or sizes"))
                continue
        if entry.header_offset > position:
            where = "before the first entry" if position == 0 else "before this entry"
            findings.append(finding("Z016", entry.name, f"{entry.header_offset - position} foreign bytes {where}"))
        if flags & spec.FLAG_DATA_DESCRIPTOR:
            end += _descriptor_size(source, end, cd_offset)
        position = end
        checked.append(entry._replace(data_offset=data_offset, flags=entry.flags | (flags & spec.FLAG_DATA_DESCRIPTOR)))
    if checked and position < cd_offset:
        findings.append(finding("Z016", None, f"{cd_offset - position} foreign bytes before the central directory"))
    order = {e.name: i for i, e in enumerate(entries)}
    return sorted(checked, key=lambda e: order[e.name])  # central directory order, as before


def _descriptor_size(source: ByteSource, at: int, limit: int) -> int:
    head = source.read_at(at, min(4, limit - at))
    signed = len(head) == 4 and int.from_bytes(head, "little") == spec.SIG_DATA_DESCRIPTOR
    # 32- or 64-bit sizes: take what fits; gap detection reports the rest.
    for size in ((24, 16) if signed else (20, 12)):
        if at + size <= limit:
            return size
    return 0


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
