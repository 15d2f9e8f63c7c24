"""The Hub and hosted references, measured against local servers on 127.0.0.1 (tests/hub_server.py, tests/servers.py).

Rows:
- ``load_dduf("org/repo", dduf_file=...)`` of tiny-sd: first load (empty Hugging Face cache: download + load),
  cached online (huggingface_hub revalidates with one HEAD), cached offline (no request), the local file;
- a hosted reference (``--ref vae=http://127.0.0.1/base.dduf``): bytes fetched to resolve the vae vs the hosted
  archive's size, first resolution and second (cached by content, no request). ``--sd15`` adds the SD-1.5-shaped
  2.1 GB archive (built once under bench/_work).

    python bench/bench_hub.py [--repeat 5] [--sd15]

Prints medians and writes bench/results/hub.json."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _common import RESULTS, ROOT, median, write_result  # noqa: E402

os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def _point_hub_at(url: str, cache: Path, offline: bool) -> None:
    import huggingface_hub.constants as constants

    constants.ENDPOINT = url
    constants.HUGGINGFACE_CO_URL_TEMPLATE = url + "/{repo_id}/resolve/{revision}/{filename}"
    constants.HF_HUB_OFFLINE = offline
    constants.HF_HUB_CACHE = str(cache)
    os.environ.update(HF_ENDPOINT=url, HF_HUB_OFFLINE="1" if offline else "0", HF_HUB_CACHE=str(cache))


def bench_load(repeat: int, work: Path) -> dict:
    from hub_server import HubServer

    from dduf_plus import load_dduf
    from dduf_plus.format.pack import pack_folder

    archive = pack_folder(ROOT / "fixtures" / "pipelines" / "tiny-sd", work / "tiny-sd.dduf", quiet=True).path
    from dduf_plus.remote.hub import hub_archive

    rows: dict[str, list[float]] = {"first": [], "cached_online": [], "cached_offline": [], "local": []}
    resolve: dict[str, list[float]] = {k: [] for k in rows}
    requests: dict[str, int] = {}
    with HubServer() as hub:
        hub.add("bench/tiny-sd-dduf", {"tiny-sd.dduf": archive.read_bytes()})
        load_dduf(archive)  # imports and first-use costs out of the way
        for i in range(repeat):
            cache = work / f"hf-cache-{i}"
            for kind, offline in (("first", False), ("cached_online", False), ("cached_offline", True)):
                _point_hub_at(hub.url, cache, offline)
                hub.reset()
                t0 = time.perf_counter()
                load_dduf("bench/tiny-sd-dduf", dduf_file="tiny-sd.dduf")
                rows[kind].append(time.perf_counter() - t0)
                requests[kind] = len(hub.requests)
                # the Hub step alone (the archive is cached by now: time it in a fresh cache for "first")
                step_cache = work / f"hf-step-{i}" if kind == "first" else cache
                _point_hub_at(hub.url, step_cache, offline)
                t0 = time.perf_counter()
                hub_archive("bench/tiny-sd-dduf", "tiny-sd.dduf")
                resolve[kind].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            load_dduf(archive)
            rows["local"].append(time.perf_counter() - t0)
    resolve["local"] = [0.0]
    out = {k: {"median_s": round(median(v), 4), "hub_step_s": round(median(resolve[k]), 4),
               "requests": requests.get(k, 0)} for k, v in rows.items()}
    out["archive_bytes"] = archive.stat().st_size
    return out


def bench_hosted(archive_folder: Path, label: str, repeat: int, work: Path) -> dict:
    """Pack ``archive_folder`` with its vae referenced inside its own archive hosted on 127.0.0.1, then resolve."""
    from servers import FileServer

    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.format.pack import pack_folder
    from dduf_plus.packing import pack
    from dduf_plus.refs.resolve import locate_component

    www = work / f"www-{label}"
    www.mkdir(exist_ok=True)
    hosted = www / "base.dduf"
    if not hosted.exists():
        pack_folder(archive_folder, hosted, quiet=True)
    fetched, first, second = [], [], []
    import huggingface_hub.constants as constants

    constants.HF_HUB_OFFLINE = False  # online: an offline session never fetches hosted archives either
    os.environ["HF_HUB_OFFLINE"] = "0"
    with FileServer(www) as server:
        partial = work / f"{label}-partial.dduf"
        pack(archive_folder, partial, exclude=["vae"], refs={"vae": server.url("base.dduf")}, quiet=True)
        with DDUFArchive(partial) as a:
            ref = a.references["vae"]
        for i in range(repeat):
            os.environ["DDUF_PLUS_CACHE"] = str(work / f"dduf-cache-{label}-{i}")
            server.reset()
            t0 = time.perf_counter()
            locate_component("vae", ref)
            first.append(time.perf_counter() - t0)
            fetched.append(server.body_bytes)
            server.reset()
            t0 = time.perf_counter()
            locate_component("vae", ref)
            second.append(time.perf_counter() - t0)
            assert server.gets == 0
    component = sum(r["size"] for r in ref["files"].values())
    size = hosted.stat().st_size
    return {"archive_bytes": size, "component_bytes": component, "fetched_bytes": int(median(fetched)),
            "fetched_over_archive": round(median(fetched) / size, 4),
            "fetched_over_component": round(median(fetched) / component, 3),
            "first_s": round(median(first), 4), "cached_s": round(median(second), 4), "cached_requests": 0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sd15", action="store_true", help="also the SD-1.5-shaped 2.1 GB archive (slow to build)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-hub-"))
    os.environ["DDUF_PLUS_CACHE"] = str(work / "dduf-cache")
    try:
        result = {"load_repo": bench_load(args.repeat, work),
                  "hosted_ref": {"tiny-sd": bench_hosted(ROOT / "fixtures" / "pipelines" / "tiny-sd", "tiny", args.repeat, work)}}
        if args.sd15:
            from _common import sd15_folder

            result["hosted_ref"]["sd15"] = bench_hosted(sd15_folder(), "sd15", max(1, args.repeat // 2), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lr = result["load_repo"]
    print(f"load_dduf(repo) tiny-sd ({lr['archive_bytes']} B), medians of {args.repeat}:")
    for kind in ("first", "cached_online", "cached_offline", "local"):
        row = lr[kind]
        print(f"  {kind:<15} {row['median_s'] * 1000:8.1f} ms  {row['median_s'] / lr['local']['median_s']:5.2f}x local"
              f"  (Hub step {row['hub_step_s'] * 1000:6.1f} ms, {row['requests']} requests)")
    for name, row in result["hosted_ref"].items():
        print(f"hosted vae reference, {name}: fetched {row['fetched_bytes']} B of a {row['archive_bytes']} B archive "
              f"({100 * row['fetched_over_archive']:.1f}%; vae {row['component_bytes']} B, "
              f"{row['fetched_over_component']:.2f}x), first {row['first_s'] * 1000:.0f} ms, cached "
              f"{row['cached_s'] * 1000:.0f} ms, 0 requests")
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(RESULTS / "hub.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
