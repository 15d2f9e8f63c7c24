"""load_dduf(URL) against the link's own limit and against download-then-load.

    python bench/bench_remote.py [--runs 3] [--latency 0.020] [--bandwidth 400e6]

The SD-1.5-shaped archive (about 2.1 GB, bench/_common.sd15_archive()) is served from 127.0.0.1 by
tests/servers.FileServer in a *separate process* (so the server does not share the loader's GIL), with an
injected round trip (``latency``, per request) and a bandwidth cap shared by every connection. Rows:

- link limit: bytes / cap (what no client can beat);
- load_dduf(URL), first load: remote cache cleared before each run; then every weight page is touched;
- load_dduf(URL), second load: the archive is in the remote cache (one tail request), pages touched;
- download-then-load: one sequential GET of the whole file to disk, then load_dduf(local), pages touched.

Medians of ``--runs`` runs; writes bench/results/remote.json.

    python bench/bench_remote.py --open-requests [--latency 0.020]

runs bench/bench_remote_open.py: the requests and seconds that *opening* a remote archive takes (target: 1
request), per entry point, archive and client configuration; writes bench/results/remote_open.json."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import ROOT, WORK, median, sd15_archive  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "remote.json"
CACHE = WORK / "remote-bench-cache"


def serve(root: str, latency: float, bandwidth: float) -> None:
    """Run FileServer in this process until stdin closes; print its port first."""
    sys.path.insert(0, str(ROOT / "tests"))
    from servers import FileServer

    with FileServer(root, latency=latency, bandwidth=bandwidth) as srv:
        print(srv.server_port, flush=True)
        sys.stdin.read()


def touch(pipe) -> int:
    """Read one byte of every 4 KiB page of every weight (what a first forward pass would fault in)."""
    import torch

    total = 0
    for name in ("unet", "vae", "text_encoder"):
        for tensor in getattr(pipe, name).state_dict().values():
            flat = tensor.detach().reshape(-1)
            if flat.numel():
                total += int(flat.view(torch.uint8)[::4096].sum())
    return total


def load_and_touch(source: str, **options) -> float:
    from dduf_plus import load_dduf

    started = time.perf_counter()
    pipe = load_dduf(source, **options)
    touch(pipe)
    return time.perf_counter() - started


def download(url: str, target: Path) -> None:
    """One sequential GET of the whole file (as a browser or ``curl -O`` does), 8 MiB at a time."""
    with urllib.request.urlopen(url, timeout=60) as response, open(target, "wb") as out:
        shutil.copyfileobj(response, out, 8 << 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.020)
    parser.add_argument("--bandwidth", type=float, default=400e6)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=16 << 20)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--open-requests", action="store_true", help="only count the requests to open (seconds)")
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.latency, args.bandwidth)
    if args.open_requests:
        return open_requests(args.latency)

    archive = sd15_archive()
    size = archive.stat().st_size
    os.environ["DDUF_PLUS_CACHE"] = str(CACHE)
    os.environ["HF_HUB_OFFLINE"] = "0"
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(archive.parent), "--latency",
                               str(args.latency), "--bandwidth", str(args.bandwidth)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        url = f"http://127.0.0.1:{port}/{archive.name}"
        rows = measure(url, archive, args)
    finally:
        server.stdin.close()
        server.wait(10)
    report(rows, size, args)


def measure(url: str, archive: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    from dduf_plus import load_dduf

    remote = {"concurrency": args.concurrency, "chunk_size": args.chunk_size}
    touch(load_dduf(archive))  # warm-up: imports (not the link's cost); the served file is in the page cache
    rows: dict[str, list[float]] = {"first": [], "second": [], "download_then_load": []}
    target = WORK / "remote-bench-download.dduf"
    for _ in range(args.runs):  # interleaved: the other processes' load drifts, every row sees the same drift
        shutil.rmtree(CACHE, ignore_errors=True)
        rows["first"].append(load_and_touch(url, remote=remote))
        rows["second"].append(load_and_touch(url, remote=remote))
        target.unlink(missing_ok=True)
        started = time.perf_counter()
        download(url, target)
        rows["download_then_load"].append(time.perf_counter() - started + load_and_touch(str(target)))
        print(f"first load + touch {rows['first'][-1]:.2f} s, second {rows['second'][-1]:.2f} s, "
              f"download then load + touch {rows['download_then_load'][-1]:.2f} s "
              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    target.unlink(missing_ok=True)
    shutil.rmtree(CACHE, ignore_errors=True)
    return rows


def report(rows: dict[str, list[float]], size: int, args: argparse.Namespace) -> None:
    limit = size / args.bandwidth
    first, second, download_load = (median(rows[k]) for k in ("first", "second", "download_then_load"))
    print(f"\nSD-1.5-shaped archive, {size / 1e9:.2f} GB; link: {args.latency * 1e3:.0f} ms round trip, "
          f"{args.bandwidth / 1e6:.0f} MB/s cap; {os.cpu_count()} CPU cores (load average "
          f"{os.getloadavg()[0]:.1f}); medians of {args.runs}")
    print(f"{'row':34} {'seconds':>8} {'x link limit':>13}")
    for label, value in (("link limit (bytes / cap)", limit), ("load_dduf(URL) first load + touch", first),
                         ("load_dduf(URL) second load + touch", second),
                         ("download, then load_dduf + touch", download_load)):
        print(f"{label:34} {value:8.2f} {value / limit:13.2f}")
    print(f"first load vs download-then-load: {download_load / first:.2f}x faster "
          "(targets: first <= 1.15x link limit, >= 1.3x faster than download-then-load)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "archive_bytes": size, "latency_s": args.latency, "bandwidth_Bps": args.bandwidth,
        "concurrency": args.concurrency, "chunk_size": args.chunk_size, "cpu_count": os.cpu_count(),
        "load_average_after": os.getloadavg(),  # other processes sharing the cores while it ran
        "runs": rows, "median_s": {"link_limit": limit, "first": first, "second": second,
                                   "download_then_load": download_load},
        "ratios": {"first_vs_link_limit": first / limit, "download_then_load_vs_first": download_load / first},
    }, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


def open_requests(latency: float) -> None:
    """Requests and seconds to open a remote archive: bench/bench_remote_open.py (writes remote_open.json)."""
    subprocess.run([sys.executable, str(Path(__file__).with_name("bench_remote_open.py")), "--latency", str(latency)],
                   check=True)


if __name__ == "__main__":
    main()
