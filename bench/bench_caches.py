"""Hostile-input costs of the zst cache and of validating a .zst (issue 10, items 2-3).

1. `dduf validate` of a decompression bomb (~65 KB of zstd announcing 2 GiB of zeros): wall time, bytes the
   process wrote (/proc/self/io wchar), bytes left on disk afterwards, peak RSS (VmHWM).
2. `cached_decompress` of the SD-1.5-shaped archive (2.1 GB) compressed at level 1: first call, a hit by stat
   key, and a hit after the entry's stat changed (rehashed).

Each run is a fresh process; warm page cache; medians of --repeat runs. ``--before DIR`` also runs the same
children against another checkout (e.g. ``git archive <commit> | tar -x -C DIR``) for a before/after table.

    DDUF_BENCH_WORK=/tmp/dduf-bench python bench/bench_caches.py [--repeat 3] [--before /tmp/old-checkout]
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
MiB = 1 << 20

_STATS = """
def _stats():
    io = dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())
    hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return {"written": int(io["wchar"]), "peak_rss": hwm}
"""
_VALIDATE = _STATS + """
import json, sys, time
t = time.perf_counter()
from dduf_plus.format.validate import validate
report = validate(sys.argv[1])
print(json.dumps({"seconds": time.perf_counter() - t, "codes": report.codes, **_stats()}))
"""
_CACHED = _STATS + """
import json, os, sys, time
t = time.perf_counter()
from dduf_plus.storage import zst_cache
mode = sys.argv[2]
if mode == "touch":  # the entry's stat changes, its bytes do not (a restored backup, a copied cache)
    entry = zst_cache.cached_decompress(sys.argv[1])
    stamp = time.time_ns() - 10**9  # a new mtime every run (the hit then re-records it)
    os.utime(entry, ns=(stamp, stamp))
    t = time.perf_counter()
zst_cache.cached_decompress(sys.argv[1])
print(json.dumps({"seconds": time.perf_counter() - t, **_stats()}))
"""


def bomb(path: Path) -> Path:
    """8 frames of 256 MiB of zeros behind a dduf_plus header and seek table (what `dduf compress` of 2 GiB
    of zeros writes)."""
    import zstandard

    from dduf_plus.storage import zst

    if not path.exists():
        cobj = zstandard.ZstdCompressor(level=1, write_checksum=True).compressobj(size=256 * MiB)
        frame = b"".join([cobj.compress(bytes(8 * MiB)) for _ in range(32)] + [cobj.flush()])
        header = zst.header_frame(8 * 256 * MiB, 256 * MiB)
        table = zst.seek_table([(len(header), 0)] + [(len(frame), 256 * MiB)] * 8)
        path.write_bytes(header + frame * 8 + table)
    return path


def du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def child(code: str, args: list[str], tree: Path, cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), DDUF_PLUS_CACHE=str(cache), TMPDIR=str(cache.parent / "tmp"),
               HF_HUB_OFFLINE="1")
    (cache.parent / "tmp").mkdir(parents=True, exist_ok=True)
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd="/")
    if out.returncode:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another checkout to compare with")
    args = parser.parse_args()
    trees = {"after": ROOT, **({"before": args.before} if args.before else {})}
    results: dict = {"bomb": {}, "cache_hit": {}}
    WORK.mkdir(parents=True, exist_ok=True)
    bomb_path = bomb(WORK / "bomb.dduf.zst")
    for label, tree in trees.items():
        runs = []
        for _ in range(args.repeat):
            cache = WORK / f"cache-{label}" / "c"
            shutil.rmtree(cache.parent, ignore_errors=True)
            r = child(_VALIDATE, [str(bomb_path)], tree, cache)
            r["left_on_disk"] = du(cache.parent)
            runs.append(r)
            shutil.rmtree(cache.parent, ignore_errors=True)
        results["bomb"][label] = {k: median([r[k] for r in runs]) for k in ("seconds", "written", "peak_rss",
                                                                            "left_on_disk")}
        results["bomb"][label]["codes"] = runs[0]["codes"]
    from dduf_plus.storage import zst

    archive = sd15_archive()
    stream = WORK / "sd15.dduf.zst"
    if not stream.exists():
        zst.compress(archive, stream, level=1, quiet=True)
    for label, tree in trees.items():
        cache = WORK / f"cache-{label}" / "c"
        row = {}
        for mode in ("first", "hit", "touch"):
            runs = []
            for _ in range(args.repeat):
                if mode == "first":
                    shutil.rmtree(cache.parent, ignore_errors=True)
                runs.append(child(_CACHED, [str(stream), mode], tree, cache))
            row[mode] = {k: median([r[k] for r in runs]) for k in ("seconds", "peak_rss")}
        results["cache_hit"][label] = row
        shutil.rmtree(cache.parent, ignore_errors=True)
    results["archive_bytes"] = archive.stat().st_size
    results["stream_bytes"] = stream.stat().st_size
    results["bomb_bytes"] = bomb_path.stat().st_size
    results["when"] = time.strftime("%Y-%m-%d")
    RESULTS.mkdir(exist_ok=True)
    results = write_result(RESULTS / "caches.json", results)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
