"""The ``.dduf.zst`` stream layout, described once (:mod:`.zst` writes and decodes it):

    [header]  skippable frame (magic 0x184D2A50): b"DDUF+ZST", version, total size, frame size
    [frame]*  independent zstd frames, one per ``frame_size`` bytes of input, each with its content size
              and XXH64 content checksum (the decoder verifies it)
    [table]   zstd "seekable format" seek table (skippable frame 0x184D2A5E + footer, magic 0x8F92EAB1):
              compressed and decompressed size of every frame above (the header frame included, as 0 bytes)

The header and table are built here, and read back with every number checked against the file's size
(:func:`read_layout`); a stream without them (the ``zstd`` CLI's) is walked frame by frame from its headers
alone (:func:`walk_frames`), which proves it is not truncated without decoding it."""

from __future__ import annotations

import logging
import os
import struct
from typing import Any, NamedTuple

from ..errors import DDUFError, DDUFFormatError
from .fd_io import pread_upto

logger = logging.getLogger(__name__)

def zstd_module() -> Any:
    """The ``zstandard`` module (imported when a ``.zst`` is first met)."""
    try:
        import zstandard
    except ImportError:  # a declared dependency; only a broken install gets here
        raise DDUFError("the zstandard package is needed for .zst archives: pip install zstandard") from None
    return zstandard


SKIPPABLE_HEADER_MAGIC = 0x184D2A50
SKIPPABLE_SEEK_TABLE_MAGIC = 0x184D2A5E
SEEKABLE_MAGIC = 0x8F92EAB1
SEEK_FOOTER_SIZE = 9  # u32 number of frames, u8 descriptor, u32 magic
SEEK_ENTRY = struct.Struct("<II")  # compressed size, decompressed size (no per-entry checksum: frames carry one)
HEADER_TAG = b"DDUF+ZST"
HEADER_PAYLOAD = struct.Struct("<8sIQQ")  # tag, version, total decompressed size, frame size
HEADER_VERSION = 1
HEADER_FRAME_SIZE = 8 + HEADER_PAYLOAD.size
MAX_FRAMES = 1 << 20  # bound what we trust from a seek table before allocating for it


class Frame(NamedTuple):
    """One zstd frame of a stream, as its seek table lists it."""

    offset: int  # in the compressed file
    compressed_size: int
    output_offset: int  # in the decompressed archive
    size: int  # decompressed bytes


class StreamLayout(NamedTuple):
    """What a stream's header frame and seek table say (None where it has none: a foreign stream)."""

    total_size: int | None  # from the header frame; None for foreign streams
    frame_size: int | None
    frames: list[Frame] | None  # None when the stream has no seek table


def header_frame(total: int, frame_size: int) -> bytes:
    """The skippable frame that opens a dduf_plus stream: its tag, version, total size and frame size."""
    payload = HEADER_PAYLOAD.pack(HEADER_TAG, HEADER_VERSION, total, frame_size)
    return struct.pack("<II", SKIPPABLE_HEADER_MAGIC, len(payload)) + payload


def seek_table(entries: list[tuple[int, int]]) -> bytes:
    """The seek table frame that ends a dduf_plus stream: (compressed, decompressed) size of every frame."""
    body = b"".join(SEEK_ENTRY.pack(c, d) for c, d in entries)
    footer = struct.pack("<IBI", len(entries), 0, SEEKABLE_MAGIC)
    return struct.pack("<II", SKIPPABLE_SEEK_TABLE_MAGIC, len(body) + len(footer)) + body + footer


def read_layout(fd: int, size: int, name: str = "<stream>") -> StreamLayout:
    """Parse the header frame and seek table of a stream, checking every number against the file size.

    Raises:
        DDUFFormatError: a dduf_plus stream whose seek table is missing (truncated) or inconsistent.
    """
    zstd = zstd_module()
    total = frame_size = None
    if size >= HEADER_FRAME_SIZE:
        head = os.pread(fd, HEADER_FRAME_SIZE, 0)
        magic, length = struct.unpack_from("<II", head)
        if magic == SKIPPABLE_HEADER_MAGIC and length == HEADER_PAYLOAD.size and head[8:16] == HEADER_TAG:
            _tag, version, total, frame_size = HEADER_PAYLOAD.unpack_from(head, 8)
            if version > HEADER_VERSION:
                logger.info("%s: zstd header version %d is newer than this reader's; decoding anyway", name, version)
    magic = int.from_bytes(os.pread(fd, 4, 0), "little") if size >= 4 else None
    if magic != zstd.MAGIC_NUMBER and (magic is None or not is_skippable(magic)):
        raise DDUFFormatError(f"{name}: not a zstd stream (bad magic number)")
    frames = _readseek_table(fd, size, name)
    if frames is None:
        if total is not None:
            raise DDUFFormatError(f"{name}: truncated zstd stream (its seek table is missing)")
        return StreamLayout(None, None, None)
    decoded = sum(f.size for f in frames)
    if total is not None and decoded != total:
        raise DDUFFormatError(f"{name}: seek table covers {decoded} bytes, header announces {total}")
    return StreamLayout(total if total is not None else decoded, frame_size, frames)


def _readseek_table(fd: int, size: int, name: str) -> list[Frame] | None:
    if size < SEEK_FOOTER_SIZE + 8:
        return None
    count, descriptor, magic = struct.unpack("<IBI", os.pread(fd, SEEK_FOOTER_SIZE, size - SEEK_FOOTER_SIZE))
    if magic != SEEKABLE_MAGIC:
        return None
    entry_size = SEEK_ENTRY.size + (4 if descriptor & 0x80 else 0)
    table_size = 8 + count * entry_size + SEEK_FOOTER_SIZE
    if descriptor & 0x7C or count > MAX_FRAMES or table_size > size:
        raise DDUFFormatError(f"{name}: malformed zstd seek table ({count} frames, descriptor {descriptor:#x})")
    raw = pread_exact(fd, table_size, size - table_size, name)
    magic, length = struct.unpack_from("<II", raw)
    if magic != SKIPPABLE_SEEK_TABLE_MAGIC or length != table_size - 8:
        raise DDUFFormatError(f"{name}: zstd seek table frame header is inconsistent")
    frames, offset, out_offset = [], 0, 0
    for i in range(count):
        csize, dsize = SEEK_ENTRY.unpack_from(raw, 8 + i * entry_size)
        frames.append(Frame(offset, csize, out_offset, dsize))
        offset += csize
        out_offset += dsize
    if offset != size - table_size:
        raise DDUFFormatError(f"{name}: seek table frames cover {offset} bytes, stream has {size - table_size}")
    return frames


def pread_exact(fd: int, length: int, offset: int, name: str) -> bytes:
    """``length`` bytes at ``offset``; fewer (the file ends) is a truncated stream."""
    data = pread_upto(fd, length, offset)
    if len(data) != length:
        raise DDUFFormatError(f"{name}: truncated zstd stream (read past the end at {offset + len(data)})")
    return data


def is_skippable(magic: int) -> bool:
    """A zstd skippable frame's magic number (any of 16): decoders pass over its bytes."""
    return magic & 0xFFFFFFF0 == 0x184D2A50


def walk_frames(zstd: Any, fd: int, size: int, name: str) -> list[tuple[int, int, int | None]]:
    """(offset, compressed size, content size or None) of every frame, found from frame and block headers
    alone (3 bytes read per block of up to 128 KiB): proves the stream is not truncated, and sums what it
    will decode to, without decoding it.

    Raises:
        DDUFFormatError: a frame or block runs past the end of the file, or a header is malformed.
    """
    frames: list[tuple[int, int, int | None]] = []
    offset = 0
    while offset < size:
        if len(frames) >= MAX_FRAMES:
            raise DDUFFormatError(f"{name}: more than {MAX_FRAMES} zstd frames")
        head = os.pread(fd, 18, offset)  # 18: the largest zstd frame header
        if len(head) < 8:
            raise DDUFFormatError(f"{name}: truncated zstd stream (partial frame header at {offset})")
        magic = int.from_bytes(head[:4], "little")
        content: int | None = 0
        if is_skippable(magic):
            length = 8 + int.from_bytes(head[4:8], "little")
        elif magic == zstd.MAGIC_NUMBER:
            try:
                length = zstd.frame_header_size(head)
                params = zstd.get_frame_parameters(head)
            except zstd.ZstdError as e:
                raise DDUFFormatError(f"{name}: malformed zstd frame header at {offset} ({e})") from None
            content = None if params.content_size == zstd.CONTENTSIZE_UNKNOWN else params.content_size
            while True:
                block = os.pread(fd, 3, offset + length)
                if len(block) < 3:
                    raise DDUFFormatError(f"{name}: truncated zstd stream (frame at {offset} is incomplete)")
                bits = int.from_bytes(block, "little")
                last, kind, block_size = bits & 1, (bits >> 1) & 3, bits >> 3
                if kind == 3:
                    raise DDUFFormatError(f"{name}: malformed zstd block at {offset + length}")
                length += 3 + (1 if kind == 1 else block_size)  # RLE blocks hold one byte
                if last:
                    break
            length += 4 if params.has_checksum else 0
        else:
            raise DDUFFormatError(f"{name}: bytes at {offset} are not a zstd frame")
        if offset + length > size:
            raise DDUFFormatError(f"{name}: truncated zstd stream (frame at {offset} runs past the end)")
        frames.append((offset, length, content))
        offset += length
    return frames
