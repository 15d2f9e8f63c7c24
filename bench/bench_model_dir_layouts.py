"""A partial archive's UNet, VAE and text encoder resolved from ONE full original SD-1.5 checkpoint in an app's
``models/checkpoints`` (each component's part read through the layout reader: hashed from byte ranges, written
once in diffusers' names, verified), against an IO anchor measured in the same run: sha256 of the checkpoint file.

    python bench/bench_model_dir_layouts.py [--repeat 3]

The SD-1.5-shaped fp16 pipeline (bench/_common.py) is packed as a partial archive referencing its UNet, VAE and
text encoder; a full LDM checkpoint of it (2.1 GB) is the only copy. Per repetition, with a fresh dduf_plus cache:
``first`` resolves the three references (every part hashed, its diffusers-named copy written with fsync and
hashed again), ``second`` resolves them again (nothing hashed: counted). The page cache is warm (the checkpoint
is read once before timing). Writes bench/results/model_dir_layouts.json with its provenance."""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, ROOT, WORK, median, pipeline_folder, write_result  # noqa: E402

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PARTS = ("unet", "vae", "text_encoder")


def _sha256(path: Path) -> float:
    t = time.perf_counter()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return time.perf_counter() - t


def _setup(work: Path) -> tuple[Path, Path, dict[str, Any]]:
    from safetensors.torch import save_file
    from single_file_ckpt import _config, _state, clip_to_ldm, unet_to_ldm, vae_to_ldm

    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.packing import pack

    folder = shutil.copytree(pipeline_folder("sd15"), work / "base", copy_function=os.link)  # BASE, to delete
    archive = work / "sd15-partial.dduf"
    pack(folder, archive, exclude=list(PARTS), refs={n: str(folder) for n in PARTS}, quiet=True, fsync=False)
    models = work / "models"
    (models / "checkpoints").mkdir(parents=True)
    full = models / "checkpoints" / "sd15-pruned-fp16.safetensors"
    # (not checkpoint_from_pipeline: its "+ unet_delta" turns fp16 -0.0 into +0.0, other bytes, rightly refused)
    save_file({**unet_to_ldm(_state(folder, "unet"), _config(folder, "unet")),
               **vae_to_ldm(_state(folder, "vae"), _config(folder, "vae")),
               **clip_to_ldm(_state(folder, "text_encoder"), "cond_stage_model.transformer.")}, full)
    with DDUFArchive(archive) as a:
        refs = {n: dict(a.references[n]) for n in PARTS}
    for n in PARTS:  # the checkpoint is the only copy
        shutil.rmtree(folder / n)
    return full, models, refs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from dduf_plus.packing.model_dir_layouts import install
    from dduf_plus.refs import model_dirs
    from dduf_plus.refs.resolve import locate_component

    install()
    WORK.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=WORK, prefix="model-dir-layouts-"))
    try:
        full, models, refs = _setup(work)
        hashed: list[str] = []
        real = model_dirs.part_digest
        model_dirs.part_digest = lambda path, part: hashed.append(part.layout) or real(path, part)  # type: ignore[assignment]
        rows = []
        for i in range(args.repeat):
            os.environ["DDUF_PLUS_CACHE"] = str(work / f"cache{i}")
            anchor = _sha256(full)  # also warms the page cache
            timings = {}
            for label in ("first", "second"):
                hashed.clear()
                t = time.perf_counter()
                sources = [locate_component(n, refs[n], model_dirs=[models]).source for n in PARTS]
                timings[label] = time.perf_counter() - t
                timings[f"{label}_parts_hashed"] = len(hashed)
            assert all("sd15-pruned-fp16.safetensors" in s for s in sources), sources
            rows.append({"anchor_sha256_file": anchor, **timings})
            shutil.rmtree(work / f"cache{i}")
        med = {k: median([r[k] for r in rows]) for k in rows[0]}
        result = {"checkpoint_bytes": full.stat().st_size, "parts": list(PARTS), "repeat": args.repeat, "rows": rows,
                  "median": med, "first_over_anchor": med["first"] / med["anchor_sha256_file"],
                  "second_over_anchor": med["second"] / med["anchor_sha256_file"]}
        write_result(RESULTS / "model_dir_layouts.json", result)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items() if k != "rows"})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
