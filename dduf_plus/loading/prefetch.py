"""Read-ahead of the archive's tensor data: ``Prefetcher`` on a background thread while modules are being
built, ``prefetch`` for a synchronous hint, ``component_ranges`` for what to read.

``madvise(MADV_POPULATE_READ)`` (Linux 5.14+) reads the pages in *and* maps them, so the later first touch
of each parameter takes no page fault; older kernels get ``MADV_WILLNEED`` (asynchronous read-ahead into the
page cache). The call goes through ctypes because ctypes releases the GIL for the duration of the system
call, where ``mmap.madvise`` does not: module construction on the main thread keeps running meanwhile."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import queue
import sys
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ..format.archive import DDUFArchive

logger = logging.getLogger(__name__)

MADV_WILLNEED = 3
MADV_POPULATE_READ = 22  # Linux 5.14
CHUNK = 32 << 20  # one system call at a time: stays responsive to close(), keeps disk order
PAGE = mmap.PAGESIZE
SAMPLE_STRIDE = 8 << 20  # residency is sampled, one page per stride (4 per step): read-ahead is a hint


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise.restype = ctypes.c_int
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
        libc.mincore.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


class Prefetcher:
    """Populate byte ranges of one memory map, in the order they were added, on one daemon thread.

    The thread holds an export of the map while it works, so the map cannot be unmapped under it."""

    def __init__(self, mm: mmap.mmap):
        self._libc = _libc()
        self._queue: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._mm = mm
        self._size = len(mm)
        self._advice = MADV_POPULATE_READ
        self._stop = threading.Event()
        self.bytes_done = 0
        self.bytes_resident = 0  # skipped: already cached

    @property
    def enabled(self) -> bool:
        return self._libc is not None

    def add(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Queue the ranges' steps that are not in the page cache yet. Residency is sampled here, on the
        caller's thread, before the builder starts allocating (about 1,000 ``mincore`` calls for 2 GB,
        a few ms): on a warm cache nothing is queued and no thread starts (one that only found every step
        cached still cost the builder ~0.03 s of GIL hand-offs)."""
        if self._libc is None or self._stop.is_set():
            return
        queued = False
        try:
            anchor = ctypes.c_char.from_buffer(self._mm)  # an export: the map stays mapped while we sample
        except TypeError:  # a read-only map cannot be exported: queue everything, the thread samples nothing
            anchor = None
        try:
            vector = ctypes.create_string_buffer(1)
            for offset, length in ranges:
                start = max(0, offset // PAGE * PAGE)
                end = min(self._size, offset + length)
                for at in range(start, end, CHUNK):
                    n = min(CHUNK, end - at)
                    if anchor is not None and self._resident(ctypes.addressof(anchor) + at, n, vector):
                        self.bytes_resident += n
                        continue  # already in the page cache: a touch maps it as cheaply as we would
                    self._queue.put((at, n))
                    queued = True
        finally:
            del anchor
        if queued and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dduf_plus-prefetch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        anchor = ctypes.c_char.from_buffer(self._mm)  # an export: the map stays mapped while we work
        base = ctypes.addressof(anchor)
        try:
            while not self._stop.is_set():
                item = self._queue.get()
                if item is None:  # finish(): everything queued before it is done
                    return
                at, n = item  # one step (at most CHUNK) that was not cached when it was queued
                self._advise(base + at, n)
        finally:
            del anchor

    def _resident(self, address: int, length: int, vector: ctypes.Array) -> bool:
        """Whether the range looks cached: ``mincore`` of one page every 8 MiB (a whole-range check
        costs a page-cache lookup per page under the mmap lock, which slows the builder's allocations)."""
        assert self._libc is not None
        for at in range(address - address % PAGE, address + length, SAMPLE_STRIDE):
            if self._libc.mincore(at, 1, vector) != 0 or not vector.raw[0] & 1:
                return False
        return True

    def _advise(self, address: int, length: int) -> None:
        assert self._libc is not None
        if self._libc.madvise(address, length, self._advice) == 0:
            self.bytes_done += length
            return
        err = ctypes.get_errno()
        if self._advice == MADV_POPULATE_READ and err in (22, 95):  # EINVAL/EOPNOTSUPP: an older kernel
            self._advice = MADV_WILLNEED
            self._advise(address, length)
        else:
            logger.debug("madvise failed: %s", os.strerror(err))

    def stop(self) -> None:
        """Stop early (the rest of the data is then read on first touch, as without prefetch)."""
        self._stop.set()
        self._queue.put(None)

    def finish(self) -> None:
        """No more ranges will come: the thread ends once the queued ones are done."""
        self._queue.put(None)

    def wait(self, timeout: float | None = None) -> None:
        self.finish()
        if self._thread is not None:
            self._thread.join(timeout)


def component_ranges(archive: DDUFArchive, component: str, variant: str | None = None) -> list[tuple[int, int]]:
    """(offset, length) of the tensor data of ``component``'s weight files in the archive."""
    ranges = []
    for name in archive.weight_files(component, variant):
        entry, header = archive.entry(name), archive.headers[name]
        ranges.append((entry.offset + header.data_start, entry.length - header.data_start))
    return ranges


def prefetch(
    source: DDUFArchive | mmap.mmap,
    ranges: Iterable[tuple[int, int]] | None = None,
    *,
    populate: bool = False,
) -> int:
    """Ask the kernel to read ``ranges`` of the mapping ahead; returns the bytes advised.

    ``MADV_WILLNEED`` queues the reads and returns at once. ``populate=True`` also maps the pages
    (``MADV_POPULATE_READ``, Linux >= 5.14), sparing later touches their page faults, and blocks until
    they are read (the GIL is released meanwhile); to overlap that with other work use
    :class:`Prefetcher`. Without ``ranges``: the whole file. Never raises for lack of kernel support:
    read-ahead is a hint.

    Example:
        >>> prefetch(archive, component_ranges(archive, "unet"))
    """
    mm = source if isinstance(source, mmap.mmap) else source.mmap
    size = len(mm)
    ranges = [(0, size)] if ranges is None else list(ranges)
    libc = _libc()
    anchor = None
    if libc is not None and size:
        try:
            anchor = ctypes.c_char.from_buffer(mm)  # an export keeps it mapped; madvise via libc frees the GIL
        except TypeError:
            pass  # a read-only map (ACCESS_READ) cannot be exported: fall back to mmap.madvise
    advised = 0
    try:
        for offset, length in ranges:
            stop = min(size, offset + length)
            if length <= 0 or stop <= max(0, offset):
                continue  # empty or past the end
            start = max(0, offset) // PAGE * PAGE  # madvise wants a page-aligned start
            for advice in (MADV_WILLNEED, MADV_POPULATE_READ) if populate else (MADV_WILLNEED,):
                if anchor is not None and libc is not None:
                    libc.madvise(ctypes.addressof(anchor) + start, stop - start, advice)  # errors: hint lost
                elif hasattr(mm, "madvise"):
                    try:
                        mm.madvise(advice, start, stop - start)
                    except (OSError, ValueError):
                        pass
            advised += stop - start
    finally:
        del anchor
    return advised
