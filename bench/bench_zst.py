"""zstd transport on the SD-1.5-shaped fp16 archive (2.1 GB): ratio and compress / decompress speed at
levels 1, 3 and 9, parallel vs single-threaded decoding, peak RSS (constant memory), and the zstd CLI at
level 3 as the anchor. Each run is a fresh process; warm page cache; medians of --repeat runs. Peak RSS:
VmHWM of our process, sampled RSS of the zstd CLI.

The weights are *random*: random fp16 mantissas do not compress, so ratios here are a floor. Trained
weights compress more (their exponents cluster); speed is representative either way.

    python bench/bench_zst.py [--repeat 3] [--levels 1 3 9]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, WORK, median, sd15_archive, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_CHILD = """
import json, sys
from dduf_plus.storage import zst
op, src, dst, level, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
if op == "compress":
    r = zst.compress(src, dst, level=level, threads=threads, quiet=True)
else:
    r = zst.decompress(src, dst, threads=threads, quiet=True)
print(json.dumps({"seconds": r.seconds, "input": r.input_bytes, "output": r.output_bytes, "frames": r.frames,
                  "peak_rss": next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                                   if l.startswith("VmHWM:"))}))
"""


def child(op: str, src: Path, dst: Path, level: int = 3, threads: int = -1) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, op, str(src), str(dst), str(level), str(threads)],
                         check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def cli_time(cmd: list[str]) -> tuple[float, int]:
    """Wall time and peak RSS of one process. RSS is sampled (psutil, every 5 ms): the kernel's ru_maxrss
    of a child carries the parent's RSS at fork over exec, so it would report the benchmark's own size."""
    import psutil

    t = time.perf_counter()
    proc = psutil.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.Error:
            break
        time.sleep(0.005)
    elapsed = time.perf_counter() - t
    if proc.wait():
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return elapsed, peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 3, 9])
    args = parser.parse_args()
    archive = sd15_archive()
    size = archive.stat().st_size
    subprocess.run(["cat", str(archive)], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
    packed, unpacked = WORK / "bench.dduf.zst", WORK / "bench-back.dduf"
    rows: dict[str, dict] = {}
    try:
        for level in args.levels:
            comp = [child("compress", archive, packed, level) for _ in range(args.repeat)]
            dec = [child("decompress", packed, unpacked) for _ in range(args.repeat)]
            exact = _same(archive, unpacked)
            dec1 = [child("decompress", packed, unpacked, threads=1) for _ in range(args.repeat)]
            c_s, d_s, d1_s = (median([r["seconds"] for r in rs]) for rs in (comp, dec, dec1))
            rows[f"level {level}"] = {
                "level": level, "archive_bytes": size, "compressed_bytes": comp[0]["output"], "frames": comp[0]["frames"],
                "ratio": size / comp[0]["output"], "compress_s": c_s, "compress_gb_s": size / c_s / 1e9,
                "decompress_s": d_s, "decompress_gb_s": size / d_s / 1e9,
                "decompress_1thread_s": d1_s, "decompress_1thread_gb_s": size / d1_s / 1e9,
                "compress_peak_rss_bytes": max(r["peak_rss"] for r in comp),
                "decompress_peak_rss_bytes": max(r["peak_rss"] for r in dec),
                "byte_exact": exact,
                "runs": {"compress_s": [r["seconds"] for r in comp], "decompress_s": [r["seconds"] for r in dec],
                         "decompress_1thread_s": [r["seconds"] for r in dec1]},
            }
            print(f"level {level}: ratio {rows[f'level {level}']['ratio']:.4f}, compress {size / c_s / 1e9:.2f} GB/s, "
                  f"decompress {size / d_s / 1e9:.2f} GB/s (1 thread {size / d1_s / 1e9:.2f}), exact={exact}", flush=True)
        if shutil.which("zstd"):
            cli = WORK / "cli.dduf.zst"
            comp_runs = [cli_time(["zstd", "-3", "-T0", "-q", "-f", str(archive), "-o", str(cli)])
                         for _ in range(args.repeat)]
            dec_runs = [cli_time(["zstd", "-d", "-q", "-f", str(cli), "-o", str(unpacked)]) for _ in range(args.repeat)]
            ct, cr = [r[0] for r in comp_runs], [r[1] for r in comp_runs]
            dt, dr = [r[0] for r in dec_runs], [r[1] for r in dec_runs]
            csize = cli.stat().st_size
            rows["zstd CLI -3 -T0 (anchor)"] = {
                "level": 3, "archive_bytes": size, "compressed_bytes": csize, "ratio": size / csize,
                "compress_s": median(ct), "compress_gb_s": size / median(ct) / 1e9,
                "decompress_s": median(dt), "decompress_gb_s": size / median(dt) / 1e9,
                "compress_peak_rss_bytes": max(cr), "decompress_peak_rss_bytes": max(dr),
                "runs": {"compress_s": ct, "decompress_s": dt},
            }
            cli.unlink(missing_ok=True)
    finally:
        packed.unlink(missing_ok=True)
        unpacked.unlink(missing_ok=True)
    result = {"archive": str(archive.relative_to(ROOT)), "archive_bytes": size, "cpus": os.cpu_count(),
              "repeat": args.repeat, "note": "random weights: ratios are a floor; trained weights compress more",
              "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(RESULTS / "zst.json", result)
    print()
    print(f"SD-1.5-shaped fp16 archive, {size / 1e9:.2f} GB, random weights, {os.cpu_count()} CPUs, warm cache, "
          f"median of {args.repeat}")
    print()
    print("| codec | ratio | compress GB/s | decompress GB/s (all threads / 1) | peak RSS compress / decompress |")
    print("| --- | --- | --- | --- | --- |")
    for label, r in rows.items():
        one = f" / {r['decompress_1thread_gb_s']:.2f}" if "decompress_1thread_gb_s" in r else ""
        print(f"| {label if 'CLI' in label else 'dduf compress ' + label} | {r['ratio']:.3f} | {r['compress_gb_s']:.2f} | "
              f"{r['decompress_gb_s']:.2f}{one} | {r['compress_peak_rss_bytes'] / 1e6:.0f} MB / "
              f"{r['decompress_peak_rss_bytes'] / 1e6:.0f} MB |")


def _same(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


if __name__ == "__main__":
    main()
