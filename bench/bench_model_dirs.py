"""A partial archive's references resolved from app model folders vs from the Hugging Face cache.

    python bench/bench_model_dirs.py [--shape sd15|sdxl] [--repeat 3]

The SD-1.5-shaped (or SDXL-shaped) fp16 pipeline is put in a Hugging Face cache layout and packed as a partial
archive (the UNet stored; the VAE, text encoder(s), tokenizer(s) and scheduler referenced, with their tensors'
digest). Then ``load_dduf`` is timed, each load in a fresh process (imports before the clock), with a fresh
dduf_plus cache per repetition (its first load hashes the referenced weights, the second hashes nothing):

* ``hf_cache``: every reference resolves from the Hugging Face cache (files' sha256);
* ``model_dirs``: the VAE and text encoders are not in the cache but in a ComfyUI-shaped ``models/`` folder (the
  VAE as the base has it for sd15, in the LDM layout as ``dduf export --component vae`` writes it for sdxl; the
  text encoders re-saved: other order and metadata, so no file hash matches), found by their tensors' digest.

The pack is timed too, with a fresh dduf_plus cache, with and without the tensors' digest recorded (the
digest's cost: the referenced weights' tensors hashed once more, beside the files' sha256).

The page cache is warm (the same bytes are read before timing). Writes bench/results/model_dirs[_sdxl].json
with its provenance."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, ROOT, WORK, median, pipeline_folder, write_result  # noqa: E402
from model_dirs_common import hf_snapshot, measure, stats, warm  # noqa: E402

sys.path.insert(0, str(ROOT))

COMMIT = "0" * 39 + "1"
MOVED = {"sd15": ("vae", "text_encoder"), "sdxl": ("vae", "text_encoder", "text_encoder_2")}


def _resave(src: Path, dst: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(src)
    save_file(dict(reversed(list(state.items()))), dst, metadata={"saved_by": "an app"})


def _pack(full: Path, archive: Path, referenced: list[str], cache: Path, digest: bool) -> float:
    """Seconds to pack the partial archive with a fresh dduf_plus cache (``digest=False``: the tensors' digest
    not recorded, the anchor)."""
    import time

    from dduf_plus.packing import partial
    from dduf_plus.packing.pack import pack

    os.environ["DDUF_PLUS_CACHE"] = str(cache)
    real = partial.reference_tensors
    if not digest:
        partial.reference_tensors = lambda *a, **k: {}  # type: ignore[assignment]
    try:
        t = time.perf_counter()
        pack(full, archive, exclude=referenced, refs={"*": str(full)}, quiet=True, fsync=False)
        return time.perf_counter() - t
    finally:
        partial.reference_tensors = real  # type: ignore[assignment]


def _hash_once(src: Path, moved: tuple[str, ...], cache: Path) -> dict[str, float]:
    """Seconds to hash the referenced weights' files (sha256, what every reference records) and to digest their
    tensors (what the record adds), each with a fresh dduf_plus cache: the digest's cost apart from the pack's
    copying, which the machine's other jobs make noisy."""
    import time

    from dduf_plus.format.safetensors_header import read_file_header
    from dduf_plus.refs.cache import sha256_file
    from dduf_plus.refs.tensor_digest import tensors_digest

    os.environ["DDUF_PLUS_CACHE"] = str(cache)
    files = [f for n in moved for f in sorted((src / n).glob("*.safetensors"))]
    t = time.perf_counter()
    for f in files:
        sha256_file(f)
    sha = time.perf_counter() - t
    t = time.perf_counter()
    for f in files:
        tensors_digest([(f, read_file_header(f, f.name, ValueError))])
    return {"files_sha256": sha, "tensors_digest": time.perf_counter() - t}


def _app_folders(src: Path, full: Path, archive: Path, models: Path, moved: tuple[str, ...], ldm_vae: bool) -> None:
    """ComfyUI-shaped folders: the VAE (as it is, or in the LDM layout apps keep it in), the text encoders
    re-saved."""
    (models / "vae").mkdir(parents=True)
    (models / "text_encoders").mkdir()
    if ldm_vae:
        from dduf_plus.packing.export import export_single_file

        export_single_file(archive, models / "vae" / "sdxl_vae.safetensors", component="vae",
                           refs={"vae": str(full)}, fsync=False)
    else:
        os.link(src / "vae" / "diffusion_pytorch_model.safetensors", models / "vae" / "vae.safetensors")
    for n in moved[1:]:
        _resave(src / n / "model.safetensors", models / "text_encoders" / f"{n}.safetensors")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="sd15", choices=("sd15", "sdxl"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    src = pipeline_folder(args.shape)
    moved = MOVED[args.shape]
    work = Path(tempfile.mkdtemp(prefix="model-dirs-", dir=WORK))
    try:
        full = hf_snapshot(work / "hf", src, "bench/pipeline", COMMIT)
        hf_snapshot(work / "hf-without", src, "bench/pipeline", COMMIT, skip=moved)
        archive = work / "partial.dduf"
        names = json.loads((src / "model_index.json").read_text())
        referenced = [n for n, v in names.items() if isinstance(v, list) and n != "unet" and v[0] is not None]
        warm([src])
        # the archive the loads use is the last one packed: with the digest
        pack_seconds: dict[str, list[float]] = {"without_digest": [], "with_digest": []}
        for i in range(args.repeat):
            for case in pack_seconds:
                pack_seconds[case].append(_pack(full, archive, referenced, work / f"pack-cache-{case}-{i}",
                                                case == "with_digest"))
        hashing: dict[str, list[float]] = {"files_sha256": [], "tensors_digest": []}
        for i in range(args.repeat):
            for k, v in _hash_once(src, moved, work / f"hash-cache-{i}").items():
                hashing[k].append(v)
        models = work / "models"
        _app_folders(src, full, archive, models, moved, ldm_vae=args.shape == "sdxl")
        warm([src, models, archive])
        rows = measure(archive, work, [("hf_cache", work / "hf", []), ("model_dirs", work / "hf-without", [str(models)])],
                       args.repeat)
        referenced_bytes = sum(f.stat().st_size for n in moved for f in (src / n).glob("*.safetensors"))
        result = {
            "shape": args.shape, "repeat": args.repeat, "archive_bytes": archive.stat().st_size,
            "found_in_model_dirs": list(moved), "found_bytes": referenced_bytes,
            "vae_layout_in_model_dirs": "ldm" if args.shape == "sdxl" else "diffusers",
            "pack_seconds": {k: stats(v) for k, v in pack_seconds.items()},
            "ratio_pack_with_vs_without_digest": round(median(pack_seconds["with_digest"])
                                                       / median(pack_seconds["without_digest"]), 2),
            "hash_seconds": {k: stats(v) for k, v in hashing.items()},
            "ratio_digest_vs_files_sha256": round(median(hashing["tensors_digest"]) / median(hashing["files_sha256"]), 2),
            "load_seconds": {c: {k: stats(v) for k, v in r.items()} for c, r in rows.items()},
            "ratio_model_dirs_vs_hf_cache": {k: round(median(rows["model_dirs"][k]) / median(rows["hf_cache"][k]), 2)
                                             for k in rows["hf_cache"]},
            "note": "one process per load, imports before the clock; resolve: every reference located (and verified) "
                    "with locate_component; first/second: that plus load_dduf, page cache warm; first: a fresh "
                    "dduf_plus cache (the referenced weights hashed: files' sha256 for the HF cache, tensors' "
                    "digest for model folders), second: remembered (nothing hashed)",
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    name = "model_dirs" + ("" if args.shape == "sd15" else f"_{args.shape}")
    write_result(RESULTS / f"{name}.json", result)
    print(json.dumps(result["load_seconds"], indent=2), result["ratio_model_dirs_vs_hf_cache"],
          result["pack_seconds"], result["ratio_pack_with_vs_without_digest"], result["hash_seconds"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
