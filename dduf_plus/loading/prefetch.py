"""Read-ahead of the archive's tensor data on a background thread while modules are being built.

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

logger = logging.getLogger("dduf_plus")

MADV_WILLNEED = 3
MADV_POPULATE_READ = 22  # Linux 5.14
CHUNK = 32 << 20  # one system call at a time: stays responsive to close(), keeps disk order
PAGE = mmap.PAGESIZE


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise.restype = ctypes.c_int
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

    @property
    def enabled(self) -> bool:
        return self._libc is not None

    def add(self, ranges: Iterable[tuple[int, int]]) -> None:
        if self._libc is None:
            return
        for offset, length in ranges:
            start = max(0, offset // PAGE * PAGE)
            end = min(self._size, offset + length)
            if end > start:
                self._queue.put((start, end - start))
        if self._thread is None:
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
                start, length = item
                for at in range(start, start + length, CHUNK):
                    if self._stop.is_set():
                        return
                    self._advise(base + at, min(CHUNK, start + length - at))
        finally:
            del anchor

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
