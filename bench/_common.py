"""Shared by the benchmarks: the SD-1.5-shaped work pipeline (built once, under a lock, reused),
timing helpers, and page-cache control."""

from __future__ import annotations

import fcntl
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("DDUF_BENCH_WORK", ROOT / "bench" / "_work"))
RESULTS = ROOT / "bench" / "results"


@contextmanager
def _lock(name: str):
    WORK.mkdir(parents=True, exist_ok=True)
    with open(WORK / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def sd15_folder() -> Path:
    """The SD-1.5-shaped fp16 pipeline folder (about 2.1 GB), generated on first use."""
    folder = WORK / "sd15"
    with _lock("sd15"):
        if not (folder / ".complete").exists():
            sys.path.insert(0, str(ROOT / "fixtures"))
            from make_fixtures import build_sd15_shaped

            build_sd15_shaped(folder)
            (folder / ".complete").touch()
    return folder


def sd15_archive() -> Path:
    """The SD-1.5-shaped folder packed with dduf_plus."""
    archive = WORK / "sd15.dduf"
    folder = sd15_folder()
    with _lock("sd15-archive"):
        if not archive.exists():
            from dduf_plus.format.pack import pack_folder

            pack_folder(folder, archive, quiet=True)
    return archive


def drop_caches() -> bool:
    """Drop the page cache (root only). False when not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(fn, repeat: int = 5, setup=None) -> list[float]:
    times = []
    for _ in range(repeat):
        if setup:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def run_cmd(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t
