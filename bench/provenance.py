"""Where a benchmark result came from, written at the top of every bench/results/*.json: the commit, the library
versions, the command and the machine (with its load when the run began: this VM is shared, and a number means
little without it). Torch-free and without side effects, so any bench (gpu_load.py on a device machine too) can
import it; bench/_common.py re-exports it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = ("torch", "diffusers", "transformers", "huggingface_hub", "safetensors", "accelerate", "numpy",
             "optimum-quanto", "torchao", "bitsandbytes", "sdnq", "zstandard", "fsspec")


def git_commit() -> str:
    """HEAD's commit, with "+dirty" when the work tree differs from it (a result of uncommitted code)."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def versions(names: Iterable[str] = LIBRARIES) -> dict[str, str]:
    """Installed versions of dduf_plus and the libraries a benchmark runs (the absent ones left out)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str] = {}
    try:
        sys.path.insert(0, str(ROOT))
        from dduf_plus._version import __version__

        found["dduf_plus"] = __version__
    except ImportError:  # pragma: no cover
        pass
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def machine() -> dict[str, Any]:
    """CPU model and count, memory, OS, and the load average as the run began."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):  # pragma: no cover
        memory = 0
    return {"cpu": model, "cpus": os.cpu_count(), "memory_bytes": memory, "os": platform.platform(),
            "python": platform.python_version(), "load_average": [round(x, 2) for x in os.getloadavg()]}


def provenance(command: list[str] | None = None) -> dict[str, Any]:
    """The provenance record of a run that is happening now (``command``: default ``sys.argv``)."""
    argv = [Path(sys.executable).name, *(sys.argv if command is None else command)]
    return {"commit": git_commit(), "versions": versions(), "command": " ".join(argv), "machine": machine(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def with_provenance(data: Any, kept_from_earlier: Iterable[str] = ()) -> dict[str, Any]:
    """``data`` with this run's provenance as its first key (a list becomes ``{"rows": data}``); the keys named in
    ``kept_from_earlier`` come from an earlier run's file (said in the record, not passed off as this run's)."""
    body = {"rows": data} if isinstance(data, list) else {k: v for k, v in data.items() if k != "provenance"}
    record = provenance()
    kept = sorted(kept_from_earlier)
    if kept:
        record["kept_from_earlier_runs"] = kept
    return {"provenance": record, **body}


def write_result(path: Path, data: Any, kept_from_earlier: Iterable[str] = (), **dump: Any) -> dict[str, Any]:
    """Write ``data`` with its provenance to ``path`` (bench/results/NAME.json), as JSON; returns what was written."""
    out = with_provenance(data, kept_from_earlier)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=dump.pop("indent", 2), **dump) + "\n")
    return out
