"""Read-ahead: the background Prefetcher reads what is not cached and skips what is."""

from __future__ import annotations

import mmap
import os
import sys

import pytest

from dduf_plus.loading.prefetch import CHUNK, Prefetcher

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise/mincore are Linux calls")


def _file(tmp_path, size):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(size))
    return path


def _mapped(path):
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def _evict(path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    probe = Prefetcher(_mapped(path))
    return not probe._resident_at(0, os.path.getsize(path))


def test_cached_ranges_are_skipped(tmp_path):
    path = _file(tmp_path, 2 * CHUNK + 12345)
    path.read_bytes()  # in the page cache now
    mm = _mapped(path)
    prefetcher = Prefetcher(mm)
    prefetcher.add([(0, len(mm))])
    prefetcher.wait(30)
    assert prefetcher.bytes_resident == len(mm)
    assert prefetcher.bytes_done == 0


def test_uncached_ranges_are_read(tmp_path):
    path = _file(tmp_path, CHUNK + 4096 * 3)
    if not _evict(path):
        pytest.skip("this file system keeps the file cached (tmpfs?)")
    mm = _mapped(path)
    prefetcher = Prefetcher(mm)
    prefetcher.add([(10, len(mm) - 10)])
    prefetcher.wait(30)
    assert prefetcher.bytes_done + prefetcher.bytes_resident == len(mm)
    assert prefetcher.bytes_done > 0
    assert Prefetcher(mm)._resident_at(0, len(mm))


def test_stop_ends_the_thread(tmp_path):
    path = _file(tmp_path, 3 * CHUNK)
    mm = _mapped(path)
    prefetcher = Prefetcher(mm)
    prefetcher.stop()
    prefetcher.add([(0, len(mm))])
    prefetcher.wait(30)
    assert prefetcher.bytes_done + prefetcher.bytes_resident <= CHUNK
