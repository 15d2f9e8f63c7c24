"""Peak memory of loading the SD-1.5-shaped UNet (859.5M parameters): qint8 (optimum-quanto) vs its fp16
and fp32 forms, and quanto's own ``requantize`` as the anchor.

What is measured, per case, in a fresh process:

- baseline: RSS after importing torch, diffusers, optimum-quanto and dduf_plus' loader and resolving the
  class (imports are not the loader's cost);
- the kernel's peak-RSS counter (VmHWM) is then reset (``/proc/self/clear_refs`` = 5) and the UNet is
  loaded from its archive, then every parameter and buffer is read once (``sum()``), which faults every
  weight page in: the result is what it takes to *hold* the model, not just to build lazy views;
- reported: ``peak delta`` = VmHWM - baseline (bytes), and its ratio to the UNet's stored size in the
  archive (for qint8: int8 values + fp16 scales, biases, norms). RSS counts the archive's file-backed
  pages that the process touched; those are shared with the page cache, which is the point of mmap.

Cases: ``qint8 dduf_plus`` (load_quanto_component: meta skeleton + stored views), ``fp16 dduf_plus``
(load_dduf, saved precision: zero copy), ``fp32 dduf_plus`` (load_dduf(torch_dtype=float32) of the fp16
archive: every weight converted, as diffusers' default upcast does), ``qint8 quanto requantize`` (quanto's
documented reload from the folder: ``requantize(meta model, safetensors.load_file(...), qmap)``).
``address space reserved`` is the growth of VmPeak during the load: requantize's ``empty_like`` of every
meta weight in full precision shows there (on CPU Linux leaves untouched pages unbacked, so it costs no
RSS; on a CUDA device the same call is real device memory).
Target (issue 6): qint8 peak delta within 1.15x of its quantized size.

Random weights; timings are noisy on a shared 2-core box; medians of --repeat runs.

    python bench/bench_quant_rss.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, WORK, median, sd15_archive, sd15_folder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
case, archive_path = sys.argv[1], sys.argv[2]
import torch, diffusers
from diffusers import UNet2DConditionModel
import optimum.quanto
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.loading.files import ArchiveComponentFiles
from dduf_plus.loading.pipeline import load_dduf
from dduf_plus.loading import quant

def rss(field="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)

import gc; gc.collect()
baseline = rss()
virtual_before = rss("VmPeak")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM: the peak from here on is the load's
t = time.perf_counter()
if case == "qint8 dduf_plus":
    archive = DDUFArchive(archive_path)
    files = ArchiveComponentFiles(archive, "unet")
    unet = quant.load_quanto_component(UNet2DConditionModel, files.read_json("config.json"), files)
elif case == "qint8 quanto requantize":
    # quanto's documented reload (QuantizedDiffusersModel.from_pretrained does the same) from the folder
    from accelerate import init_empty_weights
    from optimum.quanto import requantize
    from safetensors.torch import load_file
    folder = archive_path
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(json.load(open(os.path.join(folder, "config.json"))))
    state = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    requantize(unet, state, json.load(open(os.path.join(folder, "quanto_qmap.json"))), device=torch.device("cpu"))
    del state
else:
    dtype = torch.float16 if case.startswith("fp16") else torch.float32
    none = {k: None for k in ("text_encoder", "tokenizer", "vae", "safety_checker", "feature_extractor",
                               "image_encoder")}
    unet = load_dduf(archive_path, torch_dtype=dtype, prefetch=False, **none).unet
load_s = time.perf_counter() - t
after_load = rss()
virtual_growth = rss("VmPeak") - virtual_before  # address space the load reserved beyond any earlier peak
def touch(t):
    # A same-dtype reduction reads every byte without a converted copy (sum() of int8 would make an
    # int64 copy: 8x the tensor). Floating types: sum(); others: max() of the bytes.
    if t.numel() == 0:
        return 0.0
    if t.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return float(t.sum())
    return float(t.reshape(-1).view(torch.uint8).max())

total = 0.0
with torch.no_grad():
    for p in list(unet.parameters()) + list(unet.buffers()):
        data = getattr(p, "_data", p)
        total += touch(getattr(data, "_data", data))  # qint4's PackedTensor holds a second level
        for attr in ("_scale", "_shift"):
            if hasattr(p, attr):
                total += touch(getattr(p, attr))
touch_s = time.perf_counter() - t - load_s
print(json.dumps({"baseline": baseline, "peak": rss("VmHWM"), "after_load": after_load, "after_touch": rss(),
                  "load_s": load_s, "touch_s": touch_s, "virtual_growth": virtual_growth}))
"""


def quantized_archive() -> Path:
    """The SD-shaped pipeline with its UNet quantized to qint8 (built once, reused)."""
    archive = WORK / "sd15-qint8.dduf"
    if archive.exists():
        return archive
    import torch
    from diffusers import UNet2DConditionModel
    from optimum.quanto import freeze, qint8, quantize

    from dduf_plus.format.pack import pack_folder
    from dduf_plus.loading.quant import save_quanto_component

    src = sd15_folder()
    folder = WORK / "sd15-qint8"
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for item in src.iterdir():
        if item.name not in ("unet", ".complete"):
            (folder / item.name).symlink_to(item.resolve())  # plan_folder follows links: nothing copied
    unet = UNet2DConditionModel.from_pretrained(src, subfolder="unet", torch_dtype=torch.float16)
    quantize(unet, weights=qint8)
    freeze(unet)
    save_quanto_component(unet, folder / "unet")
    del unet
    pack_folder(folder, archive, quiet=True)
    return archive


def unet_bytes(archive: Path) -> int:
    from dduf_plus.format.archive import DDUFArchive

    with DDUFArchive(archive) as a:
        return int(a.index["components"]["unet"]["summary"]["bytes"])


def run_case(case: str, archive: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, case, str(archive)], check=True, capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    fp16 = sd15_archive()
    q8 = quantized_archive()
    for path in (fp16, q8):
        subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)  # warm page cache
    sizes = {"fp16": unet_bytes(fp16), "qint8": unet_bytes(q8)}
    cases = {"qint8 dduf_plus": (q8, "qint8"), "qint8 quanto requantize": (WORK / "sd15-qint8" / "unet", "qint8"),
             "fp16 dduf_plus": (fp16, "fp16"), "fp32 dduf_plus": (fp16, "fp32")}
    rows = {}
    for case, (archive, form) in cases.items():
        runs = [run_case(case, archive) for _ in range(args.repeat)]
        deltas = [r["peak"] - r["baseline"] for r in runs]
        stored = sizes["qint8"] if form == "qint8" else sizes["fp16"] * (2 if form == "fp32" else 1)
        rows[case] = {
            "model_bytes": stored, "peak_delta_bytes": median(deltas),
            "ratio_to_model": median(deltas) / stored, "ratio_to_qint8": median(deltas) / sizes["qint8"],
            "load_s": median([r["load_s"] for r in runs]), "touch_s": median([r["touch_s"] for r in runs]),
            "after_load_delta_bytes": median([r["after_load"] - r["baseline"] for r in runs]),
            "virtual_growth_bytes": median([r["virtual_growth"] for r in runs]),
            "runs": runs,
        }
        r = rows[case]
        print(f"{case}: peak delta {r['peak_delta_bytes'] / 1e9:.3f} GB ({r['ratio_to_model']:.3f}x its size), "
              f"load {r['load_s']:.2f} s", flush=True)
    target = rows["qint8 dduf_plus"]["ratio_to_model"]
    result = {"unet_bytes": sizes, "repeat": args.repeat, "target_ratio": 1.15, "qint8_ratio": target,
              "meets_target": target <= 1.15, "rows": rows,
              "measure": "VmHWM after reset minus RSS after imports; load then read every tensor once"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quant.json").write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(f"SD-1.5-shaped UNet (859.5M params): qint8 stored {sizes['qint8'] / 1e9:.3f} GB, fp16 "
          f"{sizes['fp16'] / 1e9:.3f} GB; peak RSS delta over the import baseline, load + touch every weight, "
          f"median of {args.repeat} fresh processes")
    print()
    print("| load | weights in memory | peak RSS delta | x its own size | x qint8 size | address space reserved | load s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case, r in rows.items():
        print(f"| {case} | {r['model_bytes'] / 1e9:.2f} GB | {r['peak_delta_bytes'] / 1e9:.2f} GB | "
              f"{r['ratio_to_model']:.2f} | {r['ratio_to_qint8']:.2f} | {r['virtual_growth_bytes'] / 1e9:.2f} GB | "
              f"{r['load_s']:.2f} |")


if __name__ == "__main__":
    main()
