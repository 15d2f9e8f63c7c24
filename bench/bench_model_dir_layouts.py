"""A partial archive's UNet, VAE and text encoder resolved from ONE full original SD-1.5 checkpoint in an app's
``models/checkpoints`` (each component's part read through the layout reader: hashed from byte ranges, then used
in place), against an IO anchor measured in the same run: sha256 of the checkpoint file.

    python bench/bench_model_dir_layouts.py [--repeat 3]

The SD-1.5-shaped fp16 pipeline (bench/_common.py) is packed as a partial archive referencing its UNet, VAE and
text encoder; a full LDM checkpoint of it (2.1 GB) is the only copy. Per repetition, with a fresh dduf_plus cache:
``first`` resolves the three references (every part hashed; nothing written), ``second`` resolves them again
(nothing hashed: counted), ``copy`` writes the three diffusers-named copies ``dduf complete`` needs (with fsync,
hashed as written), ``first_load`` is ``load_dduf(partial, model_dirs=...)`` in another fresh cache (parts
hashed, models built on views of the checkpoint's mapping). The page cache is warm (the checkpoint is read once
before timing). ``first_load_via_copy``: the same load, each part first written as a copy and loaded from it
(the route before parts were used in place, less its second hash of the copy). Writes
bench/results/model_dir_layouts.json with its provenance."""

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


def _load_via_copy(archive: Path, models: Path, cache: Path) -> float:
    """``load_dduf`` as it was before parts were used in place: each part written as a diffusers-named copy
    (fsync'ed; now hashed as written, one pass: the old route hashed the copy again), loaded from that copy."""
    from dduf_plus import load_dduf
    from dduf_plus.refs import resolve

    os.environ["DDUF_PLUS_CACHE"] = str(cache)
    real = resolve.locate_component
    resolve.locate_component = lambda *a, **k: resolve.with_files_on_disk(real(*a, **k))  # type: ignore[assignment]
    try:
        t = time.perf_counter()
        pipe = load_dduf(archive, model_dirs=[models])
        took = time.perf_counter() - t
    finally:
        resolve.locate_component = real  # type: ignore[assignment]
    del pipe
    shutil.rmtree(cache)
    return took


def _repetition(work: Path, i: int, full: Path, models: Path, refs: dict[str, Any], archive: Path,
                hashed: list[str]) -> dict[str, Any]:
    from dduf_plus import load_dduf
    from dduf_plus.refs.resolve import locate_component, with_files_on_disk

    os.environ["DDUF_PLUS_CACHE"] = str(work / f"cache{i}")
    anchor = _sha256(full)  # also warms the page cache
    timings: dict[str, Any] = {}
    for label in ("first", "second"):
        hashed.clear()
        t = time.perf_counter()
        located = [locate_component(n, refs[n], model_dirs=[models]) for n in PARTS]
        timings[label] = time.perf_counter() - t
        timings[f"{label}_parts_hashed"] = len(hashed)
    assert all("sd15-pruned-fp16.safetensors" in loc.source for loc in located), [loc.source for loc in located]
    written = list((work / f"cache{i}").rglob("*.safetensors"))
    timings["first_weights_written"] = sum(1 for w in written if not w.is_symlink())
    t = time.perf_counter()
    for loc in located:
        with_files_on_disk(loc)
    timings["copy"] = time.perf_counter() - t
    os.environ["DDUF_PLUS_CACHE"] = str(work / f"cache{i}-load")
    t = time.perf_counter()
    pipe = load_dduf(archive, model_dirs=[models])
    timings["first_load"] = time.perf_counter() - t
    del pipe
    shutil.rmtree(work / f"cache{i}")
    shutil.rmtree(work / f"cache{i}-load")
    timings["first_load_via_copy"] = _load_via_copy(archive, models, work / f"cache{i}-copy")
    return {"anchor_sha256_file": anchor, **timings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from dduf_plus.packing.model_dir_layouts import install
    from dduf_plus.refs import model_dirs

    install()
    WORK.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=WORK, prefix="model-dir-layouts-"))
    try:
        full, models, refs = _setup(work)
        hashed: list[str] = []
        real = model_dirs.part_digest
        model_dirs.part_digest = lambda path, part: hashed.append(part.layout) or real(path, part)  # type: ignore[assignment]
        rows = [_repetition(work, i, full, models, refs, work / "sd15-partial.dduf", hashed)
                for i in range(args.repeat)]
        med = {k: median([r[k] for r in rows]) for k in rows[0]}
        result = {"checkpoint_bytes": full.stat().st_size, "parts": list(PARTS), "repeat": args.repeat, "rows": rows,
                  "median": med, "first_over_anchor": med["first"] / med["anchor_sha256_file"],
                  "second_over_anchor": med["second"] / med["anchor_sha256_file"],
                  "copy_over_anchor": med["copy"] / med["anchor_sha256_file"],
                  "first_load_over_anchor": med["first_load"] / med["anchor_sha256_file"],
                  "first_load_via_copy_over_anchor": med["first_load_via_copy"] / med["anchor_sha256_file"],
                  "before": {"commit": "f3a4b04", "first": 15.377, "first_over_anchor": 7.063, "second": 0.087,
                             "note": "first resolution wrote each part's copy (fsync) and hashed it again"}}
        write_result(RESULTS / "model_dir_layouts.json", result)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items() if k != "rows"})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
