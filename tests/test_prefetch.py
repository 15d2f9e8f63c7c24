"""Read-ahead: the background Prefetcher populates the uncached ranges it is given, skips cached ones, and
stops when told."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import pytest

from dduf_plus.loading.prefetch import CHUNK, PAGE, Prefetcher

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise/mincore are Linux calls")


def _file(tmp_path, size):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(size))
    return path


def _mapped(path):
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def _resident_pages(mm) -> int:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    pages = (len(mm) + PAGE - 1) // PAGE
    vector = ctypes.create_string_buffer(pages)
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        assert libc.mincore(ctypes.addressof(anchor), len(mm), vector) == 0
    finally:
        del anchor
    return sum(b & 1 for b in vector.raw)


def _evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_ranges_are_read_in(tmp_path):
    path = _file(tmp_path, CHUNK + 3 * PAGE)
    _evict(path)
    mm = _mapped(path)
    evicted = _resident_pages(mm) < (len(mm) // PAGE) // 2
    prefetcher = Prefetcher(mm)
    prefetcher.add([(10, len(mm) - 10)])  # an unaligned start is rounded down to its page
    prefetcher.wait(30)
    assert prefetcher.bytes_done + prefetcher.bytes_resident == len(mm)
    assert _resident_pages(mm) == (len(mm) + PAGE - 1) // PAGE
    if not evicted:
        pytest.skip("the file could not be evicted here (tmpfs?): residency before the prefetch unknown")


def test_stop_ends_the_thread_early(tmp_path):
    path = _file(tmp_path, 3 * CHUNK)
    mm = _mapped(path)
    prefetcher = Prefetcher(mm)
    prefetcher.stop()
    prefetcher.add([(0, len(mm))])
    prefetcher.wait(30)
    assert prefetcher.bytes_done + prefetcher.bytes_resident <= CHUNK


def test_out_of_range_requests_are_clipped(tmp_path):
    path = _file(tmp_path, 2 * PAGE)
    mm = _mapped(path)
    prefetcher = Prefetcher(mm)
    prefetcher.add([(PAGE, 10 * PAGE), (5 * PAGE, PAGE)])
    prefetcher.wait(30)
    assert prefetcher.bytes_done + prefetcher.bytes_resident == PAGE


def test_cached_ranges_are_skipped(tmp_path):
    """On a warm cache populating only moves fault work to another core and contends with the builder:
    ranges already cached are left to the first touch."""
    path = _file(tmp_path, 2 * CHUNK + 12345)
    path.read_bytes()  # in the page cache now
    mm = _mapped(path)
    prefetcher = Prefetcher(mm)
    prefetcher.add([(0, len(mm))])
    prefetcher.wait(30)
    assert prefetcher.bytes_resident == len(mm)
    assert prefetcher.bytes_done == 0
    assert prefetcher._thread is None  # sampled by the caller: nothing to read, no thread to compete with


def test_read_ahead_is_off_unless_asked(packed, monkeypatch) -> None:
    """prefetch=False is the default (the read-ahead measured slower, cold and warm: docs/loading.md); True
    still starts it."""
    import dduf_plus.loading.pipeline as pipeline
    from dduf_plus import load_dduf

    started: list[object] = []

    class Recording(Prefetcher):
        def __init__(self, *args, **kwargs) -> None:
            started.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(pipeline, "Prefetcher", Recording)
    load_dduf(packed["tiny-sd"])
    assert started == []
    load_dduf(packed["tiny-sd"], prefetch=True)
    assert len(started) == 1
