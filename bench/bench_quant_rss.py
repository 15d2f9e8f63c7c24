"""Peak memory and load time of quantized UNets: ``load_dduf`` against diffusers' ``from_pretrained(folder)``.

Default mode (issue 21): one SD-shaped UNet of 311M parameters (SD 1.5's layout at 0.6x its channel widths:
block_out_channels 192/384/768/768), random weights saved in fp16, then quantized by diffusers itself with
each backend (``from_pretrained(..., quantization_config=...)`` + ``save_pretrained``): optimum-quanto int8
(QuantoConfig, deprecated upstream), torchao int8 weight-only, bitsandbytes nf4 and int8 (diffusers' "No GPU"
gate bypassed: the library runs on CPU), SDNQ int8. Each folder is packed with tiny-sd's other components.

Per backend and loader, in a fresh process:

- baseline: RSS after importing torch, diffusers, the backend and dduf_plus' loader (imports are not the
  loader's cost; the other components are passed as None, so this is the empty-pipeline baseline);
- the kernel's peak-RSS counter (VmHWM) is reset (``/proc/self/clear_refs`` = 5), the UNet is loaded
  (``load_dduf(archive)`` / ``UNet2DConditionModel.from_pretrained(folder/unet)``, both with their defaults, and
  diffusers' again with ``torch_dtype=torch.float16``, the saved dtype: some backends' reloads upcast by default),
  then every stored byte of every parameter and buffer is read once (tensor subclasses through their flattened
  parts), which faults in every weight page: the result is what it takes to *hold* the model;
- reported: ``peak delta`` = VmHWM - baseline, its ratio to the UNet's stored bytes (target <= 1.2x), and the
  load time (to a model, before the touch).

Random weights; the 2-core box is shared with other jobs: timings are noisy, quote the ratios of one run.

    python bench/bench_quant_rss.py [--repeat 1] [--backends quanto,torchao-int8,bnb-nf4,bnb-int8,sdnq-int8]
    python bench/bench_quant_rss.py --sd15-quanto [--repeat 3]   # the issue-6 qint8 rows on SD-1.5's UNet

``--sd15-quanto``: loading the SD-1.5-shaped UNet (859.5M parameters): qint8 (optimum-quanto) vs its fp16
and fp32 forms, and quanto's own ``requantize`` as the anchor. Cases: ``qint8 dduf_plus``
(load_quanto_component: meta skeleton + stored views), ``fp16 dduf_plus`` (load_dduf, saved precision: zero
copy), ``fp32 dduf_plus`` (load_dduf(torch_dtype=float32) of the fp16 archive), ``qint8 quanto requantize``
(quanto's documented reload from the folder). ``address space reserved`` is the growth of VmPeak during the
load. Target (issue 6): qint8 peak delta within 1.15x of its quantized size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, WORK, median, sd15_archive, sd15_folder, write_result  # noqa: E402

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
torch.set_num_threads(1)  # the touch sums on one thread (a busy neighbour makes OpenMP reductions spin-wait)
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


def main_sd15(args: argparse.Namespace) -> None:
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
    _write_results(result)
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



# --- issue 21: every backend, load_dduf vs diffusers' from_pretrained(folder) --------------------------------------
BACKENDS = ("quanto", "torchao-int8", "bnb-nf4", "bnb-int8", "sdnq-int8")
BENCH_UNET = {"block_out_channels": [192, 384, 768, 768], "cross_attention_dim": 768, "attention_head_dim": 8,
              "sample_size": 64, "layers_per_block": 2}  # SD 1.5's layout at 0.6x the widths: 311M parameters
TARGET = 1.2  # peak RSS delta / stored UNet bytes (issue 21)

_CHILD_BACKEND = r"""
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")
backend, loader, path = sys.argv[1], sys.argv[2], sys.argv[3]
import torch, diffusers
from diffusers import UNet2DConditionModel
module = {"quanto": "optimum.quanto", "torchao": "torchao", "bnb": "bitsandbytes", "sdnq": "sdnq"}[backend.split("-")[0]]
__import__(module)
from dduf_plus.loading.pipeline import load_dduf
if backend.startswith("bnb"):  # diffusers refuses bitsandbytes without a GPU; the library has a CPU backend
    from diffusers.quantizers.bitsandbytes import bnb_quantizer
    for cls in (bnb_quantizer.BnB4BitDiffusersQuantizer, bnb_quantizer.BnB8BitDiffusersQuantizer):
        cls.validate_environment = lambda self, *a, **k: None

def rss(field="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)

def leaves(t):
    # a tensor subclass (torchao Int8Tensor, quanto's) through its flattened parts; bitsandbytes' state too
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        try:
            names = t.__tensor_flatten__()[0]
        except Exception:
            names = None
        if names:
            for n in names:
                yield from leaves(getattr(t, n))
            return
    state = getattr(t, "quant_state", None)
    for extra in (getattr(state, "absmax", None), getattr(t, "SCB", None)):
        if isinstance(extra, torch.Tensor):
            yield extra
    yield t.data if isinstance(t, torch.nn.Parameter) else t

def touch(t):
    t = t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t
    if t.numel() == 0:
        return 0.0
    if t.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return float(t.sum())  # same-dtype reduction: reads every byte, no converted copy
    return float(t.reshape(-1).view(torch.uint8).max())

import gc; gc.collect()
baseline = rss()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM: the peak from here on is the load's
t = time.perf_counter()
if loader == "dduf_plus":
    none = {k: None for k in ("text_encoder", "tokenizer", "vae", "safety_checker", "feature_extractor",
                              "image_encoder")}
    unet = load_dduf(path, prefetch=False, **none).unet
else:  # "diffusers fp16": the saved compute dtype, where the backend's own default differs (SDNQ: float32)
    kwargs = {"device_map": "cpu"} if backend.startswith("bnb") else {}  # else bitsandbytes asks for CUDA
    if loader == "diffusers fp16":
        kwargs["torch_dtype"] = torch.float16
    unet = UNet2DConditionModel.from_pretrained(path, **kwargs)
load_s = time.perf_counter() - t
total = 0.0
torch.set_num_threads(1)  # the touch sums on one thread (a busy neighbour makes OpenMP reductions spin-wait)
with torch.no_grad():
    for p in list(unet.parameters()) + list(unet.buffers()):
        for leaf in leaves(p):
            total += touch(leaf)
touch_s = time.perf_counter() - t - load_s
kinds = sorted({type(m).__name__ for m in unet.modules() if "Linear" in type(m).__name__})
print(json.dumps({"baseline": baseline, "peak": rss("VmHWM"), "after_touch": rss(), "load_s": load_s,
                  "touch_s": touch_s, "linear_classes": kinds}))
"""


def _diffusers_config(backend: str) -> object:
    import diffusers

    if backend == "quanto":
        return diffusers.QuantoConfig(weights_dtype="int8")
    if backend == "torchao-int8":
        try:
            from torchao.quantization import Int8WeightOnlyConfig
        except ImportError:  # the backends come with the quant extra, not the bench one
            raise SystemExit("torchao-int8 needs torchao: pip install -e '.[quant]'") from None

        return diffusers.TorchAoConfig(Int8WeightOnlyConfig())
    if backend == "bnb-nf4":
        return diffusers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    if backend == "bnb-int8":
        return diffusers.BitsAndBytesConfig(load_in_8bit=True)
    return diffusers.SDNQConfig(weights_dtype="int8")


def _base_unet() -> Path:
    """The random-weight fp16 UNet every backend quantizes (built once)."""
    folder = WORK / "quant-base-unet"
    if (folder / "config.json").exists():
        return folder
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    UNet2DConditionModel(**BENCH_UNET).to(torch.float16).save_pretrained(folder)
    return folder


def backend_archive(backend: str) -> tuple[Path, Path]:
    """(pipeline folder, archive) of tiny-sd with the bench UNet quantized by diffusers with ``backend``."""
    os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")
    root = WORK / f"quant-{backend}"
    archive = WORK / f"quant-{backend}.dduf"
    if archive.exists() and (root / "unet" / "config.json").exists():
        return root, archive
    import shutil

    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.quantizers.bitsandbytes import bnb_quantizer

    from dduf_plus.packing.pack import pack

    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(ROOT / "fixtures" / "pipelines" / "tiny-sd", root, ignore=shutil.ignore_patterns("unet"))
    gates = {cls: cls.validate_environment for cls in (bnb_quantizer.BnB4BitDiffusersQuantizer,
                                                       bnb_quantizer.BnB8BitDiffusersQuantizer)}
    try:
        for cls in gates:  # the library quantizes on CPU; diffusers' gate only checks for a GPU
            cls.validate_environment = lambda self, *a, **k: None
        unet = UNet2DConditionModel.from_pretrained(_base_unet(), torch_dtype=torch.float16,
                                                    quantization_config=_diffusers_config(backend), device_map="cpu")
        unet.save_pretrained(root / "unet")  # before any forward (a CPU forward repacks bitsandbytes 4-bit)
    finally:
        for cls, gate in gates.items():
            cls.validate_environment = gate
    del unet
    pack(root, archive, quiet=True)
    return root, archive


def _stored_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _run_backend(backend: str, loader: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD_BACKEND, backend, loader, str(path)], check=True,
                         capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "SDNQ_USE_TORCH_COMPILE": "0"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main_backends(args: argparse.Namespace) -> None:
    rows: dict[str, dict] = {}
    for backend in args.backends.split(","):
        folder, archive = backend_archive(backend)
        stored = _stored_bytes(folder / "unet")
        subprocess.run(["cat", str(archive), *map(str, (folder / "unet").glob("*"))], stdout=subprocess.DEVNULL,
                       check=True)  # warm page cache: both loaders read cached bytes
        # diffusers' default and its reload in the saved dtype: quanto's and SDNQ's defaults upcast the unquantized
        # fp16 tensors to float32 (torchao's to bf16), where load_dduf keeps them as saved
        loaders = [("dduf_plus", archive), ("diffusers", folder / "unet"), ("diffusers fp16", folder / "unet")]
        for loader, path in loaders:
            try:
                runs = [_run_backend(backend, loader, path) for _ in range(args.repeat)]
            except subprocess.CalledProcessError as e:
                rows[f"{backend} {loader}"] = {"error": (e.stderr or "").strip().splitlines()[-1:]}
                print(f"{backend} {loader}: failed: {rows[f'{backend} {loader}']['error']}", flush=True)
                continue
            delta = median([r["peak"] - r["baseline"] for r in runs])
            rows[f"{backend} {loader}"] = {
                "backend": backend, "loader": loader, "stored_bytes": stored, "peak_delta_bytes": delta,
                "ratio_to_stored": delta / stored, "load_s": median([r["load_s"] for r in runs]),
                "touch_s": median([r["touch_s"] for r in runs]), "runs": runs}
            print(f"{backend} {loader}: stored {stored / 1e6:.0f} MB, peak delta {delta / 1e6:.0f} MB "
                  f"({delta / stored:.2f}x), load {rows[f'{backend} {loader}']['load_s']:.2f} s", flush=True)
    ours = [r["ratio_to_stored"] for k, r in rows.items() if k.endswith("dduf_plus") and "ratio_to_stored" in r]
    _write_results({"backends": {
        "unet": BENCH_UNET, "repeat": args.repeat, "target_ratio": TARGET, "rows": rows,
        "meets_target": bool(ours) and max(ours) <= TARGET,
        "measure": "VmHWM after reset minus RSS after imports (the other components None); load then read every "
                   "stored byte once; fresh process per measurement; page cache warm"}})
    print("\n| backend | stored UNet | loader | peak RSS delta | x stored | load s |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows.values():
        if "error" not in r:
            print(f"| {r['backend']} | {r['stored_bytes'] / 1e6:.0f} MB | {r['loader']} | "
                  f"{r['peak_delta_bytes'] / 1e6:.0f} MB | {r['ratio_to_stored']:.2f} | {r['load_s']:.2f} |")


def _write_results(update: dict) -> None:
    """bench/results/quant.json keeps both modes' results: each run replaces only its own keys."""
    path = RESULTS / "quant.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(path, {**previous, **update}, kept_from_earlier=set(previous) - set(update) - {"provenance"})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=None, help="fresh processes per case (median)")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--sd15-quanto", action="store_true", help="the issue-6 qint8 rows on SD-1.5's UNet")
    args = parser.parse_args()
    if args.sd15_quanto:
        args.repeat = args.repeat or 3
        main_sd15(args)
    else:
        args.repeat = args.repeat or 1
        main_backends(args)


if __name__ == "__main__":
    main()
