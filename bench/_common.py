"""Shared by the benchmarks: the SD-1.5- and SDXL-shaped work pipelines (built once, under a lock, reused),
timing helpers, and page-cache control."""

from __future__ import annotations

import fcntl
import os
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from provenance import provenance, with_provenance, write_result  # noqa: F401  (every bench's results)

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("DDUF_BENCH_WORK", ROOT / "bench" / "_work"))
RESULTS = ROOT / "bench" / "results"


def compile_package() -> None:
    """Byte-compile dduf_plus, as an installed package is: with ``PYTHONDONTWRITEBYTECODE`` set (as on this
    machine) an editable checkout has no ``.pyc`` files, so every module a load imports lazily, and every module
    of a fresh process, is compiled from source inside the clock, while diffusers' and transformers' (compiled
    by pip at install) are not."""
    import compileall

    compileall.compile_dir(str(ROOT / "dduf_plus"), quiet=2)


compile_package()


@contextmanager
def _lock(name: str):
    WORK.mkdir(parents=True, exist_ok=True)
    with open(WORK / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


# shape -> (folder name under WORK, builder in fixtures/make_fixtures.py, bytes it needs on disk)
SHAPES = {"sd15": ("sd15", "build_sd15_shaped", 2_200_000_000), "sdxl": ("sdxl", "build_sdxl_shaped", 7_000_000_000)}


def pipeline_folder(shape: str = "sd15") -> Path:
    """The SD-1.5-shaped (about 2.1 GB) or SDXL-shaped (about 6.9 GB) fp16 pipeline folder, generated on first use
    (streamed, seeded random weights) under a lock so that concurrent benchmarks build it once."""
    name, builder, needs = SHAPES[shape]
    folder = WORK / name
    with _lock(name):
        if not (folder / ".complete").exists():
            free = shutil.disk_usage(WORK).free
            if free < needs * 1.1:
                raise SystemExit(f"{shape}: needs {needs / 1e9:.1f} GB in {WORK}, {free / 1e9:.1f} GB free "
                                 "(set DDUF_BENCH_WORK to a roomier folder)")
            sys.path.insert(0, str(ROOT / "fixtures"))
            import make_fixtures

            getattr(make_fixtures, builder)(folder)
            (folder / ".complete").touch()
    return folder


def pipeline_archive(shape: str = "sd15") -> Path:
    """The pipeline folder of ``shape`` packed with dduf_plus (WORK/<name>.dduf), once."""
    name = SHAPES[shape][0]
    archive = WORK / f"{name}.dduf"
    folder = pipeline_folder(shape)
    with _lock(f"{name}-archive"):
        if not archive.exists():
            from dduf_plus.format.pack import pack_folder

            pack_folder(folder, archive, quiet=True)  # the writer renames a finished temporary file
    return archive


def sd15_folder() -> Path:
    """The SD-1.5-shaped fp16 pipeline folder (about 2.1 GB), generated on first use."""
    return pipeline_folder("sd15")


def sd15_archive() -> Path:
    """The SD-1.5-shaped folder packed with dduf_plus."""
    return pipeline_archive("sd15")


def sdxl_folder() -> Path:
    """The SDXL-shaped fp16 pipeline folder (about 6.9 GB: unet 5.1 GB, CLIP-L, OpenCLIP-bigG, vae)."""
    return pipeline_folder("sdxl")


def sdxl_archive() -> Path:
    """The SDXL-shaped folder packed with dduf_plus."""
    return pipeline_archive("sdxl")


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
