#!/usr/bin/env python
"""What quieting other libraries' import notices costs and saves a Python user of ``load_dduf`` (tiny-sd).

    python bench/bench_api_quiet.py [--runs 25] [--fresh 3]     # writes bench/results/api_quiet.json

- first load in a fresh interpreter: the lines other libraries print on stderr, and the wall time of the
  process, with the notices held back (the default) and let through (``show_import_notices()``, what every
  load did before: the anchor, measured in the same run);
- warm loads in one process (imports done): median time, held back vs let through (the anchor);
- one entry into ``dduf_plus.torchkit.quiet.quiet_imports`` (a load enters it once per component).

torch runs on one thread (a shared 2-core VM: see docs/loading.md). Medians."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

FIRST = """
import sys
from dduf_plus.torchkit.quiet import show_import_notices
show_import_notices({shown})
from dduf_plus import load_dduf
load_dduf(sys.argv[1])
"""


def first_load(archive: Path, shown: bool) -> dict[str, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", FIRST.format(shown=shown), str(archive)], capture_output=True,
                          text=True, env=env, cwd=ROOT, check=True)
    return {"seconds": time.perf_counter() - started, "lines": len((done.stdout + done.stderr).splitlines())}


def warm(archive: Path, runs: int) -> dict[str, float]:
    import torch

    from dduf_plus import load_dduf
    from dduf_plus.torchkit.quiet import quiet_imports, show_import_notices

    torch.set_num_threads(1)
    load_dduf(archive)
    out: dict[str, float] = {}
    for label, shown in (("held_back", False), ("let_through", True)):
        previous = show_import_notices(shown)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            load_dduf(archive)
            times.append(time.perf_counter() - t0)
        show_import_notices(previous)
        out[f"warm_load_ms_{label}"] = statistics.median(times) * 1e3
    t0 = time.perf_counter()
    for _ in range(1000):
        with quiet_imports():
            pass
    out["quiet_imports_us_per_entry"] = (time.perf_counter() - t0) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=25, help="warm loads per setting")
    parser.add_argument("--fresh", type=int, default=3, help="fresh-interpreter first loads per setting")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    from provenance import write_result

    from dduf_plus.format.pack import pack_folder

    with tempfile.TemporaryDirectory() as tmp:
        archive = pack_folder(ROOT / "fixtures" / "pipelines" / "tiny-sd", Path(tmp) / "tiny-sd.dduf", quiet=True).path
        first = {}
        for label, shown in (("held_back", False), ("let_through", True)):
            runs = [first_load(archive, shown) for _ in range(args.fresh)]
            first[label] = {"lines": max(r["lines"] for r in runs),
                            "seconds_median": statistics.median(r["seconds"] for r in runs)}
        result = {"first_load_fresh_interpreter": first, **warm(archive, args.runs)}
    result["warm_ratio_held_back_over_let_through"] = (result["warm_load_ms_held_back"]
                                                      / result["warm_load_ms_let_through"])
    write_result(ROOT / "bench" / "results" / "api_quiet.json", result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
