"""``dduf export`` time against the archive's size, at IO speed.

    python bench/bench_export.py [--shape sd15|sdxl] [--repeat 3]

The SD-1.5-shaped (or SDXL-shaped) fp16 pipeline, packed complete, is exported as one LDM single file (every
tensor renamed, the VAE's attention weights reshaped, nothing fused: SD 1.x has no OpenCLIP), and its VAE
alone (``--component vae``); each is timed against the anchor measured in the same run: copying the same
number of bytes (``shutil.copyfile`` of the archive, resp. of the VAE's weights file). No fsync on either
side, a sync before each run (runs interleaved); the page cache warm (the archive read once before). Medians of ``--repeat`` runs, in this process
(imports before the clock). Writes bench/results/export[_sdxl].json with its provenance."""

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
from _common import RESULTS, ROOT, WORK, median, pipeline_archive, pipeline_folder, write_result  # noqa: E402

sys.path.insert(0, str(ROOT))


def _time(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        os.sync()  # the previous run's dirty pages written back outside the clock
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="sd15", choices=("sd15", "sdxl"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out-dir", default=None,
                        help="where outputs are written (default: the bench work folder; /dev/shm: no disk write-back)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    from dduf_plus.packing.export import export_single_file

    archive = pipeline_archive(args.shape)
    vae_file = pipeline_folder(args.shape) / "vae" / "diffusion_pytorch_model.safetensors"
    work = Path(tempfile.mkdtemp(prefix="export-", dir=args.out_dir or WORK))
    try:
        for path in (archive, vae_file):  # warm: both sides read from the page cache
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass
        out, vae_out, copy = work / "out.safetensors", work / "vae.safetensors", work / "copy.bin"
        full, anchor, vae, vae_anchor = [], [], [], []
        for _ in range(args.repeat):  # interleaved, each after a sync: the same write-back state for both sides
            full += _time(lambda: export_single_file(archive, out, fsync=False), 1)
            anchor += _time(lambda: shutil.copyfile(archive, copy), 1)
            vae += _time(lambda: export_single_file(archive, vae_out, component="vae", fsync=False), 1)
            vae_anchor += _time(lambda: shutil.copyfile(vae_file, copy), 1)
        out_bytes, vae_bytes = out.stat().st_size, vae_out.stat().st_size
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def row(times: list[float], anchor_times: list[float], nbytes: int) -> dict[str, object]:
        return {"seconds": round(median(times), 3), "runs": [round(t, 3) for t in times],
                "copy_seconds": round(median(anchor_times), 3), "copy_runs": [round(t, 3) for t in anchor_times],
                "ratio_vs_copy": round(median(times) / median(anchor_times), 2),
                "out_bytes": nbytes, "mb_per_s": round(nbytes / median(times) / 1e6)}

    result = {"shape": args.shape, "repeat": args.repeat, "archive_bytes": archive.stat().st_size,
              "out_dir": args.out_dir or "bench work folder (disk)", "full_file": row(full, anchor, out_bytes),
              "component_vae": row(vae, vae_anchor, vae_bytes),
              "note": "export_single_file in this process (imports before the clock), fsync off, a sync before each "
                      "timed run, page cache warm; anchor: shutil.copyfile of the same bytes, interleaved in the "
                      "same run"}
    name = "export" + ("" if args.shape == "sd15" else f"_{args.shape}")
    write_result(RESULTS / f"{name}.json", result)
    print(json.dumps({k: result[k] for k in ("archive_bytes", "full_file", "component_vae")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
