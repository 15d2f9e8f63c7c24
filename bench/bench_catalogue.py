"""Catalogue-scale validation: archives/s for a catalogue of 1,000 small archives (tiny packed pipelines, the
valid baseline and every hostile case) served from 127.0.0.1 by tests/servers.py's FileServer with an injected
round trip per request, through ``validate_many`` on a thread pool, through ``dduf validate --from-file LIST
--jobs N --json-lines``, and on a Dask ``LocalCluster``.

    python bench/bench_catalogue.py [--count 1000] [--latency 0.02] [--jobs 1 8 32] [--serial 50] [--repeat 3]

The server runs in its own process (it would otherwise share the GIL with the validating threads). ``--jobs 1``
runs over the first ``--serial`` archives only (a serial pass over 1,000 archives at 20 ms a request takes
minutes); its rate is what is compared. Writes bench/results/catalogue.json."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, ROOT, WORK, median, write_result  # noqa: E402

sys.path.insert(0, str(ROOT))
from dduf_plus.catalogue import validate_many  # noqa: E402

HOSTILE = ROOT / "fixtures" / "hostile"
PIPELINES = ROOT / "fixtures" / "pipelines"
SERVER = """
import sys
sys.path.insert(0, sys.argv[1])
from servers import FileServer
with FileServer(sys.argv[2], latency=float(sys.argv[3])) as server:
    print(server.server_port, flush=True)
    sys.stdin.read()  # serve until the bench closes our stdin
"""


def build_catalogue(folder: Path, count: int) -> list[str]:
    """``count`` archive files: every 5th a hostile case, every 10th a tiny packed pipeline, the rest the valid
    baseline (hard links: the server reads them as separate files). Returns the file names."""
    from dduf_plus.format.pack import pack_folder

    folder.mkdir(parents=True, exist_ok=True)
    bases = folder / "_bases"
    bases.mkdir(exist_ok=True)
    packed = []
    for name in sorted(p.name for p in PIPELINES.iterdir() if p.is_dir()):
        out = bases / f"{name}.dduf"
        if not out.exists():
            pack_folder(PIPELINES / name, out, quiet=True)
        packed.append(out)
    hostile = sorted(p for p in HOSTILE.glob("*.dduf") if p.name != "valid.dduf")
    names = []
    for i in range(count):
        base = hostile[(i // 5) % len(hostile)] if i % 5 == 0 else (
            packed[(i // 10) % len(packed)] if i % 10 == 1 else HOSTILE / "valid.dduf")
        name = f"{i:04d}-{base.name}"
        target = folder / name
        if not target.exists():
            try:
                os.link(base, target)
            except OSError:
                shutil.copy(base, target)
        names.append(name)
    return names


def start_server(folder: Path, latency: float) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(ROOT / "tests"), str(folder), str(latency)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def run_api(urls: list[str], jobs: int) -> tuple[float, Counter]:
    started = time.perf_counter()
    with ThreadPoolExecutor(jobs) as pool:
        verdicts = Counter(_verdict(r) for r in validate_many(urls, executor=pool, max_workers=jobs, ordered=False))
    return time.perf_counter() - started, verdicts


def run_cli(urls: list[str], jobs: int, listing: Path) -> tuple[float, Counter]:
    listing.write_text("".join(u + "\n" for u in urls))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "dduf_plus.cli", "validate", "--from-file", str(listing),
                           "--jobs", str(jobs), "--json-lines"], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    assert done.returncode in (0, 1, 2), done.stderr[-2000:]
    lines = [json.loads(x) for x in done.stdout.splitlines()]
    return seconds, Counter("io_error" if "io_error" in x else x["valid"] for x in lines)


def _verdict(report: Any) -> object:
    """validate_many yields ValidationReport objects (``io_error`` set for a source it could not read)."""
    return "io_error" if report.io_error is not None else report.valid


def run_dask(urls: list[str], jobs: int, repeat: int) -> tuple[float, list[float], Counter] | None:
    """2 worker processes x jobs/2 threads (2 cores here); cluster start-up timed apart. None: no distributed."""
    try:
        import distributed
    except ImportError:
        return None

    started = time.perf_counter()
    with distributed.LocalCluster(n_workers=2, threads_per_worker=max(1, jobs // 2), processes=True,
                                  dashboard_address=None, silence_logs=50) as cluster, \
            distributed.Client(cluster) as client, client.get_executor() as executor:
        client.run(lambda: __import__("dduf_plus.format.validate"))  # workers import once, outside the timing
        startup = time.perf_counter() - started
        times, verdicts = [], Counter()
        for _ in range(repeat):
            t = time.perf_counter()
            verdicts = Counter(_verdict(r) for r in validate_many(urls, executor=executor, max_workers=jobs,
                                                                   ordered=False))
            times.append(time.perf_counter() - t)
    return startup, times, verdicts


def measure(label: str, fn, urls: list[str], jobs: int, repeat: int, rows: list[dict], **extra) -> None:
    times, verdicts = [], Counter()
    for _ in range(repeat):
        seconds, verdicts = fn(urls, jobs, **extra)
        times.append(seconds)
    row = {"mode": label, "jobs": jobs, "archives": len(urls), "seconds": times, "median_s": median(times),
           "archives_per_s": len(urls) / median(times), "verdicts": {str(k): v for k, v in verdicts.items()}}
    rows.append(row)
    print(f"{label:<12} jobs {jobs:>3}  {len(urls):>5} archives  median {row['median_s']:7.2f} s  "
          f"{row['archives_per_s']:7.1f} archives/s  {dict(verdicts)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--latency", type=float, default=0.02, help="seconds slept before each answer")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--serial", type=int, default=50, help="archives of the --jobs 1 runs")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-dask", action="store_true")
    args = parser.parse_args()

    folder = WORK / "catalogue"
    names = build_catalogue(folder, args.count)
    server, port = start_server(folder, args.latency)
    rows: list[dict] = []
    result: dict = {"count": args.count, "latency_s": args.latency, "repeat": args.repeat,
                    "cpu_count": os.cpu_count(), "serial_subset": args.serial,
                    "mix": {"hostile": sum(1 for i in range(args.count) if i % 5 == 0),
                            "tiny_pipelines": sum(1 for i in range(args.count) if i % 10 == 1)}}
    try:
        urls = [f"http://127.0.0.1:{port}/{n}" for n in names]
        result["requests_per_archive"] = _requests_per_archive(folder, names[:100])
        if not args.no_dask:  # first: the longest start-up, and the figure most likely to be missing
            _dask(urls, max(args.jobs), args.repeat, rows, result)
            _write(result, rows)
        for jobs in args.jobs:
            subset = urls[: args.serial] if jobs == 1 else urls
            measure("api-threads", run_api, subset, jobs, args.repeat, rows)
            measure("cli", run_cli, subset, jobs, args.repeat, rows, listing=folder / "_urls.txt")
            _write(result, rows)  # after each job count: a run cut short still leaves its figures
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(10)
    for key, value in result["ratios"].items():
        print(f"{key}: {value:.2f}x")
    print(f"wrote {RESULTS / 'catalogue.json'}")


def _write(result: dict, rows: list[dict]) -> None:
    result["runs"] = rows
    result["ratios"] = _ratios(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(RESULTS / "catalogue.json", result)


def _dask(urls: list[str], jobs: int, repeat: int, rows: list[dict], result: dict) -> None:
    measured = run_dask(urls, jobs, repeat)
    if measured is None:
        print("dask: distributed is not installed (pip install 'dduf_plus[dask]'); skipped")
        return
    startup, times, verdicts = measured
    result["dask_startup_s"] = startup
    row = {"mode": "dask-local", "jobs": jobs, "archives": len(urls), "seconds": times, "median_s": median(times),
           "archives_per_s": len(urls) / median(times), "verdicts": {str(k): v for k, v in verdicts.items()},
           "cluster": "LocalCluster(n_workers=2, processes=True)"}
    rows.append(row)
    print(f"{'dask-local':<12} jobs {jobs:>3}  {len(urls):>5} archives  median {row['median_s']:7.2f} s  "
          f"{row['archives_per_s']:7.1f} archives/s  {dict(verdicts)}  (cluster start {startup:.1f} s)")


def _requests_per_archive(folder: Path, names: list[str]) -> float:
    """Range requests one structural check makes, averaged over ``names`` (an in-process counting server)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from servers import FileServer

    from dduf_plus.format.validate import validate

    with FileServer(folder) as server:
        for name in names:
            validate(server.url(name))
        return (server.gets + server.heads) / len(names)


def _ratios(rows: list[dict]) -> dict[str, float]:
    rate = {(r["mode"], r["jobs"]): r["archives_per_s"] for r in rows}
    out = {}
    for (mode, jobs), value in rate.items():
        if jobs != 1 and (mode, 1) in rate:
            out[f"{mode} jobs {jobs} / jobs 1"] = value / rate[(mode, 1)]
    if ("dask-local", 32) in rate and ("api-threads", 32) in rate:
        out["dask-local 32 / api-threads 32"] = rate[("dask-local", 32)] / rate[("api-threads", 32)]
    return out


if __name__ == "__main__":
    main()
