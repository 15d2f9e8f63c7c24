"""A sharded Flux transformer referenced by a partial archive: resolved and loaded from ComfyUI's one BFL file vs
from the Hugging Face cache snapshot holding its diffusers shards.

    python bench/bench_model_dirs_shards.py [--repeat 3] [--double 1] [--single 1]

The pipeline is FLUX.1-shaped at the real transformer width (3072, diffusers' BFL converter assumes it) with
``--double`` / ``--single`` blocks (1 + 1: about 1.0 GB in bf16; FLUX.1-dev has 19 + 38, 23.8 GB), the text
encoders and VAE tiny. Its transformer is saved in 3-4 shards with their index (as the diffusers repo holds it),
the pipeline put in a Hugging Face cache layout, and a partial archive packed against that snapshot with the
transformer referenced (its reference records the digest of every shard's tensors). Then, each load in a fresh
process (imports before the clock) with a fresh dduf_plus cache per repetition:

* ``hf_cache``: the reference resolves from the snapshot (the 3 shards' sha256, then the shards loaded);
* ``model_dirs``: the snapshot has no transformer; ComfyUI's ``models/unet/flux1-dev.safetensors`` (BFL layout:
  fused q/k/v and ``linear1``, swapped final adaLN) is found by its tensors' digest and loaded in place;
* ``model_dirs_diffusers``: the same with ONE file in diffusers' names instead (read from its header alone: no
  layout reader, so no diffusers converter imported);
* ``model_dirs_shard_folder``: the transformer as a folder of shards in ComfyUI's ``models/diffusers/flux``, cut
  otherwise (``max_shard_size`` half the transformer: 3 shards against the reference's 4 at the default size;
  found by the digest over all its shards, loaded from them).

``first``: a fresh dduf_plus cache (hashing), ``second``: remembered (nothing hashed). ``resolve``: the reference
located and verified (``locate_component``); the totals add ``load_dduf``. The page cache is warm. The pack's
cost of the digest over the shards is timed too (files' sha256 vs tensors' digest of the 3 shards). Writes
bench/results/model_dirs_shards.json with its provenance."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, ROOT, WORK, median, write_result  # noqa: E402
from model_dirs_common import hf_snapshot, measure, stats, warm  # noqa: E402

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

COMMIT = "0" * 39 + "2"


def _build(root: Path, double: int, single: int) -> Path:
    """The Flux-shaped pipeline with its transformer in 3 shards (bf16)."""
    import torch
    from diffusers import FluxTransformer2DModel
    from single_file_ckpt import FLUX_TRANSFORMER, build_tiny_flux

    tokenizers = ROOT / "fixtures" / "pipelines"
    config = {**FLUX_TRANSFORMER, "num_layers": double, "num_single_layers": single}
    base = build_tiny_flux(root / "flux", tokenizers / "tiny-sd" / "tokenizer", tokenizers / "tiny-dit" / "tokenizer",
                           transformer_config=config)
    size = sum(f.stat().st_size for f in (base / "transformer").glob("*.safetensors"))
    model = FluxTransformer2DModel.from_pretrained(base / "transformer", torch_dtype=torch.bfloat16)
    shutil.rmtree(base / "transformer")
    model.save_pretrained(base / "transformer", max_shard_size=f"{(size // 3 >> 10) + 1024}KB")
    return base


def _shard_folder(src: Path, out: Path) -> None:
    """The transformer re-saved by diffusers cut otherwise (``max_shard_size`` half of it: other shards than the
    reference records)."""
    import torch
    from diffusers import FluxTransformer2DModel

    size = sum(f.stat().st_size for f in (src / "transformer").glob("*.safetensors"))
    model = FluxTransformer2DModel.from_pretrained(src / "transformer", torch_dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size=f"{(size // 2 >> 10) + 1024}KB")


def _hash_once(shards: list[Path], cache: Path) -> dict[str, float]:
    """Seconds for the shards' files' sha256 (what every reference records) and for their tensors' digest (what
    the record adds), each with a fresh dduf_plus cache."""
    from dduf_plus.format.safetensors_header import read_file_header
    from dduf_plus.refs.cache import sha256_file
    from dduf_plus.refs.tensor_digest import tensors_digest

    os.environ["DDUF_PLUS_CACHE"] = str(cache)
    t = time.perf_counter()
    for f in shards:
        sha256_file(f)
    sha = time.perf_counter() - t
    t = time.perf_counter()
    tensors_digest([(f, read_file_header(f, f.name, ValueError)) for f in shards])
    return {"files_sha256": sha, "tensors_digest": time.perf_counter() - t}


CASES = ("hf_cache", "model_dirs", "model_dirs_diffusers", "model_dirs_shard_folder")


def _measure(work: Path, archive: Path, repeat: int) -> dict[str, dict[str, list[float]]]:
    return measure(archive, work, [("hf_cache", work / "hf", []), ("model_dirs", work / "hf-without", [str(work / "models")]),
                                   ("model_dirs_diffusers", work / "hf-without", [str(work / "models-diffusers")]),
                                   ("model_dirs_shard_folder", work / "hf-without", [str(work / "models-shards")])],
                   repeat)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--double", type=int, default=1)
    parser.add_argument("--single", type=int, default=1)
    args = parser.parse_args()
    from safetensors.torch import save_file
    from single_file_ckpt import _state, flux_to_bfl

    from dduf_plus.packing import pack

    WORK.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="model-dirs-shards-", dir=WORK))
    try:
        src = _build(work / "src", args.double, args.single)
        shards = sorted((src / "transformer").glob("*-of-*.safetensors"))
        full = hf_snapshot(work / "hf", src, "bench/flux-sharded", COMMIT)
        hf_snapshot(work / "hf-without", src, "bench/flux-sharded", COMMIT, skip=("transformer",))
        archive = work / "partial.dduf"
        os.environ["DDUF_PLUS_CACHE"] = str(work / "pack-cache")
        pack(full, archive, exclude=["transformer"], refs={"transformer": str(full)}, quiet=True, fsync=False)
        models = work / "models"
        (models / "unet").mkdir(parents=True)
        save_file(flux_to_bfl(_state(src, "transformer")), models / "unet" / "flux1-dev.safetensors")
        (work / "models-diffusers" / "diffusion_models").mkdir(parents=True)
        save_file(_state(src, "transformer"), work / "models-diffusers" / "diffusion_models" / "flux1-dev.safetensors")
        _shard_folder(src, work / "models-shards" / "diffusers" / "flux" / "transformer")
        hashing: dict[str, list[float]] = {"files_sha256": [], "tensors_digest": []}
        warm([src, models, work / "models-diffusers", work / "models-shards", archive])
        for i in range(args.repeat):
            for k, v in _hash_once(shards, work / f"hash-cache-{i}").items():
                hashing[k].append(v)
        rows = _measure(work, archive, args.repeat)
        result = {
            "shape": f"FLUX.1 width 3072, {args.double} double + {args.single} single blocks, bf16",
            "repeat": args.repeat, "shards": len(shards),
            "transformer_bytes": sum(f.stat().st_size for f in shards),
            "app_file": "models/unet/flux1-dev.safetensors (BFL layout)",
            "hash_seconds": {k: stats(v) for k, v in hashing.items()},
            "load_seconds": {c: {k: stats(v) for k, v in r.items()} for c, r in rows.items()},
            "ratio_vs_hf_cache": {c: {k: round(median(rows[c][k]) / median(rows["hf_cache"][k]), 2)
                                      for k in rows["hf_cache"]} for c in CASES[1:]},
            "note": "one process per load, imports before the clock, page cache warm; resolve: the reference "
                    "located and verified; first/second: that plus load_dduf; first: a fresh dduf_plus cache "
                    "(HF cache: the shards' sha256; model folders: the BFL file's part hashed from its ranges, or the "
                    "diffusers-named file's tensors, or the folder's shards'), second: remembered (nothing hashed); the BFL case's first load "
                    "imports diffusers' single-file converter (about 2 s here), the second reads the part's "
                    "remembered map instead (no converter imported)",
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_result(RESULTS / "model_dirs_shards.json", result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
