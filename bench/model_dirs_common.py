"""What the app-folder benchmarks (bench_model_dirs.py, bench_model_dirs_shards.py) share: the load timed in a
fresh process, page-cache warming and the median/runs record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _common import median

# One fresh process per load (imports before the clock): every reference located (and verified), then load_dduf.
LOAD = """
import os, sys, time, json
import torch
torch.set_num_threads(1)
import diffusers, transformers
from dduf_plus import load_dduf
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.refs.resolve import locate_component
from dduf_plus.packing.model_dir_layouts import install
install()
dirs = json.loads(sys.argv[2])
t = time.perf_counter()
with DDUFArchive(sys.argv[1]) as a:
    refs = a.references
for name, ref in refs.items():
    locate_component(name, ref, model_dirs=dirs or None)
resolved = time.perf_counter() - t
pipe = load_dduf(sys.argv[1], model_dirs=dirs or None)
print(json.dumps({"seconds": time.perf_counter() - t, "resolve": resolved}))
"""


def load_once(archive: Path, env: dict[str, str], dirs: list[str]) -> tuple[float, float]:
    """(seconds to resolve every reference, seconds to resolve and load) in a fresh process."""
    out = subprocess.run([sys.executable, "-c", LOAD, str(archive), json.dumps(dirs)], env=env, check=False,
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"load failed ({'model folders' if dirs else 'HF cache'}):\n{out.stderr[-4000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return float(got["resolve"]), float(got["seconds"])


def warm(paths: list[Path]) -> None:
    """Read every file (or every safetensors file under a folder) once: the page cache warm for both sides."""
    for p in paths:
        for f in ([p] if p.is_file() else sorted(p.rglob("*.safetensors"))):
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass


def stats(values: list[float]) -> dict[str, object]:
    return {"median": round(median(values), 3), "runs": [round(x, 3) for x in values]}


def link_tree(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    """A hard-linked copy of ``src`` (no bytes copied), leaving out the top-level folders in ``skip``."""
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if rel.parts[0] in skip or rel.name.startswith("."):
            continue
        target = dst / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)


def hf_snapshot(cache: Path, src: Path, repo_id: str, commit: str, skip: tuple[str, ...] = ()) -> Path:
    """``src`` hard-linked into a Hugging Face cache at ``cache`` as ``repo_id`` at ``commit`` (refs/main)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    link_tree(src, snap, skip)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snap


def measure(archive: Path, work: Path, cases: list[tuple[str, Path, list[str]]],
            repeat: int) -> dict[str, dict[str, list[float]]]:
    """Per case (name, the HF cache it sees, the model folders it searches): ``repeat`` first loads (a fresh
    dduf_plus cache each) and the second load after each, resolve and resolve+load seconds."""
    rows: dict[str, dict[str, list[float]]] = {
        case: {"first": [], "second": [], "resolve_first": [], "resolve_second": []} for case, _hf, _dirs in cases}
    for i in range(repeat):
        for case, hf, dirs in cases:
            env = {**os.environ, "HF_HUB_CACHE": str(hf), "HF_HUB_OFFLINE": "1",
                   "DDUF_PLUS_CACHE": str(work / f"cache-{case}-{i}"), "OMP_NUM_THREADS": "1"}
            env.pop("DDUF_PLUS_MODEL_DIRS", None)
            for which in ("first", "second"):
                resolve, total = load_once(archive, env, dirs)
                rows[case][which].append(total)
                rows[case][f"resolve_{which}"].append(resolve)
    return rows
