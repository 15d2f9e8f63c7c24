"""Pack speed: `dduf pack` (with sha256 + CRC-32) vs huggingface_hub `export_folder_as_dduf` vs `cp -r`,
on the SD-1.5-shaped fp16 pipeline (2.1 GB), warm page cache, same run. Medians of --repeat runs.

    python bench/bench_pack.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, WORK, median, sd15_folder  # noqa: E402


def measure(cmd: list[str], out: Path, repeat: int) -> tuple[list[float], int]:
    times, peak = [], 0
    for _ in range(repeat):
        if out.is_dir():
            shutil.rmtree(out)
        out.unlink(missing_ok=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
        peak = max(peak, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before)
    return times, peak * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    folder = sd15_folder()
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    subprocess.run(["cat", *map(str, folder.rglob("*.safetensors"))], stdout=subprocess.DEVNULL, check=True)
    py = sys.executable
    # Each tool runs as its own process; interpreter start and imports are included for all three.
    cases = {
        "cp -r (anchor)": (["cp", "-r", str(folder), str(WORK / "cp-out")], WORK / "cp-out"),
        "huggingface_hub export_folder_as_dduf": (
            [py, "-c", "import sys; from huggingface_hub import export_folder_as_dduf as e; e(sys.argv[1], sys.argv[2])",
             str(WORK / "hub.dduf"), str(folder)], WORK / "hub.dduf"),
        "dduf pack (sha256 + CRC-32, aligned)": (
            [py, "-m", "dduf_plus.cli", "pack", str(folder), "-o", str(WORK / "pack-out.dduf"), "--quiet"],
            WORK / "pack-out.dduf"),
    }
    rows = {}
    for label, (cmd, out) in cases.items():
        times, peak = measure(cmd, out, args.repeat)
        rows[label] = {"median_s": median(times), "runs_s": times, "peak_rss_bytes": peak}
        print(f"{label}: median {median(times):.2f} s over {len(times)} runs", flush=True)
    cp = rows["cp -r (anchor)"]["median_s"]
    hub = rows["huggingface_hub export_folder_as_dduf"]["median_s"]
    print(f"\nSD-1.5-shaped fp16 pipeline, {size / 1e9:.2f} GB, warm cache, medians of {args.repeat}\n")
    print("| tool | median s | GB/s | vs cp | vs export_folder_as_dduf | peak RSS |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, r in rows.items():
        m = r["median_s"]
        print(f"| {label} | {m:.2f} | {size / m / 1e9:.2f} | {m / cp:.2f}x | {m / hub:.2f}x | "
              f"{r['peak_rss_bytes'] / 1e6:.0f} MB |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pack.json").write_text(json.dumps({"bytes": size, "rows": rows}, indent=2))
    for out in (WORK / "cp-out", WORK / "hub.dduf", WORK / "pack-out.dduf"):
        shutil.rmtree(out) if out.is_dir() else out.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
