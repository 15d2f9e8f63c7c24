"""The cache files being written behind loads in this process (:mod:`.transfer`'s write-behind: the in-memory
file copied into the cache file after the load returned): a second load of the same archive, and
:func:`wait_cache_writes`, wait for that writer (a disk write) instead of fetching the missing part again."""

from __future__ import annotations

import threading
import time
from pathlib import Path

# Cache files being written behind a load in this process: {final path: writer thread}.
_WRITING: dict[str, threading.Thread] = {}
_WRITING_LOCK = threading.Lock()


def track_writer(final: Path | None, writer: threading.Thread) -> None:
    """``writer`` is writing the cache file ``final`` behind a load (until :func:`untrack_writer`)."""
    with _WRITING_LOCK:
        _WRITING[str(final)] = writer


def untrack_writer(final: Path | None, writer: threading.Thread) -> None:
    """``writer`` is done with ``final`` (a later writer of the same file stays tracked)."""
    with _WRITING_LOCK:
        if _WRITING.get(str(final)) is writer:
            del _WRITING[str(final)]


def wait_cache_writes(final: Path | None = None, timeout: float | None = None) -> float:
    """Until the cache files being written behind loads in this process (``final`` only, when given) are
    complete or stopped; returns the seconds waited."""
    started = time.perf_counter()
    with _WRITING_LOCK:
        writers = [t for path, t in _WRITING.items() if final is None or path == str(final)]
    for writer in writers:
        writer.join(timeout)
    return time.perf_counter() - started
