"""Disk rules of the remote cache: what a fetch may preallocate and what an interrupted one may leave.

- An archive is preallocated only after its tail has been checked (:mod:`.tail`) and only when it fits
  the free disk space minus the reserve that ``.zst`` decompression keeps
  (:data:`dduf_plus.storage.zst.DISK_RESERVE`, the same rule and the same helper).
- A fetch that stops (an I/O error, a stall, Ctrl-C) keeps its ``.partial`` for a resume, with the blocks
  nothing was written to released (Linux ``FALLOC_FL_PUNCH_HOLE``), so it holds the bytes that arrived,
  not the size a server announced.
- The kept partials together hold at most ``$DDUF_PLUS_REMOTE_PARTIALS_MAX`` (default 64 GiB; ``"0"`` keeps
  none, ``"unlimited"`` any): past it the oldest idle ones are removed, and a partial larger than the
  budget by itself is not kept. Partials touched in the last :data:`IDLE_S` seconds belong to a fetch that
  may be running in another process and are left alone.
- A refused archive (its structure, once opened) leaves nothing: the caller discards its partial."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from ..errors import DDUFIOError, DDUFUsageError
from ..sizes import format_size, parse_size
from ..storage import zst as _zst
from ..storage.confined import Confined

logger = logging.getLogger(__name__)

PARTIALS_ENV = "DDUF_PLUS_REMOTE_PARTIALS_MAX"
DEFAULT_PARTIALS_MAX = 64 << 30
IDLE_S = 120.0
_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE


def partials_budget() -> int | None:
    """The most bytes kept ``.partial`` files may hold (None: no limit), from ``$DDUF_PLUS_REMOTE_PARTIALS_MAX``.

    Raises:
        DDUFUsageError: the variable is neither a size (``500M``, ``64G``) nor ``unlimited``.
    """
    text = os.environ.get(PARTIALS_ENV, "").strip()
    if not text:
        return DEFAULT_PARTIALS_MAX
    if text.lower() in ("unlimited", "none", "inf"):
        return None
    size = parse_size(text)
    if size is None:
        raise DDUFUsageError(f"${PARTIALS_ENV}={text!r}: expected a size (500M, 64G, 0) or 'unlimited'")
    return size


def allocated(path: str | os.PathLike) -> int:
    """Bytes a file holds on disk (its blocks; a sparse file's holes are free), 0 when absent."""
    try:
        info = os.stat(path)
    except OSError:
        return 0
    blocks = getattr(info, "st_blocks", None)
    return blocks * 512 if blocks is not None else info.st_size


def check_room(url: str, folder: Path, size: int, partial: Path) -> None:
    """Refuse to preallocate ``size`` bytes in ``folder`` past its free space (less the reserve); what a
    partial being resumed holds already counts as available.

    Raises:
        DDUFIOError: not enough free space (the message says how much and where to point the cache).
    """
    free = _zst.free_bytes(folder) + allocated(partial)
    if size > free:
        raise DDUFIOError(
            f"{url}: the archive is {format_size(size, binary=True)}, but {folder} has {format_size(max(free, 0), binary=True)} "
            f"free (keeping {format_size(_zst.DISK_RESERVE, binary=True)} spare): free disk space or fetch elsewhere "
            "($DDUF_PLUS_CACHE, remote={'cache_dir': ...})")


def release_unwritten(fd: int, holes: list[tuple[int, int]]) -> bool:
    """Give back the preallocated blocks of ``holes`` (``[start, end)`` ranges nothing was written to).
    False where the platform or file system cannot (the budget then counts the blocks as they are)."""
    if not holes or not sys.platform.startswith("linux"):
        return not holes
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fallocate = libc.fallocate
        fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        for start, end in holes:
            if fallocate(fd, _PUNCH, start, end - start) != 0:
                return False
    except (OSError, AttributeError):
        return False
    return True


def _last_touched(partial: Path) -> float:
    stamps = []
    for path in (partial, partial.with_name(partial.name.removesuffix(".dduf.partial") + ".progress.json")):
        try:
            stamps.append(path.stat().st_mtime)
        except OSError:
            pass
    return max(stamps, default=0.0)


def discard(cache: Confined, partial: Path) -> None:
    """Remove a partial file and its progress record."""
    key = partial.name.removesuffix(".dduf.partial")
    for path in (partial, cache.path(f"{key}.progress.json")):
        try:
            cache.unlink(path)
        except FileNotFoundError:
            pass


def enforce_budget(cache: Confined, *, keep: Path | None = None, active: Path | None = None) -> bool:
    """Remove the oldest idle partials until the kept ones fit :func:`partials_budget`. ``keep`` (a partial
    just stopped) counts and may go itself when it alone is over; ``active`` (a fetch running here) is
    neither counted nor touched. Returns whether ``keep`` is still there."""
    budget = partials_budget()
    if budget is None:
        return True
    now = time.time()
    others = [p for p in cache.root.glob("*.dduf.partial") if p not in (keep, active) and p.is_file()]
    sizes = {p: allocated(p) for p in others}
    total = sum(sizes.values()) + (allocated(keep) if keep is not None else 0)
    for partial in sorted(others, key=_last_touched):
        if total <= budget:
            break
        if now - _last_touched(partial) < IDLE_S:
            continue  # perhaps another process's fetch in progress
        discard(cache, partial)
        total -= sizes[partial]
        logger.info("removed the resumable partial %s (%s): kept partials over $%s", partial,
                    format_size(sizes[partial], binary=True), PARTIALS_ENV)
    if keep is not None and total > budget:
        logger.warning("%s is not kept for a resume: the kept partials would hold %s, over $%s=%s", keep,
                       format_size(total, binary=True), PARTIALS_ENV, format_size(budget, binary=True))
        discard(cache, keep)
        return False
    return True
