"""``dduf serve`` latency under load: N uploads and N URL checks (the hostile corpus and its valid baseline,
round-robin) sent by C concurrent clients to ``dduf serve`` running as its own process (as deployed; the
clients do not share its GIL), URLs served by tests/servers.py's FileServer on 127.0.0.1.

    python bench/bench_serve.py [-n 200] [--concurrency 1 16] [--workers 4] [--latency 0]

Prints p50/p99 latency (ms), requests/s and errors per mode and concurrency; writes bench/results/serve.json."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    import httpx
except ImportError:  # the serve extra and httpx (test extra) are needed
    httpx = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from servers import FileServer  # noqa: E402

HOSTILE = ROOT / "fixtures" / "hostile"
RESULTS = ROOT / "bench" / "results"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(files_url: str, workers: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dduf_plus.cli", "serve", "--port", str(port), "--allow-private",
                             "--allow-url-prefix", files_url, "--workers", str(workers), "--queue", "1024"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/healthz").status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("dduf serve did not start")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(base: str, mode: str, names: list[str], files_url: str, n: int, concurrency: int) -> dict:
    bodies = {name: (HOSTILE / name).read_bytes() for name in names}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(base_url=base, timeout=120, limits=limits) as client:
        def one(i: int) -> tuple[float, int]:
            name = names[i % len(names)]
            started = time.perf_counter()
            if mode == "upload":
                r = client.post(f"/v1/validate?name={name}", content=bodies[name])
            else:
                r = client.post("/v1/validate", json={"url": files_url + name})
            return time.perf_counter() - started, r.status_code

        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, range(n)))
        wall = time.perf_counter() - started
    latencies = [t for t, _ in results]
    errors = sum(1 for _, status in results if status != 200)
    row = {"mode": mode, "requests": n, "concurrency": concurrency, "errors": errors, "wall_s": wall,
           "requests_per_s": n / wall, "p50_ms": 1000 * percentile(latencies, 0.5),
           "p99_ms": 1000 * percentile(latencies, 0.99), "max_ms": 1000 * max(latencies)}
    print(f"{mode:<7} c={concurrency:<3} n={n}  p50 {row['p50_ms']:7.1f} ms  p99 {row['p99_ms']:7.1f} ms  "
          f"{row['requests_per_s']:7.1f} req/s  errors {errors}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=200, help="requests per mode and concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--workers", type=int, default=4, help="dduf serve --workers")
    parser.add_argument("--latency", type=float, default=0.0, help="FileServer round trip per request (s)")
    args = parser.parse_args()
    if httpx is None:
        raise SystemExit('needs httpx and the serve extra: pip install "dduf_plus[serve]" httpx')
    names = sorted(p.name for p in HOSTILE.glob("*.dduf"))
    rows = []
    with FileServer(HOSTILE, latency=args.latency) as files:
        proc, base = start_serve(files.url(), args.workers)
        try:
            for mode in ("upload", "url"):
                run(base, mode, names, files.url(), min(args.n, 20), max(args.concurrency))  # warm-up
                rows += [run(base, mode, names, files.url(), args.n, c) for c in args.concurrency]
        finally:
            proc.terminate()
            proc.wait(20)
    result = {"n": args.n, "workers": args.workers, "latency_s": args.latency, "cpu_count": os.cpu_count(),
              "archives": len(names), "runs": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    from provenance import write_result

    write_result(RESULTS / "serve.json", result)
    print(f"wrote {RESULTS / 'serve.json'}")


if __name__ == "__main__":
    main()
