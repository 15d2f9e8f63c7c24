#!/usr/bin/env python
"""The exporter's case (issue 20): an fp16 diffusers pipeline **folder** loaded in its saved precision.

    python bench/bench_folder_load.py            # 3 runs per loader (~5 min on 2 busy cores)
    python bench/bench_folder_load.py --runs 5

On the SD-1.5-shaped fp16 folder (2.1 GB, bench/_common.py ``sd15_folder``), each in a fresh subprocess with
the libraries imported before the clock starts, the page cache warm, loaders interleaved run by run (a busy
machine moves every side alike):

- ``load_dduf(folder)`` (``torch_dtype="auto"``: each component in its saved dtype, weights viewing the files);
- diffusers ``DiffusionPipeline.from_pretrained(folder)``: its default, which upcasts to float32;
- diffusers ``from_pretrained(folder, dtype=torch.float16)``: the right dtype, given by hand.

Measured: load (until the pipeline exists), load+touch (then one byte of every 4 KiB page of every parameter
summed: every page read once, whatever the dtype)
and peak RSS (ru_maxrss). Medians; ratios against the diffusers anchors of the same run. Writes
bench/results/folder_load.json and prints the table docs/benchmarks.md quotes."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
MODES = ("dduf-auto", "diffusers-default", "diffusers-fp16")
LABELS = {"dduf-auto": 'load_dduf(folder) ("auto")', "diffusers-default": "diffusers from_pretrained(folder) (fp32 upcast)",
          "diffusers-fp16": "diffusers from_pretrained(folder, dtype=float16)"}


def child(mode: str, path: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import resource

    import diffusers
    import torch
    from diffusers import AutoencoderKL, DiffusionPipeline, StableDiffusionPipeline, UNet2DConditionModel  # noqa: F401
    from transformers import CLIPTextModel, CLIPTokenizer  # noqa: F401

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    torch.set_num_threads(os.cpu_count() or 1)
    sys.path.insert(0, str(ROOT))
    from dduf_plus import load_dduf

    loaders = {"dduf-auto": lambda: load_dduf(path),
               "diffusers-default": lambda: DiffusionPipeline.from_pretrained(path),
               "diffusers-fp16": lambda: DiffusionPipeline.from_pretrained(path, dtype=torch.float16)}
    started = time.perf_counter()
    pipe = loaders[mode]()
    loaded = time.perf_counter()
    total = 0
    # the touch sums on one thread: with two OpenMP threads, a busy neighbour on a core turns each small
    # reduction into a spin-wait (SD-1.5's UNet: 1 s instead of 0.07 s, for every loader alike)
    torch.set_num_threads(1)
    with torch.no_grad():  # one byte of every 4 KiB page of every parameter: each page read once, whatever the
        for component in pipe.components.values():  # dtype (a float sum of fp16 on CPU would cost more than the read)
            if isinstance(component, torch.nn.Module):
                for p in component.parameters():
                    total += int(p.detach().reshape(-1).view(torch.uint8)[::4096].sum())
    touched = time.perf_counter()
    dtypes = {n: str(c.dtype).removeprefix("torch.") for n, c in pipe.components.items()
              if isinstance(c, torch.nn.Module)}
    print("RESULT " + json.dumps({"load": loaded - started, "load_touch": touched - started,
                                  "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                                  "dtypes": dtypes}))


def measure(mode: str, folder: Path) -> dict:
    for p in sorted(folder.rglob("*.safetensors")):  # warm page cache: every loader reads from memory
        subprocess.run(["cat", str(p)], stdout=subprocess.DEVNULL, check=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--path", str(folder)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{mode} failed:\n{out.stderr[-3000:]}")


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child")
    parser.add_argument("--path")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.path)
        return
    from _common import RESULTS, sd15_folder, write_result

    folder = sd15_folder()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for i in range(args.runs):
        for mode in MODES:
            runs[mode].append(measure(mode, folder))
            print(f"run {i + 1}/{args.runs} {mode}: {runs[mode][-1]}", file=sys.stderr)
    results = {m: {k: median([r[k] for r in rs]) for k in ("load", "load_touch", "rss_gb")} | {"dtypes": rs[0]["dtypes"]}
               for m, rs in runs.items()}
    auto, default, fp16 = (results[m] for m in MODES)
    ratios = {"peak RSS auto / diffusers default": auto["rss_gb"] / default["rss_gb"],
              "peak RSS auto / diffusers fp16": auto["rss_gb"] / fp16["rss_gb"],
              "load+touch auto / diffusers default": auto["load_touch"] / default["load_touch"],
              "load+touch auto / diffusers fp16": auto["load_touch"] / fp16["load_touch"]}
    size = sum(p.stat().st_size for p in folder.rglob("*.safetensors"))
    record = {"runs": args.runs, "folder_bytes": size, "results": results, "ratios": ratios, "raw": runs,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, shared with other jobs",
              "date": time.strftime("%Y-%m-%d")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(RESULTS / "folder_load.json", record)
    print(f"SD-1.5-shaped fp16 folder, {size / 1e9:.2f} GB of weights; medians of {args.runs}, warm page cache\n")
    print("| loader | dtypes (unet / text_encoder / vae) | load | load+touch | peak RSS |")
    print("| --- | --- | --- | --- | --- |")
    for mode in MODES:
        r = results[mode]
        d = r["dtypes"]
        print(f"| {LABELS[mode]} | {d.get('unet')} / {d.get('text_encoder')} / {d.get('vae')} | {r['load']:.2f} s "
              f"| {r['load_touch']:.2f} s | {r['rss_gb']:.2f} GB |")
    print()
    for name, value in ratios.items():
        print(f"- {name}: {value:.2f}x")


if __name__ == "__main__":
    main()
