#!/usr/bin/env python
"""Scale: how each step's cost grows from the SD-1.5-shaped (2.1 GB) to the SDXL-shaped (6.9 GB) fp16 pipeline.

    python bench/bench_scale.py                      # both shapes, every stage (~45 min on 2 shared cores)
    python bench/bench_scale.py --shapes sdxl --stages warm,cold,remote
    python bench/bench_scale.py --table              # print the markdown table of bench/results/scale.json

Each step runs against its anchor in the same run, rounds interleaving the two, medians of the runs:

- pack: ``dduf pack`` (sha256 + CRC-32, aligned, fsync) vs ``zip -0 -r`` + ``sync`` (stored ZIP, CRC-32) and
  ``cp -r`` + ``sync`` (the disk's floor); source pages warmed with ``cat`` before each run (untimed);
- validate --verify: ``dduf validate --verify`` of the archive vs ``sha256sum`` of the folder's files, warm;
- load+touch, warm and cold: ``load_dduf(archive)`` vs ``DiffusionPipeline.from_pretrained(folder,
  dtype=float16)``, each in a fresh process with the libraries imported (and ``gc.collect()`` run) before the
  clock, then every parameter
  summed once (every page read); cold: files evicted first (drop_caches, else posix_fadvise DONTNEED, checked
  with mincore: bench_load.py's helpers), ``cat archive`` cold as the disk's floor;
- remote first load: ``load_dduf(URL)`` + touch with the remote cache cleared (on the work folder's disk) vs one
  sequential GET then ``load_dduf(local)`` + touch; served from 127.0.0.1 by tests/servers.FileServer in its
  own process, 20 ms round trip, 400 MB/s cap; the disk's write speed is measured in the same run.

"per GB" is the median divided by the archive's size; "growth" is SDXL's per-GB cost over SD-1.5's (1.00 is
linear); a step of ours is flagged when its growth exceeds its anchor's by more than 20 % (worse than linear
where the anchor is linear). Results merge into bench/results/scale.json by shape and stage, so one stage can be
re-run alone. The runs use private copies of each shape's folder and archive (so other benchmarks' warming,
eviction or mappings of the shared ones do not change the cache state these runs see), removed after the shape
unless --keep-copies. Work files: bench/_work (DDUF_BENCH_WORK): ~25 GB free beyond the two pipelines.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, ROOT, WORK, median, pipeline_archive, pipeline_folder, write_result  # noqa: E402
from bench_load import evict, files_of, resident_fraction, warm  # noqa: E402

OUT = RESULTS / "scale.json"
SHAPE_NAMES = {"sd15": "SD-1.5-shaped", "sdxl": "SDXL-shaped"}
STAGES = ("pack", "validate", "warm", "cold", "remote")
LATENCY, BANDWIDTH = 0.020, 400e6
# (stage, row of ours, its anchor): the pairs the table and the growth flags compare
PAIRS = {
    "pack": ("dduf pack (fsync)", "zip -0 -r + sync"),
    "validate": ("dduf validate --verify", "sha256sum folder files"),
    "warm": ("load_dduf + touch", "diffusers folder load + touch"),
    "cold": ("load_dduf + touch", "diffusers folder load + touch"),
    "remote": ("load_dduf(URL) first load + touch", "download, then load_dduf + touch"),
}
# the floor row of a stage (what no tool doing that step can beat here), where the stage has one
FLOORS = {"pack": "cp -r + sync", "validate": "hashlib sha256, all cores (floor)", "cold": "cat archive > /dev/null"}
SCRATCH = WORK / "scale-scratch"
DDUF = shutil.which("dduf") or str(Path(sys.executable).with_name("dduf"))  # the console script users run


# --- children --------------------------------------------------------------------------------------------------
def child(mode: str, path: str) -> None:
    """One fresh-process load + touch; prints RESULT {load, load_touch, rss_gb}."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import resource
    import urllib.request

    import diffusers
    import torch
    from diffusers import (  # noqa: F401  (imported before the clock, as a user's process has them)
        AutoencoderKL,
        DiffusionPipeline,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextModel, CLIPTextModelWithProjection  # noqa: F401

    sys.path.insert(0, str(ROOT))
    from dduf_plus import load_dduf

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    torch.set_num_threads(os.cpu_count() or 1)
    # The imports above leave the cyclic collector a full collection owing; without this it falls inside
    # whichever clock runs next (0.2-0.3 s here), charged to the loader for the imports.
    gc.collect()
    started = time.perf_counter()
    if mode == "folder":
        pipe = DiffusionPipeline.from_pretrained(path, dtype=torch.float16)
    elif mode == "download":  # one sequential GET, 8 MiB at a time, then the local load
        target = SCRATCH / "download.dduf"
        with urllib.request.urlopen(path, timeout=120) as response, open(target, "wb") as out:
            shutil.copyfileobj(response, out, 8 << 20)
        pipe = load_dduf(str(target))
    else:  # "dduf": a local path; "remote": a URL, with DDUF_PLUS_CACHE pointing at a cleared folder
        pipe = load_dduf(path)
    loaded = time.perf_counter()
    total = 0.0
    threads = torch.get_num_threads()
    # the touch sums on one thread: with two OpenMP threads, a busy neighbour on a core turns each small
    # reduction into a spin-wait (SD-1.5's UNet: 1 s instead of 0.07 s, for every loader alike)
    torch.set_num_threads(1)
    with torch.no_grad():
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                for p in component.parameters():
                    total += float(p.sum())
    torch.set_num_threads(threads)
    touched = time.perf_counter()
    print("RESULT " + json.dumps({"load": loaded - started, "load_touch": touched - started,
                                   "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))


def serve(root: str) -> None:
    """Serve ``root`` on 127.0.0.1 until stdin closes (its own process: no GIL shared with the loader)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from servers import FileServer

    with FileServer(root, latency=LATENCY, bandwidth=BANDWIDTH) as srv:
        print(srv.server_port, flush=True)
        sys.stdin.read()


def run_child(mode: str, path: str, env: dict[str, str] | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--path", path]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{mode} {path} failed:\n{done.stderr[-3000:]}")


def timed_cmd(cmd: list[str] | str, then_sync: bool = False) -> float:
    os.sync()  # untimed: no dirty pages of an earlier run land on this clock
    started = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, shell=isinstance(cmd, str))
    if then_sync:
        os.sync()
    return time.perf_counter() - started


def clear(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


# --- stages: each returns {row: [seconds, ...]} --------------------------------------------------------------
def stage_pack(folder: Path, archive: Path, runs: int) -> dict[str, list[float]]:
    out_dduf, out_zip, out_cp = SCRATCH / "pack.dduf", SCRATCH / "pack.zip", SCRATCH / "pack-cp"
    dduf = [DDUF, "pack", str(folder), "-o", str(out_dduf), "-f", "-q"]
    tools = {
        "dduf pack (fsync)": (dduf, out_dduf, False),
        "zip -0 -r + sync": (f"cd {folder} && zip -0 -r -q {out_zip} .", out_zip, True),
        "cp -r + sync": (["cp", "-r", str(folder), str(out_cp)], out_cp, True),
    }
    rows: dict[str, list[float]] = {name: [] for name in tools}
    for _ in range(runs):
        for name, (cmd, out, then_sync) in tools.items():
            warm(files_of(folder))
            rows[name].append(timed_cmd(cmd, then_sync))
            clear(out)
            log(name, rows[name][-1])
    return rows


def stage_validate(folder: Path, archive: Path, runs: int) -> dict[str, list[float]]:
    ours = [DDUF, "validate", "--verify", "-q", str(archive)]
    anchor = ["sha256sum", *map(str, files_of(folder))]
    floor = "hashlib sha256, all cores (floor)"
    rows: dict[str, list[float]] = {PAIRS["validate"][0]: [], PAIRS["validate"][1]: [], floor: []}
    for _ in range(runs):
        for name, cmd, files in ((PAIRS["validate"][0], ours, [archive]), (PAIRS["validate"][1], anchor,
                                                                           files_of(folder)), (floor, None, [archive])):
            warm(files)
            resident = resident_fraction(files)
            rows[name].append(timed_cmd(cmd) if cmd else sha256_floor(archive))
            log(name, rows[name][-1], f"(resident before: {resident:.0%})")
    return rows


def sha256_floor(path: Path, piece: int = 8 << 20) -> float:
    """Seconds for hashlib (OpenSSL) to sha256 the file in ``cpu_count`` independent streams, in process:
    the least any verifier of this many bytes can spend here (coreutils' sha256sum is one stream)."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    size = path.stat().st_size
    workers = os.cpu_count() or 1
    stride = -(-size // workers)

    def hash_range(start: int) -> str:
        digest, buffer = hashlib.sha256(), bytearray(piece)
        view = memoryview(buffer)
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            left = min(stride, size - start)
            while left > 0:
                n = f.readinto(view[: min(piece, left)])  # one reused buffer: no fresh pages per read
                digest.update(view[:n])  # releases the GIL on large buffers: the streams run in parallel
                left -= n
        return digest.hexdigest()

    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(hash_range, range(0, size, stride)))
    return time.perf_counter() - started


def stage_load(folder: Path, archive: Path, runs: int, cold: bool) -> dict[str, list[float]]:
    ours, anchor = PAIRS["cold" if cold else "warm"]
    rows: dict[str, list[float]] = {ours: [], anchor: [], "cat archive > /dev/null": []}
    rss: dict[str, list[float]] = {ours: [], anchor: []}
    for _ in range(runs):
        for name, mode, path in ((ours, "dduf", archive), (anchor, "folder", folder)):
            files = files_of(path)
            if cold:
                evict_or_wait(files)
            else:
                warm(files)
            result = run_child(mode, str(path))
            rows[name].append(result["load_touch"])
            rows.setdefault(f"{name}: load only", []).append(result["load"])
            rss[name].append(result["rss_gb"])
            log(name, result["load_touch"], f"(load {result['load']:.2f} s, peak RSS {result['rss_gb']:.2f} GB)")
        if cold:
            evict_or_wait([archive])
            rows["cat archive > /dev/null"].append(timed_cmd(["cat", str(archive)]))
            log("cat archive", rows["cat archive > /dev/null"][-1])
    if not cold:
        del rows["cat archive > /dev/null"]
    rows.update({f"peak RSS GB: {k}": v for k, v in rss.items()})
    return rows


def evict_or_wait(files: list[Path], tries: int = 20) -> None:
    """Evict the files' pages; pages another process has mapped stay: retry a while, then say so and go on."""
    for _ in range(tries):
        if evict(files):
            return
        time.sleep(3)
    print(f"  warning: {resident_fraction(files):.0%} of {files[0].parent} still resident: not fully cold")


def stage_remote(folder: Path, archive: Path, runs: int) -> dict[str, list[float]]:
    ours, anchor = PAIRS["remote"]
    rows: dict[str, list[float]] = {ours: [], anchor: [], "disk write MB/s": []}
    cache = SCRATCH / "remote-cache"
    server = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", str(archive.parent)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{int(server.stdout.readline())}/{archive.name}"  # type: ignore[union-attr]
        env = {"HF_HUB_OFFLINE": "0", "DDUF_PLUS_CACHE": str(cache)}
        for _ in range(runs):
            rows["disk write MB/s"].append(disk_write_mbps())
            warm([archive])  # the server reads from memory: the link and the client are measured
            clear(cache)
            rows[ours].append(run_child("remote", url, env)["load_touch"])
            clear(cache)
            rows[anchor].append(run_child("download", url, env)["load_touch"])
            clear(SCRATCH / "download.dduf")
            log(ours, rows[ours][-1], f"vs download-then-load {rows[anchor][-1]:.2f} s, "
                f"disk {rows['disk write MB/s'][-1]:.0f} MB/s")
    finally:
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(30)
    return rows


def disk_write_mbps(size: int = 1 << 30) -> float:
    """The work folder's disk: MB/s writing 1 GiB of incompressible bytes, fsync included."""
    block = os.urandom(8 << 20)
    target = SCRATCH / "disk-speed.bin"
    os.sync()
    started = time.perf_counter()
    with open(target, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    target.unlink()
    return size / seconds / 1e6


def log(name: str, seconds: float, extra: str = "") -> None:
    print(f"  {name:40} {seconds:8.2f} {extra} (load average {os.getloadavg()[0]:.1f})", flush=True)


# --- report ------------------------------------------------------------------------------------------------
def summarise(rows: dict[str, list[float]], size: int) -> dict[str, dict]:
    out = {}
    for name, values in rows.items():
        row = {"runs": [round(v, 3) for v in values], "median": round(median(values), 3)}
        if not name.startswith(("peak RSS", "disk")):
            row["per_gb_s"] = round(median(values) / (size / 1e9), 3)
        out[name] = row
    return out


def growth(report: dict) -> dict[str, dict]:
    """Per stage: ours', the anchor's and the floor's per-GB growth from SD-1.5 to SDXL; ours is worse than
    linear when it grows more than 20 % beyond 1.00 and beyond what the anchor and the floor (the disk) grew."""
    out = {}
    small, big = report["shapes"].get("sd15", {}), report["shapes"].get("sdxl", {})

    def grew(stage: str, row: str | None) -> float | None:
        try:
            return big[stage][row]["per_gb_s"] / small[stage][row]["per_gb_s"]
        except KeyError:
            return None

    for stage, (ours, anchor) in PAIRS.items():
        g_ours, g_anchor, g_floor = grew(stage, ours), grew(stage, anchor), grew(stage, FLOORS.get(stage))
        if g_ours is None or g_anchor is None:
            continue
        worst_allowed = max(1.0, g_anchor, g_floor or 0.0)
        out[stage] = {"ours": round(g_ours, 2), "anchor": round(g_anchor, 2),
                      "floor": None if g_floor is None else round(g_floor, 2),
                      "worse_than_linear": g_ours > 1.2 * worst_allowed}
    return out


def table(report: dict) -> str:
    lines = ["| step | shape | ours (s) | ours per GB (s) | anchor | anchor (s) | anchor per GB (s) | ours / anchor |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    pairs = []
    for stage, (ours, anchor) in PAIRS.items():
        pairs.append((stage, ours, anchor))
        if stage in ("warm", "cold"):  # the load alone, before the touch's summing (same runs)
            pairs.append((stage, f"{ours}: load only", f"{anchor}: load only"))
    for stage, ours, anchor in pairs:
        for shape, data in report["shapes"].items():
            rows = data.get(stage)
            if not rows or ours not in rows:
                continue
            o, a = rows[ours], rows[anchor]
            lines.append(f"| {stage}: {ours.replace(' + touch: load only', ' (load only)')} | {SHAPE_NAMES[shape]} ({data['archive_gb']:.2f} GB) | {o['median']:.2f} "
                         f"({len(o['runs'])} runs) | {o['per_gb_s']:.2f} | {anchor.replace(' + touch: load only', ' (load only)')} | {a['median']:.2f} | "
                         f"{a['per_gb_s']:.2f} | {o['median'] / a['median']:.2f}x |")
    lines += ["", "| step | per-GB growth SD-1.5 -> SDXL, ours | anchor's | floor's | worse than linear? |",
              "| --- | --- | --- | --- | --- |"]
    for stage, g in report.get("growth", {}).items():
        floor = "" if g.get("floor") is None else f"{g['floor']:.2f}x ({FLOORS[stage]})"
        lines.append(f"| {stage} | {g['ours']:.2f}x | {g['anchor']:.2f}x | {floor} | "
                     f"{'YES' if g['worse_than_linear'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", default="sd15,sdxl")
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--runs", default="sd15=3,sdxl=2", help="rounds per shape (pack and remote: one fewer, "
                        "at least 1; cold: at most 2)")
    parser.add_argument("--keep-copies", action="store_true", help="keep the private copies (bench/_work/"
                        "scale-private, 18 GB for both shapes) for a later run")
    parser.add_argument("--table", action="store_true", help="print the table of the saved results and exit")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.path)
    if args.serve:
        return serve(args.serve)
    unknown = sorted(set(args.stages.split(",")) - set(STAGES))
    if unknown:
        parser.error(f"--stages: unknown {', '.join(unknown)} (stages: {', '.join(STAGES)})")
    report = json.loads(OUT.read_text()) if OUT.exists() else {"shapes": {}}
    if not args.table:
        runs = {k: int(v) for k, v in (item.split("=") for item in args.runs.split(","))}
        for shape in args.shapes.split(","):
            measure_shape(report, shape, args.stages.split(","), runs.get(shape, 1), args.keep_copies)
        report.update(growth=growth(report), cpu_count=os.cpu_count(), latency_s=LATENCY, bandwidth_Bps=BANDWIDTH,
                      command="python bench/bench_scale.py", unix_time=time.time())
        write_result(OUT, report)
        print(f"wrote {OUT.relative_to(ROOT)}")
    report["growth"] = growth(report)
    print(table(report))


def private_copies(shape: str) -> tuple[Path, Path]:
    """This benchmark's own copies of the shape's folder and archive: other benchmarks warming, evicting or
    mapping the shared ones (bench_load, bench_remote) cannot change what cache state these runs see."""
    folder, archive = pipeline_folder(shape), pipeline_archive(shape)
    own = WORK / "scale-private" / shape
    if not (own / ".complete").exists():
        shutil.rmtree(own, ignore_errors=True)
        own.mkdir(parents=True)
        shutil.copytree(folder, own / folder.name)
        shutil.copyfile(archive, own / archive.name)
        (own / ".complete").touch()
    return own / folder.name, own / archive.name


def measure_shape(report: dict, shape: str, stages: list[str], runs: int, keep: bool) -> None:
    folder, archive = private_copies(shape)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    size = archive.stat().st_size
    data = report["shapes"].setdefault(shape, {})
    data.update(archive_bytes=size, archive_gb=round(size / 1e9, 3))
    calls = {
        "pack": lambda: stage_pack(folder, archive, max(runs - 1, 1)),
        "validate": lambda: stage_validate(folder, archive, runs),
        "warm": lambda: stage_load(folder, archive, runs + 1, cold=False),
        "cold": lambda: stage_load(folder, archive, min(runs, 2), cold=True),
        "remote": lambda: stage_remote(folder, archive, max(runs - 1, 1)),
    }
    for stage in stages:
        print(f"{SHAPE_NAMES[shape]} ({size / 1e9:.2f} GB): {stage}", flush=True)
        data[stage] = summarise(calls[stage](), size)
        data[stage]["_load_average_after"] = round(os.getloadavg()[0], 2)  # others sharing the cores
        write_result(OUT, report)  # partial results survive an interrupted run
    shutil.rmtree(SCRATCH, ignore_errors=True)
    if not keep:
        shutil.rmtree(WORK / "scale-private" / shape)


if __name__ == "__main__":
    main()
