"""Pack speed: `dduf pack` (sha256 + CRC-32, aligned) vs huggingface_hub `export_folder_as_dduf` vs `cp -r`,
on the SD-1.5-shaped fp16 pipeline (2.1 GB), warm page cache, same run. Medians of --repeat rounds.

    python bench/bench_pack.py [--repeat 5]

Each tool runs as its own process (interpreter start and imports included). Rounds interleave the tools
and every timed run starts after an untimed `sync`, so one tool's writeback does not land on the next one's
clock. `dduf pack` fsyncs before its atomic rename; `cp` and `export_folder_as_dduf` do not, so the table
pairs like with like: "+ sync" rows time the tool followed by `sync` (data on disk, as after `dduf pack`),
and `dduf pack --no-fsync` is timed against the plain tools. The "sha256 floor" row is hashlib alone over
the same files on every core, in process: no tool that records sha256 can beat it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, WORK, median, sd15_folder, write_result  # noqa: E402

HUB = "import sys; from huggingface_hub import export_folder_as_dduf as e; e(sys.argv[1], sys.argv[2])"


def _clear(out: Path) -> None:
    shutil.rmtree(out) if out.is_dir() else out.unlink(missing_ok=True)


def run_once(cmd: list[str], out: Path, then_sync: bool) -> tuple[float, int]:
    """Seconds, and peak RSS of this very child (wait4's rusage, not the running max over all children)."""
    _clear(out)
    os.sync()  # untimed: start with no dirty pages of an earlier run
    t = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, cmd)
    if then_sync:
        os.sync()
    return time.perf_counter() - t, usage.ru_maxrss * 1024


def sha256_floor(files: list[Path]) -> float:
    """hashlib.sha256 of every file, largest first, one thread per core (the bound for any hashing packer)."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    def digest(path: Path) -> str:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    t = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(digest, sorted(files, key=lambda p: -p.stat().st_size)))
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    folder = sd15_folder()
    files = [f for f in folder.rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)  # warm the cache
    py = sys.executable
    pack = [py, "-m", "dduf_plus.cli", "pack", str(folder), "-o", str(WORK / "pack-out.dduf"), "--quiet"]
    cases = {  # label: (command, output, sync after)
        "cp -r": (["cp", "-r", str(folder), str(WORK / "cp-out")], WORK / "cp-out", False),
        "cp -r + sync": (["cp", "-r", str(folder), str(WORK / "cp-out")], WORK / "cp-out", True),
        "hub export_folder_as_dduf": ([py, "-c", HUB, str(WORK / "hub.dduf"), str(folder)], WORK / "hub.dduf", False),
        "hub export_folder_as_dduf + sync": ([py, "-c", HUB, str(WORK / "hub.dduf"), str(folder)],
                                             WORK / "hub.dduf", True),
        "dduf pack --no-fsync": ([*pack, "--no-fsync"], WORK / "pack-out.dduf", False),
        "dduf pack (fsync, default)": (pack, WORK / "pack-out.dduf", False),
    }
    runs: dict[str, list[float]] = {label: [] for label in cases}
    peaks: dict[str, int] = {label: 0 for label in cases}
    floor = []
    for r in range(args.repeat):
        for label, (cmd, out, then_sync) in cases.items():
            seconds, peak = run_once(cmd, out, then_sync)
            runs[label].append(seconds)
            peaks[label] = max(peaks[label], peak)
        floor.append(sha256_floor(files))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items()), flush=True)
    for out in {c[1] for c in cases.values()}:
        _clear(out)
    med = {label: median(v) for label, v in runs.items()}
    rows = {label: {"median_s": med[label], "runs_s": runs[label], "peak_rss_bytes": peaks[label]} for label in cases}
    rows["sha256 floor (hashlib, all cores, in process)"] = {"median_s": median(floor), "runs_s": floor,
                                                            "peak_rss_bytes": 0}
    # like with like: durable vs durable, not-flushed vs not-flushed
    anchors = {"dduf pack --no-fsync": ("cp -r", "hub export_folder_as_dduf"),
               "dduf pack (fsync, default)": ("cp -r + sync", "hub export_folder_as_dduf + sync")}
    print(f"\nSD-1.5-shaped fp16 pipeline, {size / 1e9:.2f} GB, warm cache, {os.cpu_count()} CPUs, "
          f"medians of {args.repeat} interleaved rounds\n")
    print("| tool | median s | GB/s | vs cp (same durability) | vs hub export (same durability) | peak RSS |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, row in rows.items():
        m = row["median_s"]
        cp, hub = anchors.get(label, (None, None))
        ratio_cp = f"{m / med[cp]:.2f}x" if cp else ""
        ratio_hub = f"{m / med[hub]:.2f}x" if hub else ""
        rss = f"{row['peak_rss_bytes'] / 1e6:.0f} MB" if row["peak_rss_bytes"] else ""
        print(f"| {label} | {m:.2f} | {size / m / 1e9:.2f} | {ratio_cp} | {ratio_hub} | {rss} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(RESULTS / "pack.json", {"bytes": size, "cpus": os.cpu_count(), "rows": rows})


if __name__ == "__main__":
    main()
