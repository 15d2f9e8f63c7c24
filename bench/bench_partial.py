"""Partial models on the SD-1.5-shaped fp16 pipeline: storage saved by packing a fine-tune against its
base, and load time of the partial archive (references in a fake Hugging Face cache) vs the complete one.

    python bench/bench_partial.py [--repeat 5]

The "fine-tune" is the base with every unet weight's lowest mantissa bit flipped at random (a new file,
valid fp16 values); every other file is a hard link to the base's. The base is put into a fake HF cache
(bench/_work/partial/hf-cache, blobs hard-linked) as ``bench/sd15-base``; the fine-tune is packed with
``--base bench/sd15-base`` offline, then completed. Loads run in fresh subprocesses, imports done before
the clock starts, alternating partial/complete; medians are reported. The first partial load on a machine
hashes the referenced files once (reported separately); later loads find them in the verified-hash memory.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, ROOT, WORK, median, sd15_folder, write_result  # noqa: E402

sys.path.insert(0, str(ROOT))

OUT = WORK / "partial"
REPO = "bench/sd15-base"
LOAD_SCRIPT = r"""
import json, os, sys, time
import torch, diffusers, transformers
from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel  # noqa
from transformers import CLIPTextModel, CLIPTokenizer  # noqa
from dduf_plus.loading.pipeline import load_dduf
import dduf_plus.refs.resolve  # noqa: imported like the loader's own modules, before the clock
t = time.perf_counter()
pipe = load_dduf(sys.argv[1], torch_dtype="auto")
load = time.perf_counter() - t
t = time.perf_counter()
total = 0.0
torch.set_num_threads(1)  # the touch sums on one thread (a busy neighbour makes OpenMP reductions spin-wait)
for name in ("unet", "vae", "text_encoder"):
    for p in getattr(pipe, name).parameters():  # one element of every 4 KiB page: every page is faulted in
        flat = p.detach().reshape(-1)
        total += float(flat[:: max(1, 4096 // flat.element_size())].float().sum())
touch = time.perf_counter() - t
# what resolving + verifying the references costs inside that load (warm verified-hash memory)
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.refs.resolve import locate_component
with DDUFArchive(sys.argv[1]) as archive:
    refs = archive.references
t = time.perf_counter()
for name, ref in refs.items():
    locate_component(name, ref)
resolve = time.perf_counter() - t
print(json.dumps({"load_s": load, "touch_s": touch, "resolve_s": resolve}))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(OUT / "hf-cache"), DDUF_PLUS_CACHE=str(OUT / "dduf-cache"),
               HF_HUB_DISABLE_PROGRESS_BARS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def make_finetune(base: Path, out: Path) -> Path:
    """Hard links of the base's files, except a rewritten unet (lowest mantissa bit flipped at random)."""
    import numpy as np

    if (out / ".complete").exists():
        return out
    if out.exists():
        shutil.rmtree(out)
    unet_weights = base / "unet" / "diffusion_pytorch_model.safetensors"
    for src in sorted(base.rglob("*")):
        if src.is_dir() or src.name == ".complete":
            continue
        dst = out / src.relative_to(base)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src == unet_weights:
            continue
        os.link(src, dst)
    rng = np.random.default_rng(1)
    with open(unet_weights, "rb") as f, open(out / "unet" / unet_weights.name, "wb") as g:
        head = f.read(8)
        n = int.from_bytes(head, "little")
        g.write(head + f.read(n))  # the same header: same tensors, same offsets
        while block := f.read(64 << 20):
            data = np.frombuffer(block, dtype=np.uint16)
            g.write((data ^ rng.integers(0, 2, data.shape, dtype=np.uint16)).tobytes())
    (out / ".complete").touch()
    return out


def load_once(archive: Path, env: dict[str, str]) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(archive)], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"load of {archive} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    env = _env()
    os.environ.update({k: env[k] for k in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "DDUF_PLUS_CACHE")})

    from dduf_plus.format.pack import pack_folder
    from dduf_plus.packing.complete import complete_archive
    from dduf_plus.packing.partial import pack_partial
    from dduf_plus.refs.cache import add_to_hf_cache

    base = sd15_folder()
    OUT.mkdir(parents=True, exist_ok=True)
    finetune = make_finetune(base, OUT / "sd15-ft")
    for stale in ("hf-cache", "dduf-cache"):
        shutil.rmtree(OUT / stale, ignore_errors=True)
    files = {p.relative_to(base).as_posix(): p for p in sorted(base.rglob("*")) if p.is_file() and p.name != ".complete"}
    add_to_hf_cache(base, REPO, cache_dir=OUT / "hf-cache", files=files, link="hardlink")

    partial, full, direct = OUT / "ft.partial.dduf", OUT / "ft.complete.dduf", OUT / "ft.direct.dduf"
    t = time.perf_counter()
    pack_partial(finetune, partial, base=REPO, quiet=True)
    pack_s = time.perf_counter() - t
    t = time.perf_counter()
    complete_archive(partial, full, quiet=True)
    complete_s = time.perf_counter() - t
    pack_folder(finetune, direct, quiet=True)
    identical = filecmp.cmp(full, direct, shallow=False)
    direct.unlink()

    from dduf_plus.format.archive import DDUFArchive

    with DDUFArchive(partial) as archive:
        referenced = sorted(archive.references)
    partial_bytes, full_bytes = partial.stat().st_size, full.stat().st_size

    # first partial load on this machine: the referenced files are hashed once
    os.sync()  # let the writes of the packs settle before timing loads
    shutil.rmtree(OUT / "dduf-cache", ignore_errors=True)
    load_once(full, env)  # warm the page cache
    first = load_once(partial, env)
    load_once(full, env)
    runs: dict[str, list[dict[str, float]]] = {"partial": [], "complete": []}
    for _ in range(args.repeat):
        runs["partial"].append(load_once(partial, env))
        runs["complete"].append(load_once(full, env))

    def med(kind: str, key: str) -> float:
        return median([r[key] for r in runs[kind]])

    result = {
        "pipeline": "SD-1.5-shaped, fp16, random weights; fine-tune = unet rewritten",
        "referenced": referenced,
        "partial_bytes": partial_bytes,
        "complete_bytes": full_bytes,
        "saved_bytes": full_bytes - partial_bytes,
        "saved_pct": 100.0 * (full_bytes - partial_bytes) / full_bytes,
        "pack_partial_s": pack_s,
        "complete_s": complete_s,
        "complete_equals_direct_pack": identical,
        "first_partial_load_s": first["load_s"],
        "load_s": {"partial": med("partial", "load_s"), "complete": med("complete", "load_s")},
        "touch_s": {"partial": med("partial", "touch_s"), "complete": med("complete", "touch_s")},
        "resolve_s": med("partial", "resolve_s"),
        "load_ratio": med("partial", "load_s") / med("complete", "load_s"),
        "load_touch_ratio": (med("partial", "load_s") + med("partial", "touch_s"))
        / (med("complete", "load_s") + med("complete", "touch_s")),
        "runs": runs,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(RESULTS / "partial.json", result)

    gb = 1e9
    print("| SD-1.5-shaped fine-tune (fp16) | partial (--base) | complete |\n| --- | --- | --- |")
    print(f"| archive size | {partial_bytes / gb:.3f} GB | {full_bytes / gb:.3f} GB |")
    print(f"| storage saved | {(full_bytes - partial_bytes) / gb:.3f} GB ({result['saved_pct']:.1f}%) | |")
    print(f"| load, median of {args.repeat} (refs in HF cache, verified) | {result['load_s']['partial']:.3f} s | "
          f"{result['load_s']['complete']:.3f} s |")
    print(f"| touch (one read per 4 KiB page of every parameter) | {result['touch_s']['partial']:.3f} s | {result['touch_s']['complete']:.3f} s |")
    print(f"| load ratio partial / complete | {result['load_ratio']:.2f}x (load+touch "
          f"{result['load_touch_ratio']:.2f}x) | 1.00x |")
    print(f"| resolving + verifying the {len(referenced)} references (warm, part of the load) | "
          f"{1000 * result['resolve_s']:.1f} ms | |")
    print(f"| first partial load (hashes {', '.join(referenced)} once) | {first['load_s']:.3f} s | |")
    print(f"| pack --base / complete | {pack_s:.2f} s | {complete_s:.2f} s (byte-identical to a direct pack: "
          f"{identical}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
