"""The trainer's partial archive: a fine-tune as ``save_pretrained`` writes it, packed against its base.

    python bench/bench_trainer_partial.py [--shape sd15|sdxl] [--repeat 3] [--clean]

The fine-tune is made from the SD-1.5-shaped (or SDXL-shaped) fp16 pipeline the way a trainer's folder differs
from its base: every config re-saved (``_name_or_path`` added, library versions bumped), ``tokenizer_config.json``
as transformers 5 writes it (``is_local``, ``local_files_only``) and the slow tokenizer's files gone, every
frozen model's weights rewritten with the tensors in another order and other ``__metadata__`` (the same tensors,
no byte of the file equal), and the denoiser's weights changed (lowest mantissa bit flipped at random). Then:

* ``pack FT`` (complete) and ``pack FT --base BASE`` (partial, BASE a folder): time, medians of ``--repeat``
  runs in this process (imports done before the clock, the page cache warm), and archive bytes;
* the ratio of the two times (target: at most 1.2x) and the bytes the partial archive saves;
* re-basing the complete archive instead (``pack FT.dduf --base BASE``: its entries copied from the archive, nothing
  extracted), timed in the same rounds, and checked to write the same archive as ``pack FT --base BASE``.

``--clean`` removes the fine-tune and the archives afterwards (the SDXL shape needs about 26 GB of disk meanwhile:
BASE and FT folders 6.9 GB each, the complete archive 6.9 GB, a partial one 5.1 GB).

Writes bench/results/trainer_partial[_sdxl].json with its provenance."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, ROOT, WORK, compile_package, median, pipeline_folder, write_result  # noqa: E402

sys.path.insert(0, str(ROOT))

SLOW_TOKENIZER = ("vocab.json", "merges.txt")


def _resave_json(src: Path, dst: Path, extra: dict[str, object]) -> None:
    data = json.loads(src.read_text())
    data.update(extra)
    dst.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _reordered_safetensors(src: Path, dst: Path) -> None:
    """The same tensors, written in reverse order with other metadata: another file, the same content."""
    with open(src, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        base = 8 + n
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0],
                       reverse=True)
        new, offset = {"__metadata__": {"format": "pt", "saved_by": "a trainer"}}, 0
        for k in names:
            begin, end = header[k]["data_offsets"]
            new[k] = {**header[k], "data_offsets": [offset, offset + end - begin]}
            offset += end - begin
        raw = json.dumps(new).encode()
        raw += b" " * (-len(raw) % 8)
        with open(dst, "wb") as g:
            g.write(len(raw).to_bytes(8, "little") + raw)
            for k in names:
                begin, end = header[k]["data_offsets"]
                f.seek(base + begin)
                g.write(f.read(end - begin))


def _perturbed(src: Path, dst: Path) -> None:
    """The denoiser a trainer changed: the same header, every 16-bit value's lowest bit flipped at random."""
    import numpy as np

    rng = np.random.default_rng(1)
    with open(src, "rb") as f, open(dst, "wb") as g:
        head = f.read(8)
        g.write(head + f.read(int.from_bytes(head, "little")))
        while block := f.read(64 << 20):
            data = np.frombuffer(block, dtype=np.uint16)
            g.write((data ^ rng.integers(0, 2, data.shape, dtype=np.uint16)).tobytes())


def make_trainer_folder(base: Path, out: Path, denoiser: str) -> Path:
    if (out / ".complete").exists():
        return out
    if out.exists():
        shutil.rmtree(out)
    for src in sorted(p for p in base.rglob("*") if p.is_file() and p.name != ".complete"):
        dst = out / src.relative_to(base)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.name in SLOW_TOKENIZER and (src.parent / "tokenizer.json").exists():
            continue
        if src.name == "tokenizer_config.json":
            _resave_json(src, dst, {"is_local": True, "local_files_only": False})
        elif src.suffix == ".json" and src.name != "model_index.json" and ".index" not in src.name:
            key = "transformers_version" if "model_type" in json.loads(src.read_text()) else "_diffusers_version"
            _resave_json(src, dst, {"_name_or_path": str(base / src.parent.name), key: "99.0.0"})
        elif src.suffix == ".safetensors":
            (_perturbed if src.parent.name == denoiser else _reordered_safetensors)(src, dst)
        else:
            shutil.copyfile(src, dst)
    (out / ".complete").touch()
    return out


def timed_packs(pack, ft: Path, base: Path, out: Path, repeat: int  # noqa: ANN001 - dduf_plus.packing.pack
                ) -> tuple[dict[str, list[float]], dict[str, int], bool]:
    """``repeat`` rounds of: pack FT (complete), pack FT --base BASE (partial), pack complete.dduf --base BASE (the
    archive re-based). Returns the times, the archive sizes and whether the re-based archive is the partial one."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["DDUF_PLUS_CACHE"] = str(out / "dduf-cache")
    times: dict[str, list[float]] = {"complete": [], "partial": [], "rebase_archive": []}
    sizes: dict[str, int] = {}
    indexes: dict[str, object] = {}
    complete = out / "complete.dduf"
    for _ in range(repeat):
        for kind, source, kwargs in (("complete", ft, {}), ("partial", ft, {"base": str(base)}),
                                     ("rebase_archive", complete, {"base": str(base)})):
            target = out / f"{kind}.dduf"
            if kind != "complete":
                target.unlink(missing_ok=True)
            else:  # the complete archive is the next step's input: written beside, then moved in place
                target = out / "complete.new.dduf"
            started = time.perf_counter()
            result, _ = pack(source, target, quiet=True, **kwargs)
            times[kind].append(time.perf_counter() - started)
            if kind == "complete":
                target = target.replace(complete)
            sizes[kind] = target.stat().st_size
            indexes[kind] = (sizes[kind], result.index)
            if kind != "complete":
                target.unlink()  # disk: only the complete archive stays between steps
    return times, sizes, indexes["partial"] == indexes["rebase_archive"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("sd15", "sdxl"), default="sd15")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--clean", action="store_true", help="remove the fine-tune and the archives afterwards")
    args = parser.parse_args()
    compile_package()
    from dduf_plus.packing.pack import pack

    base = pipeline_folder(args.shape)
    ft = make_trainer_folder(base, WORK / f"{args.shape}-trainer-ft", "unet")
    out = WORK / "trainer-partial"
    out.mkdir(exist_ok=True)
    times, sizes, same = timed_packs(pack, ft, base, out, args.repeat)
    result = {
        "shape": args.shape, "repeat": args.repeat,
        "pack_complete_s": median(times["complete"]), "pack_base_s": median(times["partial"]),
        "pack_base_ratio": median(times["partial"]) / median(times["complete"]),
        "archive_complete_bytes": sizes["complete"], "archive_partial_bytes": sizes["partial"],
        "saved_fraction": 1 - sizes["partial"] / sizes["complete"],
        "rebase_archive_s": median(times["rebase_archive"]),
        "rebase_archive_vs_folder_ratio": median(times["rebase_archive"]) / median(times["partial"]),
        "rebase_archive_same_as_folder": same,
        "runs": times,
    }
    name = "trainer_partial.json" if args.shape == "sd15" else f"trainer_partial_{args.shape}.json"
    write_result(RESULTS / name, result)
    print(f"{args.shape}: pack FT {result['pack_complete_s']:.2f} s, pack FT --base {result['pack_base_s']:.2f} s "
          f"({result['pack_base_ratio']:.2f}x); archive {sizes['partial'] / 1e9:.3f} GB vs "
          f"{sizes['complete'] / 1e9:.3f} GB complete ({100 * result['saved_fraction']:.1f} % smaller); "
          f"re-base of the complete archive {result['rebase_archive_s']:.2f} s "
          f"({result['rebase_archive_vs_folder_ratio']:.2f}x the folder's --base pack; same archive: {same})")
    if args.clean:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(ft, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
