#!/usr/bin/env python
"""GPU load benchmark: SD-1.5-shaped fp16 pipeline (2.1 GB) from a .dduf archive to CUDA, against
diffusers' own folder load to the same device. One short, self-contained, fail-soft script.

    python bench/gpu_load.py                      # needs torch with CUDA; < 5 min on one H200
    python bench/gpu_load.py --work /tmp/w --runs 3
    python bench/gpu_load.py --cpu-smoke          # whole flow on the tiny fixture, device cpu (seconds)
    python bench/gpu_load.py --dry-run            # print the plan, touch nothing

Measures (medians of ``--runs``, imports and CUDA initialisation done before the clock, page cache
warm, ``torch.cuda.synchronize()`` before every clock read):

* per component: ``materialize(archive.tensors(c), device)`` in the saved dtype, and converting to
  float32 on the device; diffusers/transformers ``Model.from_pretrained(folder, subfolder=c,
  dtype=float16, device_map=device)``; seconds and GB/s (GB of the component as stored).
* whole pipeline: ``load_dduf(archive, torch_dtype="auto", device=device)`` (with the time of each
  component's ``materialize`` inside it), ``DiffusionPipeline.from_pretrained(folder,
  dtype=float16).to(device)`` and ``DiffusionPipeline.from_pretrained(folder, dtype=float16,
  device_map=device)``.
* equality: a few tensors of each component, archive-on-device vs the folder's safetensors file, and
  load_dduf's pipeline vs diffusers' (state dicts and one text-encoder forward).

Prints a markdown table; writes JSON to ``--json``, else ``$OUT/gpu_load.json`` when ``$OUT`` is set,
else ``bench/results/gpu_load.json``. Every step is guarded: a failure is printed, recorded under
"failures" and the run goes on. Exit status 1 when any step failed."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_FIXTURE = ROOT / "fixtures" / "pipelines" / "tiny-sd"


class Bench:
    """Runs guarded steps, keeps results and failures, and watches the time budget."""

    def __init__(self, budget_s: float):
        self.started = time.perf_counter()
        self.budget_s = budget_s
        self.failures: list[dict[str, str]] = []
        self.log: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def say(self, message: str) -> None:
        line = f"[{self.elapsed():6.1f}s] {message}"
        self.log.append(line)
        print(line, flush=True)

    def step(self, name: str, fn: Callable[[], Any], default: Any = None) -> Any:
        if self.over_budget():
            self.failures.append({"step": name, "error": f"skipped: over the {self.budget_s:.0f} s budget"})
            self.say(f"SKIP {name}: over budget")
            return default
        try:
            return fn()
        except Exception as e:  # fail soft: record, tell, go on
            tail = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:])
            self.failures.append({"step": name, "error": f"{type(e).__name__}: {e}", "traceback": tail})
            self.say(f"FAIL {name}: {type(e).__name__}: {e}")
            return default


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="load a .dduf to CUDA vs diffusers' folder load (GB/s per component)")
    p.add_argument("--work", type=Path, default=Path(os.environ.get("DDUF_BENCH_WORK", ROOT / "bench" / "_work")),
                   help="where the SD-1.5-shaped folder and archive are built or reused (default bench/_work)")
    p.add_argument("--runs", type=int, default=3, help="runs per measurement; medians are reported")
    p.add_argument("--json", type=Path, default=None, help="result file (default $OUT/gpu_load.json or "
                                                           "bench/results/gpu_load.json)")
    p.add_argument("--device", default=None, help="torch device (default cuda; cpu with --cpu-smoke)")
    p.add_argument("--cpu-smoke", action="store_true", help="run the whole flow on the tiny fixture on cpu")
    p.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    p.add_argument("--budget-s", type=float, default=270.0, help="skip remaining steps after this many seconds")
    p.add_argument("--chunk-mib", type=int, default=None, help="materialize chunk size (default: its own)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    args.device = args.device or ("cpu" if args.cpu_smoke else "cuda")
    if args.json is None:
        out = os.environ.get("OUT")
        args.json = Path(out) / "gpu_load.json" if out else ROOT / "bench" / "results" / "gpu_load.json"
    return args


# --- inputs ------------------------------------------------------------------------------------------
def sd15_folder(work: Path) -> Path:
    folder = work / "sd15"
    if not (folder / ".complete").exists():  # same convention as bench/_common.py: reused when complete
        sys.path.insert(0, str(ROOT / "fixtures"))
        from make_fixtures import build_sd15_shaped

        build_sd15_shaped(folder)
        (folder / ".complete").touch()
    return folder


def pack(folder: Path, archive: Path) -> Path:
    from dduf_plus.format.pack import pack_folder

    if not archive.exists():  # reused when present (bench/_common.py packs the same file)
        pack_folder(folder, archive, quiet=True)
    return archive


def warm_page_cache(paths: list[Path]) -> int:
    total = 0
    for path in paths:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for f in files:
            with open(f, "rb") as fh:
                while chunk := fh.read(64 << 20):
                    total += len(chunk)
    return total


# --- timing helpers ----------------------------------------------------------------------------------
def make_sync(device: str) -> Callable[[], None]:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None


# --- measurements ------------------------------------------------------------------------------------
def weight_components(archive_path: Path) -> dict[str, dict[str, Any]]:
    from dduf_plus.format.archive import DDUFArchive

    out = {}
    with DDUFArchive(archive_path) as archive:
        for name, comp in archive.components.items():
            files = archive.weight_files(name) if comp.library else []
            if files:
                infos = archive.tensor_infos(name)
                out[name] = {"library": comp.library, "class": comp.class_name, "files": files,
                             "bytes": sum(info.nbytes for _, info in infos.values()), "tensors": sorted(infos)}
    return out


def time_materialize(archive_path: Path, comps: dict, device: str, sync, convert_to: str | None,
                     chunk: int | None) -> dict[str, float]:
    import torch

    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.loading.transfer import materialize

    target = getattr(torch, convert_to) if convert_to else None
    kwargs = {"chunk_bytes": chunk} if chunk else {}
    times = {}
    with DDUFArchive(archive_path) as archive:
        for name in comps:
            tensors = archive.tensors(name)
            sync()
            t0 = time.perf_counter()
            out = materialize(tensors, device=torch.device(device), dtype_for=lambda n, t: target, **kwargs)
            sync()
            times[name] = time.perf_counter() - t0
            del out
            free_memory(device)
    return times


def time_load_dduf(archive_path: Path, comps: dict, device: str, sync) -> tuple[float, dict[str, float], Any]:
    """load_dduf total, and the time of each component's materialize() inside it."""
    import dduf_plus.loading.transfer as transfer
    from dduf_plus import load_dduf

    by_names = {frozenset(c["tensors"]): name for name, c in comps.items()}
    inner: dict[str, float] = {}
    original = transfer.materialize

    def timed_materialize(tensors, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = original(tensors, **kwargs)
        sync()
        inner[by_names.get(frozenset(tensors), f"?{len(inner)}")] = time.perf_counter() - t0
        return out

    transfer.materialize = timed_materialize
    try:
        sync()
        t0 = time.perf_counter()
        pipe = load_dduf(archive_path, torch_dtype="auto", device=device)
        sync()
        total = time.perf_counter() - t0
    finally:
        transfer.materialize = original
    return total, inner, pipe


def time_diffusers_pipeline(folder: Path, device: str, sync, mode: str) -> tuple[float, Any]:
    import torch
    from diffusers import DiffusionPipeline

    sync()
    t0 = time.perf_counter()
    if mode == "to":
        pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float16).to(device)
    else:
        pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float16, device_map=device)
    sync()
    return time.perf_counter() - t0, pipe


def time_diffusers_component(folder: Path, name: str, comp: dict, device: str, sync) -> float:
    import importlib

    import torch

    cls = getattr(importlib.import_module(comp["library"]), comp["class"])
    sync()
    t0 = time.perf_counter()
    model = cls.from_pretrained(folder, subfolder=name, dtype=torch.float16, device_map=device)
    sync()
    seconds = time.perf_counter() - t0
    del model
    return seconds


def check_tensors(archive_path: Path, folder: Path, comps: dict, device: str) -> dict[str, Any]:
    """A few tensors per component: materialized from the archive vs the folder's own file."""
    import torch
    from safetensors import safe_open

    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.loading.transfer import materialize

    report: dict[str, Any] = {}
    with DDUFArchive(archive_path) as archive:
        for name in comps:
            infos = archive.tensor_infos(name)
            picks = sorted(infos)
            picks = sorted({picks[0], picks[len(picks) // 2], picks[-1]})
            same = materialize({k: archive.tensors(name)[k] for k in picks}, device=torch.device(device))
            as_fp32 = materialize({k: archive.tensors(name)[k] for k in picks}, device=torch.device(device),
                                  dtype_for=lambda n, t: torch.float32)
            results = {}
            for key in picks:
                entry = infos[key][0]
                with safe_open(str(folder / entry), framework="pt", device="cpu") as f:
                    ref = f.get_tensor(key).to(device)
                results[key] = bool(torch.equal(same[key], ref) and torch.equal(as_fp32[key], ref.float()))
            report[name] = results
    return report


def check_pipelines(ours: Any, theirs: Any, comps: dict, device: str) -> dict[str, Any]:
    import torch

    report: dict[str, Any] = {}
    for name in comps:
        a, b = getattr(ours, name, None), getattr(theirs, name, None)
        if a is None or b is None:
            continue
        sa, sb = a.state_dict(), b.state_dict()
        common = sorted(set(sa) & set(sb))
        picks = sorted({common[0], common[len(common) // 2], common[-1]}) if common else []
        report[name] = {
            "common_keys": len(common), "keys_a": len(sa), "keys_b": len(sb),
            "equal": {k: bool(torch.equal(sa[k].to(sb[k].device, sb[k].dtype), sb[k])) for k in picks},
            "device": str(next(iter(sa.values())).device) if sa else None,
        }
    if getattr(ours, "text_encoder", None) is not None and getattr(ours, "tokenizer", None) is not None:
        ids = ours.tokenizer(["a photo of a cat"], padding="max_length", truncation=True,
                             max_length=ours.tokenizer.model_max_length, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            ea = ours.text_encoder(ids)[0].float()
            eb = theirs.text_encoder(ids)[0].float()
        report["text_encoder_forward_max_abs_diff"] = float((ea - eb).abs().max())
    return report


# --- report ------------------------------------------------------------------------------------------
def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    comps = result["components"]
    lines = [
        f"GPU load, {result['pipeline']} on {result['device_name']} ({result['runs']} runs, medians, warm cache)",
        "",
        "| component | GB | materialize s | GB/s | materialize→fp32 s | GB/s | in load_dduf s | GB/s "
        "| diffusers from_pretrained s | GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, c in comps.items():
        gb = c["bytes"] / 1e9
        row = [name, f"{gb:.3f}"]
        for key in ("materialize_s", "materialize_fp32_s", "load_dduf_materialize_s", "diffusers_component_s"):
            row += [fmt(c.get(key)), fmt(gbps(c["bytes"], c.get(key)), 1)]
        lines.append("| " + " | ".join(row) + " |")
    total = sum(c["bytes"] for c in comps.values())
    lines += ["", "| pipeline load | s | GB/s |", "| --- | --- | --- |"]
    for label, key in (("load_dduf(archive, torch_dtype='auto', device)", "load_dduf_s"),
                       ("DiffusionPipeline.from_pretrained(folder, dtype=fp16).to(device)", "diffusers_to_s"),
                       ("DiffusionPipeline.from_pretrained(folder, dtype=fp16, device_map=device)",
                        "diffusers_device_map_s")):
        seconds = result["pipeline_loads"].get(key)
        lines.append(f"| {label} | {fmt(seconds)} | {fmt(gbps(total, seconds), 1)} |")
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args.budget_s)
    result: dict[str, Any] = {}
    try:
        return run(args, bench, result)
    except Exception as e:  # a bug in this script: still report what was measured
        bench.failures.append({"step": "script", "error": f"{type(e).__name__}: {e}",
                               "traceback": traceback.format_exc()[-2000:]})
        return finish(args, bench, result)


def run(args: argparse.Namespace, bench: Bench, result: dict[str, Any]) -> int:
    plan = {
        "pipeline": "tiny-sd fixture" if args.cpu_smoke else "SD-1.5-shaped fp16 (bench/_work/sd15, ~2.1 GB)",
        "device": args.device, "runs": args.runs, "work": str(args.work), "json": str(args.json),
    }
    if args.dry_run:
        print(json.dumps({"dry_run": True, **plan}, indent=2))
        return 0
    result.update(plan, components={}, pipeline_loads={}, checks={})

    def imports() -> Any:
        import diffusers
        import torch
        import transformers  # noqa: F401
        from diffusers import AutoencoderKL, DiffusionPipeline, UNet2DConditionModel  # noqa: F401
        from transformers import CLIPTextModel, CLIPTokenizer  # noqa: F401

        import dduf_plus.loading.transfer  # noqa: F401

        diffusers.utils.logging.disable_progress_bar()
        diffusers.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
        return torch

    torch = bench.step("imports", imports)
    if torch is None:
        return finish(args, bench, result)
    result.update(torch=torch.__version__, python=platform.python_version(),
                  cuda=getattr(torch.version, "cuda", None), cuda_available=torch.cuda.is_available())
    device = args.device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            bench.failures.append({"step": "device", "error": "CUDA is not available in this torch"})
            bench.say("FAIL device: CUDA is not available (use --cpu-smoke on a CPU machine)")
            return finish(args, bench, result)
        torch.cuda.init()
        torch.zeros(1, device=device)  # context creation outside every clock
        result["device_name"] = torch.cuda.get_device_name(torch.device(device))
    else:
        result["device_name"] = platform.processor() or "cpu"
    sync = make_sync(device)

    args.work.mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        folder = TINY_FIXTURE
        archive = bench.step("pack", lambda: pack(folder, args.work / "tiny-sd.dduf"))
    else:
        bench.say("building (or reusing) the SD-1.5-shaped folder")
        folder = bench.step("build sd15", lambda: sd15_folder(args.work))
        archive = bench.step("pack", lambda: pack(folder, args.work / "sd15.dduf")) if folder else None
    if folder is None or archive is None:
        return finish(args, bench, result)
    comps = bench.step("read archive", lambda: weight_components(archive), default={})
    for name, c in comps.items():
        result["components"][name] = {"class": c["class"], "bytes": c["bytes"]}
    bench.step("warm page cache", lambda: warm_page_cache([archive, folder]))
    chunk = args.chunk_mib << 20 if args.chunk_mib else None
    # warm-up (pinned allocator, kernels, lazy imports) outside the medians
    bench.step("warm-up", lambda: time_materialize(archive, comps, device, sync, "float32", chunk))

    samples: dict[str, list[float]] = {}

    def add(key: str, value: float | None) -> None:
        if value is not None:
            samples.setdefault(key, []).append(value)

    for run in range(args.runs):
        bench.say(f"run {run + 1}/{args.runs}")
        for key, convert in (("materialize_s", None), ("materialize_fp32_s", "float32")):
            times = bench.step(f"materialize {convert or 'as saved'}",
                               lambda convert=convert: time_materialize(archive, comps, device, sync, convert, chunk),
                               default={})
            for name, seconds in times.items():
                add(f"{name}:{key}", seconds)
        loaded = bench.step("load_dduf", lambda: time_load_dduf(archive, comps, device, sync))
        compared = False
        if loaded is not None:
            total, inner, pipe = loaded
            add("load_dduf_s", total)
            for name, seconds in inner.items():
                add(f"{name}:load_dduf_materialize_s", seconds)
            if run == 0:  # the first diffusers .to() load doubles as the reference for the equality check
                theirs = bench.step("diffusers .to", lambda: time_diffusers_pipeline(folder, device, sync, "to"))
                if theirs is not None:
                    add("diffusers_to_s", theirs[0])
                    result["checks"]["pipelines"] = bench.step(
                        "check pipelines", lambda ours=pipe, ref=theirs[1]: check_pipelines(ours, ref, comps, device))
                    compared = True
                del theirs
            del pipe, loaded
            free_memory(device)
        if not compared:
            timed = bench.step("diffusers .to", lambda: time_diffusers_pipeline(folder, device, sync, "to"))
            if timed is not None:
                add("diffusers_to_s", timed[0])
                del timed
                free_memory(device)
        timed = bench.step("diffusers device_map", lambda: time_diffusers_pipeline(folder, device, sync, "map"))
        if timed is not None:
            add("diffusers_device_map_s", timed[0])
            del timed
            free_memory(device)
        for name, c in comps.items():
            seconds = bench.step(f"diffusers {name}",
                                 lambda name=name, c=c: time_diffusers_component(folder, name, c, device, sync))
            add(f"{name}:diffusers_component_s", seconds)
            free_memory(device)
    result["checks"]["tensors"] = bench.step("check tensors", lambda: check_tensors(archive, folder, comps, device))

    for key, values in samples.items():
        if ":" in key:
            name, metric = key.split(":", 1)
            result["components"].setdefault(name, {})[metric] = med(values)
            result["components"][name][metric + "_all"] = values
        else:
            result["pipeline_loads"][key] = med(values)
            result["pipeline_loads"][key + "_all"] = values
    if device.startswith("cuda"):
        result["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(torch.device(device)) / 1e9
    return finish(args, bench, result)


def finish(args: argparse.Namespace, bench: Bench, result: dict[str, Any]) -> int:
    result["failures"] = bench.failures
    result["seconds"] = bench.elapsed()
    result.setdefault("device_name", args.device)
    checks = result.get("checks", {})
    bad = [f"{c}:{k}" for c, r in (checks.get("tensors") or {}).items() for k, ok in r.items() if not ok]
    bad += [f"{c}:{k}" for c, r in (checks.get("pipelines") or {}).items() if isinstance(r, dict)
            for k, ok in r.get("equal", {}).items() if not ok]
    if bad:
        bench.failures.append({"step": "equality", "error": f"tensors differ: {', '.join(bad)}"})
    if result.get("components"):
        print()
        print(markdown(result))
    print(f"\nchecks: {json.dumps(checks, default=str)[:2000]}")
    for f in bench.failures:
        print(f"FAILED {f['step']}: {f['error']}")
    try:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        if str(ROOT / "bench") not in sys.path:  # loaded by path (tests, a device machine): its sibling module
            sys.path.insert(0, str(ROOT / "bench"))
        from provenance import write_result

        write_result(args.json, result, default=str)
        print(f"wrote {args.json}")
    except OSError as e:
        print(f"could not write {args.json}: {e}")
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
