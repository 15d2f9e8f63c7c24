"""Run in a child process by tests/test_quant_native_safety.py: each hostile quantized archive through
``validate``, ``load_dduf`` and the component loader on its folder, one JSON line per case on stdout.

A native crash (SIGSEGV in a backend's kernel) kills this process, not pytest: the parent sees the signal and
the last case started (``start`` lines) and fails that test.

Usage: python tests/native_safety_worker.py CASES.json  (a list of {"name", "archive", "folder", "component"})
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _outcome(call: Any) -> dict[str, Any]:
    """What a call did: loaded, a DDUFError with its codes, or anything else (a defect)."""
    from dduf_plus.errors import DDUFError

    try:
        call()
    except DDUFError as e:
        return {"kind": "DDUFError", "codes": list(getattr(e, "codes", None) or [getattr(e, "code", None)]),
                "message": str(e)[:300]}
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the case
        return {"kind": type(e).__name__, "message": str(e)[:300]}
    return {"kind": "loaded"}


def _folder_load(folder: Path, component: str) -> None:
    """The component loader itself (no load_findings in front of it): a folder component."""
    import importlib

    from dduf_plus.loading.files import FolderComponentFiles
    from dduf_plus.loading.quant import load_with_diffusers_quantizer

    config = json.loads((folder / component / "config.json").read_text())
    model_cls = getattr(importlib.import_module("diffusers"), config["_class_name"])
    load_with_diffusers_quantizer(model_cls, config, FolderComponentFiles(folder / component))


def main(cases_file: str) -> None:
    from dduf_plus import load_dduf
    from dduf_plus.format.validate import validate

    for case in json.loads(Path(cases_file).read_text()):
        print(json.dumps({"start": case["name"]}), flush=True)
        report = validate(case["archive"])
        result = {"name": case["name"], "validate": [(f.code, f.severity) for f in (*report.errors, *report.warnings)],
                  "load_dduf": _outcome(lambda c=case: load_dduf(c["archive"])),
                  "loader": _outcome(lambda c=case: _folder_load(Path(c["folder"]), c["component"]))}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
