"""Opening a file to read without blocking, and whole reads, writes and copies of open file descriptors
(``pread``, ``write``, ``pwrite`` and ``copy_file_range`` may move fewer bytes than asked): the one place for
each that local sources (:mod:`.source`), signed records, model-folder files, the zstd transport, the remote
fetch (:mod:`dduf_plus.remote.transfer`), the archive writer, ``dduf unpack``, ``dduf export`` and the server's
uploads go through."""

from __future__ import annotations

import errno
import os
import stat

from ..errors import DDUFIOError

COPY_BLOCK = 16 << 20  # bytes per kernel copy (or per buffered copy where the kernel cannot)


def open_regular(path: str | os.PathLike, *, follow_links: bool = True) -> tuple[int, os.stat_result] | None:
    """``path`` opened to read, with its stat, when it is a regular file; None (nothing left open) when it is a
    FIFO, a device or a folder. The open never blocks (``O_NONBLOCK``: a plain ``open()`` of a FIFO put in a
    file's place waits for a writer for ever); ``follow_links=False`` refuses a link (``O_NOFOLLOW``, an
    OSError). An OSError of the open itself (missing, unreadable, a NUL in the name) is the caller's to say."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags if follow_links else flags | getattr(os, "O_NOFOLLOW", 0))
    except ValueError:  # a NUL in the name: an open that fails like any other, for the caller to say
        raise OSError(errno.EINVAL, "the path holds a NUL character", os.fsdecode(path).replace("\x00", "\\0")) \
            from None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st


def read_at_most(path: str | os.PathLike, limit: int | None, *, follow_links: bool = True) -> bytes | None:
    """The first ``limit + 1`` bytes of the regular file at ``path`` (all of it when shorter; ``limit=None``: its
    size when opened, + 1), or None when it is not a regular file (a FIFO, a device, a folder: never waited on,
    :func:`open_regular`). Never more: a result longer than ``limit`` says the file is over it, also one that
    grew after an earlier stat said it was within (the caller names the budget). OSErrors are the caller's."""
    opened = open_regular(path, follow_links=follow_links)
    if opened is None:
        return None
    fd, st = opened
    try:
        return pread_upto(fd, (st.st_size if limit is None else limit) + 1, 0)
    finally:
        os.close(fd)


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


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """All of ``data`` (bytes or any buffer) at ``fd``'s position (``write`` may write less than asked: a filling
    disk writes what fits, then the next call raises ENOSPC, never a silently short file)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        if written <= 0:  # as pwrite_all: no progress and no error is an error, not a loop for ever
            raise DDUFIOError("cannot write: the file system wrote nothing")
        view = view[written:]


def kernel_copy(src: int, dst: int, count: int, src_offset: int, dst_offset: int | None = None) -> int:
    """Copy up to ``count`` bytes at ``src_offset`` of ``src`` to ``dst_offset`` of ``dst`` (``dst``'s position
    when None) in the kernel (``copy_file_range``: the bytes never pass through this process). Returns how many
    it copied: ``count``, or fewer where the kernel cannot copy between these two files (another file system,
    no ``copy_file_range``) or ``src`` ends first. The caller moves the rest through a buffer, whose read finds
    a source that ended and whose write raises what stopped the kernel (a full disk)."""
    copy = getattr(os, "copy_file_range", None)
    done = 0
    if copy is None:
        return 0
    try:
        while done < count:
            n = copy(src, dst, count - done, src_offset + done, None if dst_offset is None else dst_offset + done)
            if n <= 0:
                break
            done += n
    except OSError:
        pass  # EXDEV, ENOSYS, EINVAL (file systems that cannot), or an error the buffered write will meet
    return done


def copy_range(src: int, dst: int, start: int, end: int) -> None:
    """Bytes ``[start, end)`` of ``src`` to the same place in ``dst``, copied by the kernel where it can."""
    at = start
    while at < end:
        n = min(end - at, COPY_BLOCK)
        sent = kernel_copy(src, dst, n, at, at)
        if sent <= 0:  # no kernel copy between these two: through a buffer
            data = os.pread(src, n, at)
            if len(data) != n:
                raise DDUFIOError(f"short read at byte {at} while copying the fetched archive")
            pwrite_all(dst, memoryview(data), at)
            sent = n
        at += sent
