"""Bytes, memory and time a hostile range server can cost the remote entry points (issue 18, item 2).

Serves the tiny-sd fixture archive (~1.3 MB) from tests/hostile_server.py in each mode and runs
``validate(URL)`` (byte budget ``--max-bytes``, default 20 MB) and ``fetch_archive(URL)`` (the download of
``load_dduf(URL)``, 16 connections). Each case runs in a fresh process: peak RSS (VmHWM) growth over the
process's start, bytes the server sent (headers included), seconds, and the outcome.

    python bench/bench_hostile.py                          # every mode, both entry points
    python bench/bench_hostile.py --modes overrun-close --extra-mb 1024
    python bench/bench_hostile.py --honest-first 2      # the mode hits the data ranges, not the probe
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) << 10
    return 0


def _case(entry: str, url: str, max_bytes: int, deadline: float, cache: str, out: dict) -> None:
    os.environ["DDUF_PLUS_CACHE"] = cache
    os.environ["HF_HUB_DOWNLOAD_TIMEOUT"] = "2"
    os.environ["HF_HUB_OFFLINE"] = "0"
    from dduf_plus.errors import DDUFError
    from dduf_plus.format.validate import validate
    from dduf_plus.remote.fetch import fetch_archive

    base = _vm("VmRSS:")
    started = time.perf_counter()
    try:
        if entry == "validate":
            report = validate(url, max_bytes=max_bytes, deadline=deadline)
            outcome = f"report valid={report.valid}"
        else:
            fetch_archive(url, {"max_bytes": max_bytes, "deadline": deadline})
            outcome = "fetched"
    except DDUFError as e:
        outcome = f"{type(e).__name__}: {str(e)[:150]}"
    except BaseException as e:  # noqa: BLE001 - what the bench is looking for
        outcome = f"NOT A DDUFError {type(e).__name__}: {str(e)[:150]}"
    out.update(seconds=round(time.perf_counter() - started, 2), rss_growth_mb=round((_vm("VmHWM:") - base) / 2**20, 1),
               outcome=outcome)


def run(mode: str, entry: str, archive: Path, extra: int, max_bytes: int, deadline: float,
        honest_first: int = 0) -> dict:
    from hostile_server import HostileServer, wait_idle

    manager = multiprocessing.Manager()
    out = manager.dict()
    with tempfile.TemporaryDirectory() as cache, HostileServer(archive.parent, mode, extra=extra,
                                                                      honest_first=honest_first) as server:
        proc = multiprocessing.get_context("spawn").Process(
            target=_case, args=(entry, server.url(archive.name), max_bytes, deadline, cache, out))
        proc.start()
        proc.join(deadline + 120)
        if proc.is_alive():
            proc.kill()
            out["outcome"] = "HUNG (killed)"
        wait_idle(server)
        result = {"mode": f"{mode}@{honest_first}" if honest_first else mode, "entry": entry, "server_sent_mb": round(server.sent / 2**20, 2),
                  "requests": server.requests, **dict(out)}
    manager.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    from hostile_server import MODES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=list(MODES))
    p.add_argument("--entries", nargs="+", default=["validate", "fetch"])
    p.add_argument("--extra-mb", type=float, default=256, help="bytes an overrunning answer adds (MB)")
    p.add_argument("--max-bytes", type=int, default=20_000_000)
    p.add_argument("--deadline", type=float, default=10)
    p.add_argument("--honest-first", type=int, default=0, help="answer this many requests honestly first (the "
                   "mode then hits the tail or data ranges, read by several connections, not the opening probe)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    from dduf_plus.format.pack import pack_folder

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        archive = pack_folder(ROOT / "fixtures" / "pipelines" / "tiny-sd", Path(tmp) / "tiny-sd.dduf", quiet=True).path
        print(f"archive {archive.stat().st_size} bytes; byte budget {args.max_bytes}; extra {args.extra_mb} MB")
        for mode in args.modes:
            for entry in args.entries:
                row = run(mode, entry, archive, int(args.extra_mb * 2**20), args.max_bytes, args.deadline,
                          args.honest_first)
                rows.append(row)
                print(f"{row['mode']:<19} {entry:<8} sent {row['server_sent_mb']:>8} MB  {row['requests']:>4} req  "
                      f"RSS +{row.get('rss_growth_mb', '?'):>7} MB  {row.get('seconds', '?'):>6} s  "
                      f"{row.get('outcome', '?')[:110]}", flush=True)
    if args.json:
        from provenance import write_result

        write_result(args.json, rows, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
