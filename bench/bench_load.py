#!/usr/bin/env python
"""Load benchmark: ``load_dduf`` against diffusers' own loaders on an SD-1.5-shaped (2.1 GB) or SDXL-shaped
(6.9 GB) fp16 pipeline, and the first load in a fresh process on the tiny fixture.

    python bench/bench_load.py                # full run (~10 min on 2 cores), writes bench/results/load.{json,png}
    python bench/bench_load.py --shape sdxl   # SDXL-shaped: bench/results/load_sdxl.{json,png} (no 0.35.2 rows)
    python bench/bench_load.py --runs 3 --skip-old --skip-cold

Every measurement runs in a fresh subprocess with the libraries and model classes imported before the
clock starts, and ``gc.collect()`` run then (the imports leave a full collection owing, 0.2-0.3 s, that would
otherwise fall inside whichever loader runs); each figure is the median of several runs, and ratios are
against anchors measured in the same run (so a busy machine moves both sides). Measured per loader: load (until the pipeline object
exists), load+touch (then sum every parameter once: every page read) and peak RSS (ru_maxrss).

Loaders: ``load_dduf`` (auto dtype; with and without read-ahead; the pread path), diffusers 0.42 folder
load with ``dtype=float16``, and diffusers 0.35.2 ``from_pretrained(..., dduf_file=...)`` (the last diffusers
that loads DDUF; installed in bench/_work/venv-diffusers-0.35) on a huggingface_hub-written archive and on
ours. Cold cache: the files are evicted with ``posix_fadvise(DONTNEED)`` (no root needed; residency checked
with ``mincore``), or ``/proc/sys/vm/drop_caches`` when writable; ``cat archive > /dev/null`` is the floor.

Fresh process (``fresh:`` rows): what a new Python process pays for its first pipeline, imports included:
``from dduf_plus import load_dduf; load_dduf(tiny archive)`` against ``from diffusers import DiffusionPipeline;
DiffusionPipeline.from_pretrained(tiny folder)``, timed from before the first import to the pipeline object
(and the whole process, interpreter start and exit included), on the fixture pipeline tiny-sd (1.3 MB)."""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
VENV = ROOT / "bench" / "_work" / "venv-diffusers-0.35"
OLD_DIFFUSERS = "0.35.2"
TARGETS = {
    "warm load+touch vs folder": ("<=", 0.6),
    "fresh-process first load vs folder": ("<=", 1.0),
    "peak RSS vs folder": ("<=", 1.05),
    "speed-up vs diffusers 0.35.2": (">=", 10.0),
    "peak RSS vs diffusers 0.35.2": ("<=", 0.5),
    "cold load+touch vs cat": ("<=", 1.15),
}


# The classes each shape's pipeline is built from: imported before the clock starts (warm and cold rows time
# loading, not importing; the fresh rows time both).
CLASSES = {
    "sd15": ("diffusers:AutoencoderKL DiffusionPipeline PNDMScheduler StableDiffusionPipeline UNet2DConditionModel",
             "transformers:CLIPTextModel CLIPTokenizer"),
    "sdxl": ("diffusers:AutoencoderKL DiffusionPipeline EulerDiscreteScheduler StableDiffusionXLPipeline "
             "UNet2DConditionModel", "transformers:CLIPTextModel CLIPTextModelWithProjection CLIPTokenizer"),
}
SHAPE_TITLES = {"sd15": "an SD-1.5-shaped", "sdxl": "an SDXL-shaped"}


# --- child: one measurement ------------------------------------------------------------------------------
def fresh_child(mode: str, path: str) -> None:
    """The first load in this (fresh) process, imports included: the clock starts before the first import."""
    started = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if mode == "fresh-dduf":
        sys.path.insert(0, str(ROOT))
        from dduf_plus import load_dduf

        pipe = load_dduf(path)
    else:
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(path)
    loaded = time.perf_counter()
    print("RESULT " + json.dumps({"load": loaded - started, "load_touch": loaded - started, "rss_gb": 0.0,
                                   "dtypes": {n: str(getattr(c, "dtype", "")) for n, c in pipe.components.items()
                                              if hasattr(c, "dtype")}}))


def child(mode: str, path: str, shape: str = "sd15") -> None:
    if mode.startswith("fresh-"):
        fresh_child(mode, path)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import importlib
    import resource

    import diffusers
    import torch
    from diffusers import DiffusionPipeline

    for spec in CLASSES[shape]:
        module, names = spec.split(":")
        for name in names.split():
            getattr(importlib.import_module(module), name)

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    torch.set_num_threads(os.cpu_count() or 1)
    if mode.startswith("dduf"):
        sys.path.insert(0, str(ROOT))
        from dduf_plus import load_dduf

        options = {"dduf": {}, "dduf-prefetch": {"prefetch": True}, "dduf-noprefetch": {"prefetch": False},
                   "dduf-pread": {"use_mmap": False}}[mode]
        load = lambda: load_dduf(path, **options)  # noqa: E731
    elif mode == "folder":
        load = lambda: DiffusionPipeline.from_pretrained(path, dtype=torch.float16)  # noqa: E731
    elif mode.startswith("old"):
        folder, name = os.path.split(path)
        load = lambda: DiffusionPipeline.from_pretrained(folder, dduf_file=name, torch_dtype=torch.float16)  # noqa: E731
    else:
        raise SystemExit(f"unknown mode {mode}")
    # The imports above leave the cyclic collector a full collection owing; without this it falls inside
    # whichever clock runs next (0.2-0.3 s here), charged to the loader for the imports.
    gc.collect()
    started = time.perf_counter()
    pipe = load()
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
    dtypes = {n: str(getattr(c, "dtype", "")) for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    print("RESULT " + json.dumps({"load": loaded - started, "load_touch": touched - started,
                                   "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                                   "dtypes": dtypes, "checksum": total}))


# --- page cache control ------------------------------------------------------------------------------------
def files_of(path: Path) -> list[Path]:
    return [path] if path.is_file() else [p for p in sorted(path.rglob("*")) if p.is_file()]


def evict(paths: list[Path]) -> bool:
    """Drop the files' pages from the page cache. True when (nearly) nothing stays resident."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return resident_fraction(paths) < 0.02


def warm(paths: list[Path]) -> None:
    for p in paths:
        subprocess.run(["cat", str(p)], stdout=subprocess.DEVNULL, check=True)


def same_provenance(paths: list[Path]) -> bool:
    """Evict the files, then read each once with ``cat``: every loader's files enter the page cache the same way.
    How pages came in decides their folio size (ext4 on 6.x kernels: a sequential read or an earlier load's
    read-ahead builds 2 MiB folios that a mapping faults in whole; written or fault-read pages stay small), and
    a warm touch of 2 GB then costs 0.10 s or 0.16 s. False (and only warmed) where eviction is not permitted."""
    evicted = evict(paths)
    warm(paths)
    return evicted


def resident_fraction(paths: list[Path]) -> float:
    """Share of the files' pages in the page cache (mincore over a private map; nothing is read)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    resident = pages = 0
    for p in paths:
        size = p.stat().st_size
        if size == 0:
            continue
        with open(p, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        n = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(n)
        anchor = ctypes.c_char.from_buffer(mm)
        libc.mincore(ctypes.addressof(anchor), size, vec)
        del anchor
        resident += sum(b & 1 for b in vec.raw)
        pages += n
        mm.close()
    return resident / pages if pages else 0.0


# --- parent --------------------------------------------------------------------------------------------------
def measure(mode: str, path: Path, python: str, files: list[Path], *, cold: bool, shape: str = "sd15") -> dict | None:
    if cold:
        if not evict(files):
            return None
    else:
        warm(files)
    cmd = [python, str(Path(__file__).resolve()), "--child", mode, "--path", str(path), "--shape", shape]
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    process = time.perf_counter() - started
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[7:]), "process_s": process}
    raise RuntimeError(f"{mode} failed:\n{out.stderr[-3000:]}")


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def cat_seconds(path: Path, cold: bool) -> float | None:
    if cold and not evict([path]):
        return None
    if not cold:
        warm([path])
    started = time.perf_counter()
    subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def prepare(skip_old: bool, shape: str = "sd15") -> dict[str, Path]:
    import _common
    from _common import WORK

    if hasattr(_common, "pipeline_folder"):
        folder, archive = _common.pipeline_folder(shape), _common.pipeline_archive(shape)
    elif shape == "sd15":
        folder, archive = _common.sd15_folder(), _common.sd15_archive()
    else:
        raise SystemExit(f"--shape {shape}: bench/_common.py has no generator for it")
    paths = {"folder": folder, "dduf": archive, **tiny_pipeline()}
    if not skip_old:
        hub = WORK / "old-hub" / "sd15.dduf"
        if not hub.exists():
            from huggingface_hub import export_folder_as_dduf

            hub.parent.mkdir(parents=True, exist_ok=True)
            export_folder_as_dduf(hub.with_suffix(".tmp"), folder)
            os.replace(hub.with_suffix(".tmp"), hub)
        ours = WORK / "old-ours" / "sd15.dduf"
        if not ours.exists():
            ours.parent.mkdir(parents=True, exist_ok=True)
            os.link(archive, ours)  # same bytes, in a folder of its own (dduf_file= wants one)
        paths["old-hub"], paths["old-ours"] = hub, ours
    return paths


def tiny_pipeline() -> dict[str, Path]:
    """The fixture tiny-sd as a folder and as an archive packed from it (once, under bench/_work)."""
    from _common import WORK

    folder = ROOT / "fixtures" / "pipelines" / "tiny-sd"
    archive = WORK / "tiny-sd.dduf"
    if not archive.exists():
        sys.path.insert(0, str(ROOT))
        from dduf_plus.format.pack import pack_folder

        WORK.mkdir(parents=True, exist_ok=True)
        pack_folder(folder, archive, quiet=True)
    return {"fresh-folder": folder, "fresh-dduf": archive}


def old_python() -> str:
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)], check=True)
    if sys.prefix != sys.base_prefix:  # run from a virtual environment: the old one sees its packages (torch...)
        site = next(Path(VENV / "lib").glob("python3*/site-packages"))
        ours = [p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix)]
        (site / "_bench_parent_env.pth").write_text("".join(f"{p}\n" for p in ours))  # after its own diffusers
    probe = subprocess.run([str(python), "-c", "import diffusers; print(diffusers.__version__)"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != OLD_DIFFUSERS:
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"diffusers=={OLD_DIFFUSERS}"], check=True)
    return str(python)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=sorted(CLASSES), default="sd15",
                        help="the work pipeline: sd15 (2.1 GB, default) or sdxl (6.9 GB; no diffusers 0.35.2 rows)")
    parser.add_argument("--runs", type=int, default=5, help="warm runs per loader (median)")
    parser.add_argument("--cold-runs", type=int, default=3)
    parser.add_argument("--fresh-runs", type=int, default=7, help="fresh-process first loads per loader (median)")
    parser.add_argument("--old-runs", type=int, default=3, help="runs of the (slow) diffusers 0.35.2 loader")
    parser.add_argument("--skip-old", action="store_true", help="skip diffusers 0.35.2")
    parser.add_argument("--skip-cold", action="store_true")
    parser.add_argument("--skip-fresh", action="store_true", help="skip the fresh-process first-load rows")
    parser.add_argument("--loaders", help="only these loaders (comma-separated: dduf,dduf-prefetch,dduf-noprefetch,dduf-pread,"
                                          "folder,old-hub,old-ours); fresh rows always compare dduf and folder")
    parser.add_argument("--out", help="default: bench/results/load.json (sd15), load_sdxl.json (sdxl)")
    parser.add_argument("--from-json", help="re-render the table, ratios and chart from a saved load.json "
                        "(the JSON itself, and its provenance, are left as measured)")
    args = parser.parse_args()
    out = Path(args.out or ROOT / "bench" / "results" / ("load.json" if args.shape == "sd15" else f"load_{args.shape}.json"))
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        for r in saved["results"].values():
            r["best_load_touch"] = min(x["load_touch"] for x in r["samples"])
        results, cat, shape = saved["results"], saved["cat_archive_s"], saved.get("shape", "sd15")
        print_table(results, cat, compute_ratios(results, cat))
        chart(results, cat, Path(args.from_json).with_suffix(".png"), shape, saved.get("archive_bytes"))
        return
    if args.child:
        child(args.child, args.path, args.shape)
        return
    skip_old = args.skip_old or args.shape != "sd15"  # 0.35.2 copies everything: 16+ GB for the SDXL shape
    paths = prepare(skip_old, args.shape)
    pythons = {m: sys.executable for m in ("dduf", "dduf-prefetch", "dduf-noprefetch", "dduf-pread", "folder",
                                            "fresh-dduf", "fresh-folder")}
    if not skip_old:
        pythons["old-hub"] = pythons["old-ours"] = old_python()
    # The old loader's 5-6 GB of anonymous memory pushes the others' page cache out: it gets a phase of its own.
    phases = [("warm", ["dduf", "dduf-prefetch", "dduf-noprefetch", "dduf-pread", "folder"])]
    if not args.skip_fresh and args.shape == "sd15":  # tiny-sd whatever the shape: measured once, with sd15
        phases.append(("fresh", ["dduf", "folder"]))
    if not skip_old:
        phases.append(("warm", ["old-hub", "old-ours"]))
    if not args.skip_cold:
        phases.append(("cold", ["dduf", "dduf-prefetch", "dduf-noprefetch", "dduf-pread", "folder"]))
    if args.loaders:
        keep = set(args.loaders.split(","))
        phases = [(c, [m for m in ms if c == "fresh" or m in keep]) for c, ms in phases]
        phases = [(c, ms) for c, ms in phases if ms]
    results: dict[str, dict] = {}
    cat: dict[str, float] = {}
    for cache, modes in phases:
        wanted = {m: args.old_runs if m.startswith("old") else
                  {"warm": args.runs, "cold": args.cold_runs, "fresh": args.fresh_runs}[cache] for m in modes}
        run_phase(cache, modes, wanted, paths, pythons, args.shape, results, cat)
        finish(results, cat, out, args.shape)  # after each phase: a long run that fails later keeps what it measured


def _path_key(mode: str) -> str:
    """The entry of ``paths`` a (non-fresh) loader mode reads: the folder, an old loader's archive, or ours."""
    return "folder" if mode == "folder" else mode if mode.startswith("old") else "dduf"


def run_phase(cache: str, modes: list[str], wanted: dict[str, int], paths: dict[str, Path], pythons: dict[str, str],
              shape: str, results: dict, cat: dict) -> None:
    """One cache state: every loader once per round (a machine that gets busier, or a host cache that warms
    up, moves all loaders alike, and the ratios stay meaningful); medians into ``results``."""
    samples: dict[str, list[dict] | None] = {m: [] for m in modes}
    cats: list[float] = []
    if cache == "warm":
        files = [f for key in sorted({_path_key(m) for m in modes}) for f in files_of(paths[key])]
        if not same_provenance(files):
            print("warm: files could not be evicted first; their page-cache state is whatever it was")
    for round_ in range(max(wanted.values())):
        for mode in modes:
            got = samples[mode]
            if round_ >= wanted[mode] or got is None:
                continue
            child_mode = f"fresh-{mode}" if cache == "fresh" else mode
            path = paths[child_mode if cache == "fresh" else _path_key(mode)]
            try:
                sample = measure(child_mode, path, pythons[child_mode], files_of(path), cold=cache == "cold",
                                 shape=shape)
            except RuntimeError as e:  # one loader failing (the old diffusers' environment) leaves the others
                print(f"{cache} {mode} failed, left out: {str(e)[-400:]}")
                samples[mode] = None
                continue
            if sample is None:
                print(f"cold cache cannot be produced here; skipping cold {mode}")
                samples[mode] = None
                continue
            got.append(sample)
            print(f"{cache:5} {mode:16} round {round_ + 1}: load {sample['load']:.3f} s  "
                  f"load+touch {sample['load_touch']:.3f} s  RSS {sample['rss_gb']:.2f} GB  "
                  f"process {sample['process_s']:.2f} s", flush=True)
        if cache != "fresh" and (seconds := cat_seconds(paths["dduf"], cold=cache == "cold")) is not None:
            cats.append(seconds)
    if cats and cache not in cat:
        cat[cache] = median(cats)
    for mode, got in samples.items():
        if got:
            results[f"{cache}:{mode}"] = {
                "load": median([s["load"] for s in got]),
                "load_touch": median([s["load_touch"] for s in got]),
                "rss_gb": median([s["rss_gb"] for s in got]),
                "process_s": median([s["process_s"] for s in got]),
                "best_load_touch": min(s["load_touch"] for s in got),
                "runs": len(got), "dtypes": got[0]["dtypes"],
                "samples": [{k: s[k] for k in ("load", "load_touch", "rss_gb", "process_s")} for s in got],
            }


def finish(results: dict, cat: dict, out: Path, shape: str = "sd15") -> None:
    ratios = compute_ratios(results, cat)
    from _common import WORK

    archive = WORK / f"{shape}.dduf"
    tiny = WORK / "tiny-sd.dduf"
    report = {"shape": shape, "archive_bytes": archive.stat().st_size if archive.exists() else None,
              "tiny_archive_bytes": tiny.stat().st_size if tiny.exists() else None,
              "cpus": os.cpu_count(), "results": results,
              "cat_archive_s": cat, "ratios": ratios, "targets": {k: list(v) for k, v in TARGETS.items()},
              "command": "python bench/bench_load.py" + ("" if shape == "sd15" else f" --shape {shape}"),
              "unix_time": time.time()}
    print_table(results, cat, ratios)
    out.parent.mkdir(parents=True, exist_ok=True)
    from provenance import write_result

    write_result(out, report)
    chart(results, cat, out.with_suffix(".png"), shape, report["archive_bytes"])
    print(f"wrote {out} and {out.with_suffix('.png')}")


def compute_ratios(results: dict, cat: dict) -> dict[str, float]:
    ratios = {}
    ours, folder = results.get("warm:dduf"), results.get("warm:folder")
    if ours and folder:
        ratios["warm load+touch vs folder"] = ours["load_touch"] / folder["load_touch"]
        ratios["warm load vs folder"] = ours["load"] / folder["load"]
        ratios["peak RSS vs folder"] = ours["rss_gb"] / folder["rss_gb"]
        # the fastest run of each: the one least disturbed by other work on a shared machine
        ratios["warm load+touch vs folder, best runs"] = ours["best_load_touch"] / folder["best_load_touch"]
    old = results.get("warm:old-hub")
    if ours and old:
        ratios["speed-up vs diffusers 0.35.2"] = old["load"] / ours["load"]
        ratios["speed-up vs diffusers 0.35.2 (load+touch)"] = old["load_touch"] / ours["load_touch"]
        ratios["peak RSS vs diffusers 0.35.2"] = ours["rss_gb"] / old["rss_gb"]
    fresh, fresh_folder = results.get("fresh:dduf"), results.get("fresh:folder")
    if fresh and fresh_folder:
        ratios["fresh-process first load vs folder"] = fresh["load"] / fresh_folder["load"]
        ratios["fresh-process first load vs folder, whole process"] = fresh["process_s"] / fresh_folder["process_s"]
    cold = results.get("cold:dduf")
    if cold and "cold" in cat:
        ratios["cold load+touch vs cat"] = cold["load_touch"] / cat["cold"]
        ratios["cold load+touch vs cat, best run vs median cat"] = cold["best_load_touch"] / cat["cold"]
        if results.get("cold:dduf-prefetch"):
            ratios["cold load+touch vs cat, read-ahead (prefetch=True)"] = (results["cold:dduf-prefetch"]["load_touch"]
                                                                            / cat["cold"])
        if results.get("cold:dduf-noprefetch"):
            ratios["cold load+touch vs cat, no prefetch"] = results["cold:dduf-noprefetch"]["load_touch"] / cat["cold"]
        if results.get("cold:folder"):
            ratios["cold load+touch vs folder"] = cold["load_touch"] / results["cold:folder"]["load_touch"]
    return ratios


def print_table(results: dict, cat: dict, ratios: dict) -> None:
    print("\n| cache | loader | load (s) | load+touch (s) | best load+touch (s) | peak RSS (GB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for key, r in results.items():
        cache, mode = key.split(":", 1)
        print(f"| {cache} | {LABELS.get(key, LABELS.get(mode, mode))} | {r['load']:.3f} | {r['load_touch']:.3f} | "
              f"{r['best_load_touch']:.3f} | {r['rss_gb']:.2f} |")
    for k, v in cat.items():
        print(f"| {k} | `cat archive > /dev/null` | | {v:.3f} | | |")
    print("\n| ratio | value | target |")
    print("| --- | --- | --- |")
    for name, value in ratios.items():
        op, goal = TARGETS.get(name, ("", None))
        met = "" if goal is None else (" met" if (value <= goal if op == "<=" else value >= goal) else " MISSED")
        print(f"| {name} | {value:.2f}x | {'' if goal is None else f'{op} {goal}x{met}'} |")


LABELS = {
    "fresh:dduf": "fresh process, imports + load_dduf (tiny-sd)",
    "fresh:folder": "fresh process, imports + diffusers folder (tiny-sd)",
    "dduf": "dduf_plus load_dduf (auto)",
    "dduf-noprefetch": "load_dduf, prefetch=False",
    "dduf-prefetch": "load_dduf, prefetch=True",
    "dduf-pread": "load_dduf, use_mmap=False",
    "folder": "diffusers 0.42 folder, dtype=float16",
    "old-hub": "diffusers 0.35.2 dduf_file= (hub archive)",
    "old-ours": "diffusers 0.35.2 dduf_file= (our archive)",
}


def chart(results: dict, cat: dict, path: Path, shape: str = "sd15", archive_bytes: int | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    keys = list(results)
    labels = [f"{k.split(':')[0]}: {LABELS.get(k, LABELS.get(k.split(':', 1)[1], k))}" for k in keys]
    fig, (ax_time, ax_rss) = plt.subplots(1, 2, figsize=(13, 0.5 * len(keys) + 2.5), sharey=True)
    y = range(len(keys))
    ax_time.barh([i + 0.2 for i in y], [results[k]["load"] for k in keys], height=0.4, label="load")
    ax_time.barh([i - 0.2 for i in y], [results[k]["load_touch"] for k in keys], height=0.4, label="load + touch")
    for name, value in cat.items():
        ax_time.axvline(value, linestyle="--", color="grey")
        ax_time.text(value, len(keys) - 0.4, f" cat {name}", color="grey", fontsize=8)
    ax_time.set_xscale("log")
    # plain-number ticks: matplotlib's default minor labels on a short log axis overlap each other
    ax_time.xaxis.set_major_locator(matplotlib.ticker.FixedLocator([0.1, 0.2, 0.5, 1, 2, 5, 10, 20]))
    ax_time.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_time.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_time.set_xlabel("seconds (log)")
    ax_time.set_yticks(list(y), labels, fontsize=8)
    ax_time.invert_yaxis()
    ax_time.legend(fontsize=8)
    ax_rss.barh(list(y), [results[k]["rss_gb"] for k in keys], height=0.5, color="tab:green")
    ax_rss.set_xlabel("peak RSS (GB)")
    size = f" ({archive_bytes / 1e9:.1f} GB)" if archive_bytes else ""
    fig.suptitle(f"Loading {SHAPE_TITLES.get(shape, shape)} fp16 pipeline{size}, medians; "
                 "fresh: a new process's first load of tiny-sd, imports included")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
