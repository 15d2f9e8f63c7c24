"""load_dduf(URL) against the link's own limit, against one plain GET and against download-then-load, with
the work folder (remote cache, downloads) on the disk and on tmpfs.

    python bench/bench_remote.py [--runs 3] [--latency 0.020] [--bandwidth 400e6] [--per-connection BPS]
                                 [--shape sd15|sdxl] [--folders disk,tmpfs] [--out bench/results/remote.json]

The SD-1.5-shaped archive (about 2.1 GB; ``--shape sdxl``: the SDXL-shaped 6.9 GB one, disk only: it does not
fit tmpfs here) is served from 127.0.0.1 by tests/servers.FileServer in a *separate process* (so the server
does not share the loader's GIL; its CPU time is reported: on 2 cores it competes with the client), with an
injected round trip (``latency``, per request) and a bandwidth cap shared by every connection. The disk's own
sequential write speed (512 MiB written and fsync'ed) is measured in the same run. Rows, per work folder:

- link limit: bytes / cap (what no client can beat);
- single GET: one sequential GET of the whole file into the folder (``curl -O``), nothing else;
- download-then-load: that GET, then load_dduf(local file), pages touched;
- ranged download-then-load: the file fetched in ``--concurrency`` concurrent byte ranges of ``--chunk-size``
  (as huggingface_hub's hf_transfer / hf_xet paths, aria2c -x and s5cmd do), written in place with pwrite, then
  load_dduf(local file), pages touched: the fair anchor where one stream is capped;
- load_dduf(URL) first load: remote cache cleared before each run; then every weight page is touched;
- load_dduf(URL, remote={"cache": False}): nothing kept, pages touched;
- warm cached load: the archive is in the remote cache (one tail request), pages touched.

``--per-connection 100e6`` also caps each connection on its own (the whole link still ``--bandwidth``): object
stores and CDNs serve one stream slower than many, which is why huggingface_hub's fast paths and AWS's S3
performance guidelines fetch in concurrent byte ranges. The link limit stays bytes / ``--bandwidth`` (16
connections reach it); a single GET is held to bytes / ``--per-connection``. Written to
``remote_per_connection.json``.

Medians of ``--runs`` interleaved runs (every row sees the same drift of the shared machine's load);
writes bench/results/remote.json.

    python bench/bench_remote.py --open-requests [--latency 0.020]

runs bench/bench_remote_open.py: the requests and seconds that *opening* a remote archive takes (target: 1
request), per entry point, archive and client configuration; writes bench/results/remote_open.json."""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402
from _common import ROOT, WORK, median  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "remote.json"
ROWS = ("single_get", "download_then_load", "ranged_get", "ranged_download_then_load", "first", "no_cache", "warm")
LABELS = {"link_limit": "link limit (bytes / cap)", "single_get": "single GET (nothing else)",
          "download_then_load": "download, then load_dduf + touch",
          "ranged_get": "concurrent-range download", "ranged_download_then_load": "ranged download, then load + touch", "first": "load_dduf(URL) first load + touch",
          "no_cache": "load_dduf(URL, cache=False) + touch", "warm": "warm cached load + touch"}


def serve(root: str, latency: float, bandwidth: float, per_connection: float | None) -> None:
    """Run FileServer in this process until stdin closes; print its port first."""
    sys.path.insert(0, str(ROOT / "tests"))
    from servers import FileServer

    with FileServer(root, latency=latency, bandwidth=bandwidth, per_connection=per_connection) as srv:
        print(srv.server_port, flush=True)
        sys.stdin.read()


def touch(pipe) -> int:
    """Read one byte of every 4 KiB page of every weight (what a first forward pass would fault in)."""
    import torch

    total, threads = 0, torch.get_num_threads()
    # the touch sums on one thread: with two OpenMP threads, a busy neighbour on a core turns each small
    # reduction into a spin-wait (SD-1.5's UNet: 1 s instead of 0.07 s, for every loader alike)
    torch.set_num_threads(1)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            for tensor in module.state_dict().values():
                flat = tensor.detach().reshape(-1)
                if flat.numel():
                    total += int(flat.view(torch.uint8)[::4096].sum())
    torch.set_num_threads(threads)
    return total


def _cpu(pid: int | None = None) -> float:
    """CPU seconds (user + system) of this process (all threads) or of process ``pid``."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def download_ranges(url: str, target: Path, connections: int, chunk: int) -> None:
    """The file in concurrent byte ranges (``connections`` at once, ``chunk`` bytes each), each written in place
    with pwrite: what a downloader that knows about range requests does (hf_transfer, aria2c -x, s5cmd)."""
    from concurrent.futures import ThreadPoolExecutor

    request = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(request, timeout=60) as response:
        size = int(response.headers["Content-Length"])
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)

        def fetch(start: int) -> None:
            end = min(start + chunk, size) - 1
            ranged = urllib.request.Request(url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(ranged, timeout=60) as response:
                at = start
                while block := response.read(1 << 20):
                    os.pwrite(fd, block, at)
                    at += len(block)
            if at != end + 1:
                raise OSError(f"range {start}-{end}: {at - start} bytes")

        with ThreadPoolExecutor(connections) as pool:
            list(pool.map(fetch, range(0, size, chunk)))
    finally:
        os.close(fd)


def disk_write_speed(folder: Path, size: int = 512 << 20) -> float:
    """Bytes/s of one sequential write of ``size`` bytes into ``folder``, fsync included (the device's pace)."""
    folder.mkdir(parents=True, exist_ok=True)
    target, block = folder / "write-speed.bin", os.urandom(8 << 20)
    started = time.perf_counter()
    with open(target, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    target.unlink()
    return size / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.020)
    parser.add_argument("--bandwidth", type=float, default=400e6)
    parser.add_argument("--per-connection", type=float, default=None,
                        help="also cap each connection at this many bytes/s (a link whose single stream is "
                             "slower than the whole); results go to remote_per_connection.json by default")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=16 << 20)
    parser.add_argument("--shape", choices=("sd15", "sdxl"), default="sd15")
    parser.add_argument("--folders", default=None, help="disk,tmpfs (default; sdxl: disk)")
    parser.add_argument("--tmpfs", default="/dev/shm", help="where the tmpfs work folder goes")
    parser.add_argument("--out", type=Path, default=None, help="results file (default bench/results/remote.json; "
                                                               "sdxl: remote_sdxl.json)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--open-requests", action="store_true", help="only count the requests to open (seconds)")
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.latency, args.bandwidth, args.per_connection)
    if args.open_requests:
        return open_requests(args.latency)
    folders = (args.folders or ("disk" if args.shape == "sdxl" else "disk,tmpfs")).split(",")
    if args.shape == "sdxl" and "tmpfs" in folders:
        parser.error("--shape sdxl runs on the disk only (the archive, its cache and a download do not fit in RAM)")
    archive = _archive(args.shape)
    work = {"disk": WORK / "remote-bench", "tmpfs": Path(args.tmpfs) / f"dduf-remote-bench-{os.getpid()}"}
    os.environ["HF_HUB_OFFLINE"] = "0"
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(archive.parent), "--latency",
                               str(args.latency), "--bandwidth", str(args.bandwidth)]
                              + (["--per-connection", str(args.per_connection)] if args.per_connection else []),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        url = f"http://127.0.0.1:{port}/{archive.name}"
        result = measure(url, archive, args, {name: work[name] for name in folders}, server.pid)
    finally:
        server.stdin.close()
        server.wait(10)
        for name in folders:
            shutil.rmtree(work[name], ignore_errors=True)
    report(result, archive.stat().st_size, args)


def _archive(shape: str) -> Path:
    if hasattr(_common, "pipeline_archive"):
        return _common.pipeline_archive(shape)
    if shape != "sd15":
        raise SystemExit("bench/_common.py has no SDXL-shaped pipeline (pipeline_archive) yet")
    return _common.sd15_archive()


def _timed(server_pid: int, call) -> tuple[float, float, float]:
    """(seconds, client CPU seconds, server CPU seconds) of ``call()``."""
    gc.collect()  # nothing owed from the previous row falls into this one's clock
    s0, c0, t0 = _cpu(server_pid), _cpu(), time.perf_counter()
    call()
    return time.perf_counter() - t0, _cpu() - c0, _cpu(server_pid) - s0


def _one_run(url: str, folder: Path, remote: dict, server_pid: int) -> dict[str, tuple[float, float, float]]:
    """Every row once with the work folder ``folder`` (each row starts from an empty folder, synced)."""
    from dduf_plus.remote import fetch

    cache, target = folder / "cache", folder / "download.dduf"
    out: dict[str, tuple[float, float, float]] = {}

    def fresh() -> None:
        shutil.rmtree(cache, ignore_errors=True)
        target.unlink(missing_ok=True)
        os.sync()  # the previous row's dirty pages are not this row's writeback

    fresh()
    out["first"] = _timed(server_pid, lambda: load_and_touch(url, remote={**remote, "cache_dir": str(cache)}))
    # a write-behind finishes (not part of the load: reported apart; older dduf_plus wrote before returning)
    written = getattr(fetch, "wait_cache_writes", lambda: 0.0)()
    out["warm"] = _timed(server_pid, lambda: load_and_touch(url, remote={**remote, "cache_dir": str(cache)}))
    out["cache_written_after"] = (written, 0.0, 0.0)
    fresh()
    if "cache" in getattr(fetch.RemoteOptions, "__dataclass_fields__", {}):
        out["no_cache"] = _timed(server_pid, lambda: load_and_touch(url, remote={**remote, "cache": False}))
    else:
        out["no_cache"] = (float("nan"), float("nan"), float("nan"))
    fresh()
    out["single_get"] = _timed(server_pid, lambda: download(url, target))
    out["download_then_load"] = tuple(a + b for a, b in zip(out["single_get"], _timed(
        server_pid, lambda: load_and_touch(str(target))), strict=True))  # type: ignore[assignment]
    fresh()
    out["ranged_get"] = _timed(server_pid, lambda: download_ranges(url, target, remote["concurrency"],
                                                                    remote["chunk_size"]))
    out["ranged_download_then_load"] = tuple(a + b for a, b in zip(out["ranged_get"], _timed(
        server_pid, lambda: load_and_touch(str(target))), strict=True))  # type: ignore[assignment]
    fresh()
    return out


def measure(url: str, archive: Path, args: argparse.Namespace, folders: dict[str, Path],
            server_pid: int) -> dict[str, object]:
    from dduf_plus import load_dduf

    remote = {"concurrency": args.concurrency, "chunk_size": args.chunk_size}
    touch(load_dduf(archive))  # warm-up: imports (not the link's cost); the served file is in the page cache
    speeds = {name: disk_write_speed(path) for name, path in folders.items()}
    runs: dict[str, dict[str, list[list[float]]]] = {name: {} for name in folders}
    for _ in range(args.runs):  # interleaved: the other processes' load drifts, every row sees the same drift
        for name, folder in folders.items():
            for row, value in _one_run(url, folder, remote, server_pid).items():
                runs[name].setdefault(row, []).append(list(value))
            line = ", ".join(f"{r} {runs[name][r][-1][0]:.2f} s" for r in ROWS)
            print(f"[{name}] {line} (load average {os.getloadavg()[0]:.1f})", flush=True)
    return {"write_speed_Bps": speeds, "runs": runs}


def report(result: dict, size: int, args: argparse.Namespace) -> None:
    limit = size / args.bandwidth
    out: dict[str, object] = {
        "shape": args.shape, "archive_bytes": size, "latency_s": args.latency, "bandwidth_Bps": args.bandwidth,
        "per_connection_Bps": args.per_connection,
        "concurrency": args.concurrency, "chunk_size": args.chunk_size, "cpu_count": os.cpu_count(),
        "load_average_after": os.getloadavg(),  # other processes sharing the cores while it ran
        "link_limit_s": limit, "write_speed_Bps": result["write_speed_Bps"], "folders": {}}
    print(f"\n{args.shape}-shaped archive, {size / 1e9:.2f} GB; link: {args.latency * 1e3:.0f} ms round trip, "
          f"{args.bandwidth / 1e6:.0f} MB/s cap"
          + (f", {args.per_connection / 1e6:.0f} MB/s per connection" if args.per_connection else "")
          + f"; {os.cpu_count()} CPU cores (load average "
          f"{os.getloadavg()[0]:.1f}); medians of {args.runs}")
    for name, runs in result["runs"].items():
        med = {row: [median([r[i] for r in runs[row]]) for i in range(3)] for row in runs}
        dtl = med["download_then_load"][0]
        print(f"\n[{name}] work folder; its sequential write speed {result['write_speed_Bps'][name] / 1e6:.0f} MB/s")
        print(f"{'row':38} {'seconds':>8} {'x link':>7} {'x dl+load':>10} {'client CPU':>11} {'server CPU':>11}")
        print(f"{LABELS['link_limit']:38} {limit:8.2f} {1:7.2f} {limit / dtl:10.2f}")
        for row in ROWS:
            s, c, v = med[row]
            print(f"{LABELS[row]:38} {s:8.2f} {s / limit:7.2f} {s / dtl:10.2f} {c:11.2f} {v:11.2f}")
        print(f"(the cache file was complete {med['cache_written_after'][0]:.2f} s after the first load returned)")
        out["folders"][name] = {  # type: ignore[index]
            "runs": runs, "median_s": {row: med[row][0] for row in med},
            "median_client_cpu_s": {row: med[row][1] for row in ROWS},
            "median_server_cpu_s": {row: med[row][2] for row in ROWS},
            "client_cpu_s_per_GB": {row: med[row][1] / (size / 1e9) for row in ROWS},
            "ratios": {"first_vs_link_limit": med["first"][0] / limit,
                       "first_vs_download_then_load": med["first"][0] / dtl,
                       "first_vs_ranged_download_then_load": med["first"][0] / med["ranged_download_then_load"][0],
                       "first_cpu_vs_ranged_download_then_load_cpu":
                           med["first"][1] / med["ranged_download_then_load"][1],
                       "no_cache_vs_link_limit": med["no_cache"][0] / limit,
                       "single_get_vs_link_limit": med["single_get"][0] / limit}}
    _headline(out)
    print("targets: first load <= 1.15x link limit on tmpfs, <= 0.8x download-then-load")
    target = args.out or (RESULTS if args.shape == "sd15" else RESULTS.with_name("remote_sdxl.json"))
    if args.per_connection and args.out is None:
        target = target.with_name(target.stem + "_per_connection.json")
    target.parent.mkdir(parents=True, exist_ok=True)
    _common.write_result(target, out)
    print(f"wrote {target}")


def _headline(out: dict) -> None:
    """Top-level ``median_s`` / ``ratios`` (what README's headline row reads): the tmpfs folder's when it was
    measured (the link-bound case), else the disk's; ``second`` is the warm cached load."""
    folders = out["folders"]
    name = "tmpfs" if "tmpfs" in folders else next(iter(folders))
    med = dict(folders[name]["median_s"])
    out["headline_folder"] = name
    out["median_s"] = {"link_limit": out["link_limit_s"], **med, "second": med["warm"]}
    out["ratios"] = folders[name]["ratios"]


def open_requests(latency: float) -> None:
    """Requests and seconds to open a remote archive: bench/bench_remote_open.py (writes remote_open.json)."""
    subprocess.run([sys.executable, str(Path(__file__).with_name("bench_remote_open.py")), "--latency", str(latency)],
                   check=True)


if __name__ == "__main__":
    main()
