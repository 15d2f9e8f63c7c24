#!/usr/bin/env python
"""What a user feels: load the pipeline and run its first denoising step, ``load_dduf(archive)`` against
diffusers' ``DiffusionPipeline.from_pretrained(folder, dtype=float16)``, warm and cold, on the SD-1.5-shaped fp16
pipeline (bench/_common.py).

    python bench/bench_first_step.py [--runs 3] [--cold-runs 2]     # writes bench/results/first_step.json

The step is one UNet call through the pipeline (``num_inference_steps=1``, 64x64 pixels: 8x8 latents,
``output_type="latent"``, so the VAE decoder is not run): the compute is small, and what it costs beyond the load is
the first touch of every UNet and text-encoder weight, which a load that maps the file defers to here. Each run is a
fresh process with the libraries and classes imported before the clock; torch on one thread (on this shared
2-core VM, two OpenMP threads make every kernel spin-wait on a busy neighbour, whichever loader runs; see
docs/loading.md). Medians; the ratio is against diffusers' figure measured in the same run."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

MODES = ("dduf", "folder")


def child(mode: str, path: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gc

    import diffusers
    import torch
    from diffusers import DiffusionPipeline, StableDiffusionPipeline, UNet2DConditionModel  # noqa: F401
    from transformers import CLIPTextModel, CLIPTokenizer  # noqa: F401

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    from dduf_plus import load_dduf

    gc.collect()
    started = time.perf_counter()
    if mode == "dduf":
        pipe = load_dduf(path)
    else:
        pipe = DiffusionPipeline.from_pretrained(path, dtype=torch.float16)
    pipe.set_progress_bar_config(disable=True)
    loaded = time.perf_counter()
    with torch.no_grad():
        pipe("a photo", num_inference_steps=1, height=64, width=64, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    stepped = time.perf_counter()
    print("RESULT " + json.dumps({"load": loaded - started, "load_first_step": stepped - started}))


def run(mode: str, path: Path, files: list[Path], cold: bool) -> dict | None:
    import bench_load

    if cold:
        if not bench_load.evict(files):
            return None
    else:
        bench_load.warm(files)
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--path", str(path)], capture_output=True,
                         text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{mode} failed:\n{out.stderr[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cold-runs", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.path)
        return 0
    from _common import RESULTS, median, sd15_archive, sd15_folder, write_result

    folder, archive = sd15_folder(), sd15_archive()
    files = {"dduf": [archive], "folder": [p for p in folder.rglob("*") if p.is_file()]}
    paths = {"dduf": archive, "folder": folder}
    samples: dict[str, list[dict]] = {}
    for phase, runs in (("warm", args.runs), ("cold", args.cold_runs)):
        for i in range(runs):
            for mode in MODES:  # interleaved: both loaders see the same moments of the machine's load
                got = run(mode, paths[mode], files[mode], cold=phase == "cold")
                if got is None:
                    print(f"{phase}: files cannot be evicted here; no cold rows")
                    break
                samples.setdefault(f"{phase}:{mode}", []).append(got)
                print(f"{phase} {mode:6s} run {i + 1}: load {got['load']:.2f} s, "
                      f"load + first step {got['load_first_step']:.2f} s", flush=True)
    results = {key: {"load": median([s["load"] for s in got]),
                     "load_first_step": median([s["load_first_step"] for s in got]), "samples": got}
               for key, got in samples.items()}
    ratios = {f"{phase} load + first step vs folder": results[f"{phase}:dduf"]["load_first_step"]
              / results[f"{phase}:folder"]["load_first_step"]
              for phase in ("warm", "cold") if f"{phase}:dduf" in results and f"{phase}:folder" in results}
    out = write_result(args.out or RESULTS / "first_step.json",
                       {"shape": "sd15", "archive_bytes": archive.stat().st_size, "runs": args.runs,
                        "cold_runs": args.cold_runs, "threads": 1, "results": results, "ratios": ratios})
    print(json.dumps({k: v for k, v in out.items() if k != "provenance"}["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
