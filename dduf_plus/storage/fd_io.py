"""Whole reads, writes and copies at offsets of open file descriptors (``pread``, ``pwrite`` and ``sendfile``
may move fewer bytes than asked): the one loop each that local sources (:mod:`.source`), the zstd transport
(:mod:`.zst`) and the remote fetch (:mod:`dduf_plus.remote.transfer`) go through."""

from __future__ import annotations

import os

from ..errors import DDUFIOError

COPY_BLOCK = 16 << 20  # bytes per sendfile call (or per buffered copy where the kernel cannot)


def pread_upto(fd: int, length: int, offset: int) -> bytes:
    """``length`` bytes at ``offset`` of ``fd``, fewer only where the file ends first (the caller says what that
    means: a truncated stream, a file that shrank)."""
    parts = []
    while length > 0:
        chunk = os.pread(fd, length, offset)
        if not chunk:
            break
        parts.append(chunk)
        offset += len(chunk)
        length -= len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)  # one read: no copy


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """All of ``data`` (bytes or any buffer) at ``offset`` of ``fd`` (``pwrite`` may write less than asked)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:  # no progress and no error (some FUSE and network file systems): never loop for ever
            raise DDUFIOError(f"cannot write at byte {offset}: the file system wrote nothing")
        view, offset = view[written:], offset + written


def copy_range(src: int, dst: int, start: int, end: int) -> None:
    """Bytes ``[start, end)`` of ``src`` to the same place in ``dst``, copied by the kernel where it can."""
    at = start
    while at < end:
        n = min(end - at, COPY_BLOCK)
        try:
            os.lseek(dst, at, os.SEEK_SET)
            sent = os.sendfile(dst, src, at, n)
        except OSError:
            sent = 0
        if sent <= 0:  # no sendfile between these two: through a buffer
            data = os.pread(src, n, at)
            if len(data) != n:
                raise DDUFIOError(f"short read at byte {at} while copying the fetched archive")
            pwrite_all(dst, memoryview(data), at)
            sent = n
        at += sent
