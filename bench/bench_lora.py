"""LoRA archives on the SD-1.5-shaped fp16 pipeline: size against the LoRA file, and load time against diffusers.

    python bench/bench_lora.py [--rank 32] [--repeat 3]

A LoRA like the ones people share for SD 1.5 (peft, rank 32 on the UNet's attention projections and the text
encoder's, fp16, written by diffusers' ``save_lora_weights``) is packed with ``pack_lora(..., base=FOLDER)``. Then,
alternating, median of ``--repeat`` warm runs in this process (imports done before the clock):

* ours: ``load_dduf(L.dduf)``: the base resolved from the folder its references name (verified by sha256: the
  first load hashes, later loads find the hashes remembered by file identity), the adapter applied through
  diffusers' ``load_lora_weights`` from the archive's mapping;
* anchor: ``DiffusionPipeline.from_pretrained(FOLDER, torch_dtype=float16)`` + ``load_lora_weights(FILE)``.

Targets (#28): archive at most the LoRA file + 64 KiB; load at most 1.0x the anchor.
Writes bench/results/lora.json with its provenance."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, ROOT, WORK, median, pipeline_folder, write_result  # noqa: E402

sys.path.insert(0, str(ROOT))


def make_lora(base: Path, out: Path, rank: int) -> Path:
    """A seeded rank-``rank`` fp16 LoRA of the UNet's and the text encoder's attention, as diffusers saves it."""
    import torch
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    file = out / "pytorch_lora_weights.safetensors"
    if file.exists():
        return file
    pipe = StableDiffusionPipeline.from_pretrained(base, torch_dtype=torch.float16)
    torch.manual_seed(0)
    layers = {}
    for component, targets in (("unet", ["to_q", "to_k", "to_v", "to_out.0"]),
                               ("text_encoder", ["q_proj", "k_proj", "v_proj", "out_proj"])):
        config = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=targets)
        inject_adapter_in_model(config, getattr(pipe, component), adapter_name="bench")
        state = get_peft_model_state_dict(getattr(pipe, component), adapter_name="bench")
        layers[f"{component}_lora_layers"] = {k: v.half().contiguous() for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    StableDiffusionPipeline.save_lora_weights(out, **layers)
    return file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import torch
    from diffusers import DiffusionPipeline

    from dduf_plus import load_dduf
    from dduf_plus.packing.lora import pack_lora

    base = pipeline_folder("sd15")
    work = WORK / "lora"
    lora = make_lora(base, work / f"rank{args.rank}", args.rank)
    archive = work / f"rank{args.rank}.dduf"
    started = time.perf_counter()
    pack_lora([f"style={lora}"], archive, base=str(base), quiet=True)
    pack_seconds = time.perf_counter() - started
    load_dduf(archive)  # the first load hashes BASE's files once; later loads find them remembered
    gc.collect()

    def ours() -> None:
        pipe = load_dduf(archive)
        assert pipe.get_active_adapters() == ["style"]

    def anchor() -> None:
        pipe = DiffusionPipeline.from_pretrained(base, torch_dtype=torch.float16)
        pipe.load_lora_weights(str(lora.parent), adapter_name="style")

    times: dict[str, list[float]] = {"ours": [], "anchor": []}
    for _ in range(args.repeat):
        for name, fn in (("anchor", anchor), ("ours", ours)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
            gc.collect()
    result = {
        "shape": "sd15 (fp16 base, 2.1 GB)", "rank": args.rank,
        "lora_bytes": lora.stat().st_size, "archive_bytes": archive.stat().st_size,
        "overhead_bytes": archive.stat().st_size - lora.stat().st_size,
        "pack_seconds": round(pack_seconds, 3),
        "load_seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "load_median": {k: round(median(v), 3) for k, v in times.items()},
    }
    result["load_ratio"] = round(result["load_median"]["ours"] / result["load_median"]["anchor"], 3)
    write_result(RESULTS / "lora.json", result)
    print(f"LoRA file {result['lora_bytes']:,} B, archive {result['archive_bytes']:,} B "
          f"(+{result['overhead_bytes']:,} B); pack {pack_seconds:.2f} s")
    print(f"load: ours {result['load_median']['ours']:.2f} s, from_pretrained + load_lora_weights "
          f"{result['load_median']['anchor']:.2f} s: {result['load_ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
