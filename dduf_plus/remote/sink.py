"""Where a fetched archive's bytes land (:mod:`.transfer`): straight in the cache file, or in an in-memory file the
loader maps while a writer thread copies it into the cache file behind the load, or in memory only. The choice
weighs the archive's size against free memory and how much dirty data the kernel takes before writers wait."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from ..errors import DDUFIOError
from .readers import RemoteOptions

WRITE_BEHIND_MIN = 64 << 20  # smaller archives go straight to the cache file (the disk keeps up with them)


def size_file(fd: int, size: int, reserve: bool = True) -> None:
    """The partial file at its full size, its blocks allocated where the file system can (a resumed file's
    released holes too): the disk space is reserved before any byte is fetched."""
    if os.fstat(fd).st_size != size:
        os.ftruncate(fd, size)
    if reserve and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            pass  # preallocation is an optimisation; a sparse file works as well


def memory_file(url: str, size: int) -> int:
    """An anonymous in-memory file of ``size`` bytes (Linux ``memfd``; elsewhere an unlinked temporary
    file). Its pages come with the bytes (``pwrite``: memory that is not there is an error, never a crash);
    reserving them up front would allocate and zero them all before the first byte is fetched."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("dduf-remote", getattr(os, "MFD_CLOEXEC", 0))
    else:  # pragma: no cover - not Linux
        import tempfile

        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        os.close(fd)
        raise DDUFIOError(f"{url}: {size} bytes do not fit in memory ({e.strerror}); load it with the "
                          "remote cache (remote={'cache': True, 'memory_max': 0})") from None
    return fd


def choose_sink(options: RemoteOptions, folder: Path, size: int, in_memory: bool) -> str:
    """Where the bytes land: straight in the cache file when it is in memory already (tmpfs), when the page
    cache takes it without making writers wait for the disk (``memory_max`` unset), or when the archive is
    over ``memory_max``; else in memory, written to the cache file behind the load (a disk slower than the
    link does not hold the load up)."""
    if not in_memory or size < WRITE_BEHIND_MIN or in_ram(folder):
        return "file"
    meminfo = read_meminfo()
    bound = options.memory_max if options.memory_max is not None else meminfo.get("MemAvailable", 0) // 2
    if size > bound:
        return "file"
    return "file" if options.memory_max is None and size <= dirty_room(meminfo) else "write-behind"


def dirty_room(meminfo: dict[str, int]) -> int:
    """Bytes the page cache takes as dirty pages before the kernel makes writers wait for the disk (its
    free-run point, (vm.dirty_ratio + vm.dirty_background_ratio) / 2 of the available memory, less what is
    dirty already): an archive that fits goes straight to the cache file (one copy fewer)."""
    def knob(name: str, default: int) -> int:
        try:
            with open(f"/proc/sys/vm/{name}") as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return default
    available = meminfo.get("MemAvailable", 0)
    limit = knob("dirty_bytes", 0) or available * knob("dirty_ratio", 20) // 100
    background = knob("dirty_background_bytes", 0) or available * knob("dirty_background_ratio", 10) // 100
    return max(0, (limit + background) // 2 - meminfo.get("Dirty", 0) - meminfo.get("Writeback", 0))


def in_ram(folder: Path) -> bool:
    """Whether ``folder`` is on tmpfs/ramfs (its file pages are memory: nothing to write behind)."""
    try:
        target = os.path.realpath(folder)
        best, kind = "", ""
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                mount = fields[1].replace("\\040", " ") if len(fields) > 2 else ""
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return False
    return kind in ("tmpfs", "ramfs")


def read_meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes ({} where unknown: then nothing is served from memory unless memory_max says)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                fields = value.split()
                if fields and fields[0].isdigit():
                    out[name] = int(fields[0]) * 1024
    except OSError:
        pass
    return out


class ReadMap:
    """The fetched archive mapped read-only, so that bytes which arrived earlier are hashed where they are (no
    copy into a buffer first). Received bytes go in with ``pwrite`` (a full memory or disk is an error, never
    a SIGBUS); a read through the mapping only sees the file."""

    def __init__(self, fd: int, size: int):
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        self.view: memoryview | None = memoryview(self.map)

    def window(self, start: int, end: int) -> memoryview | None:
        """Bytes ``[start, end)``, or None once closed."""
        view = self.view
        return view[start:end] if view is not None else None

    def forget(self, start: int, end: int) -> None:
        """Drop this mapping's hold on the whole pages of ``[start, end)`` once hashed (the file's pages stay in
        the page cache): a fetch without a loader does not keep the archive mapped in its resident set."""
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        last = end - end % mmap.PAGESIZE
        if self.view is not None and last > first:
            try:
                self.map.madvise(mmap.MADV_DONTNEED, first, last - first)
            except (OSError, ValueError, AttributeError):
                pass

    def close(self) -> None:
        """Unmap (the file and its other mappings stay); a slice still held elsewhere defers it to collection."""
        view, self.view = self.view, None
        try:
            if view is not None:
                view.release()
            self.map.close()
        except BufferError:
            pass


def map_for_reading(fd: int, size: int) -> ReadMap | None:
    """A :class:`ReadMap` of ``fd``, or None where the platform cannot map it (the bytes are read back)."""
    if size <= 0 or not hasattr(mmap, "MAP_SHARED"):
        return None
    try:
        return ReadMap(fd, size)
    except (OSError, ValueError):
        return None
