"""Time and memory budgets on hostile archives (docs/security.md): every command that reads an untrusted
archive answers within 3 s and 500 MB peak RSS for any archive of at most 64 MB.

Builds each budget case (fixtures/hostile/make_hostile.py builders: too big to commit) in a temporary
folder, then runs ``dduf validate``, ``dduf info``, ``dduf refs`` and opening ``DDUFArchive`` on it, each
in a fresh process, and prints one row per (case, command): file size, wall and CPU seconds and peak RSS of
that process (VmHWM), exit code and the rule codes its output names. tests/test_security_budgets.py
measures with :func:`measure` too.

Run from the repository root:  python bench/bench_budgets.py [--case NAME ...] [--command CMD ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_SECONDS = 3.0
BUDGET_RSS = 500 << 20
COMMANDS = ("validate", "info", "refs", "open")
_CODE = re.compile(r"\b([ZDSIRHX]\d{3})\b")


def make_hostile():
    module = sys.modules.get("make_hostile")
    if module is None:
        spec = importlib.util.spec_from_file_location("make_hostile", ROOT / "fixtures" / "hostile" / "make_hostile.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["make_hostile"] = module
        spec.loader.exec_module(module)
    return module


def cases() -> dict[str, Callable[[Path], Path]]:
    """{case name: build(folder) -> archive path}: the issue's cases at the sizes they were reported at, then
    the most work an archive can ask for within each cap (valid where the cap allows: those must open)."""
    mh = make_hostile()
    from dduf_plus.format import spec

    def data(name: str, make: Callable[[], bytes]) -> Callable[[Path], Path]:
        def build(folder: Path) -> Path:
            path = folder / name
            path.write_bytes(make())
            return path
        return build

    def tensors(name: str, per_file: list[int], index: bool = False) -> Callable[[Path], Path]:
        return lambda folder: mh.many_tensors_archive(folder / name, per_file, index=index)

    def zst(name: str, per_file: list[int], index: bool = False) -> Callable[[Path], Path]:
        def build(folder: Path) -> Path:
            plain = mh.many_tensors_archive(folder / "plain.dduf", per_file, index=index)
            path = mh.zst_file(plain, folder / name)
            plain.unlink()
            return path
        return build

    per_file, per_archive = spec.MAX_TENSORS_PER_FILE, spec.MAX_TENSORS_PER_ARCHIVE
    mi_budget, index_budget = spec.JSON_BUDGETS[spec.MODEL_INDEX], spec.JSON_BUDGETS[spec.INDEX_NAME]
    components = mi_budget.values // 3 - 100  # 3 values and 28 bytes per component
    references = min(mi_budget.values // 10, mi_budget.bytes // 230) - 20  # 10 values and ~226 bytes each
    index_files = min(index_budget.values // 5, index_budget.bytes // 80) - 1000  # 5 values and ~75 bytes each
    return {
        # the cases
        "million-tensors": tensors("million-tensors.dduf", [1_000_000]),
        "three-million-tensor-headers.zst": zst("three-million-tensor-headers.dduf.zst", [1_000_000] * 3),
        "overlapping-headers-30k": data("overlapping-headers-30k.dduf", lambda: mh.overlapping_headers(30_000)),
        "overlapping-data-10k": data("overlapping-data-10k.dduf", lambda: mh.overlapping_data(10_000)),
        # JSON bombs: 60 MB each
        "deep-model-index": data("deep-model-index.dduf", lambda: mh.json_bomb_archive("deep")),
        "wide-model-index": data("wide-model-index.dduf", lambda: mh.json_bomb_archive("wide")),
        "values-config": data("values-config.dduf", lambda: mh.json_bomb_archive("values", "unet/config.json")),
        "values-index": data("values-index.dduf", lambda: mh.json_bomb_archive("values", spec.INDEX_NAME)),
        # at the caps
        "entries-at-cap": data("entries-at-cap.dduf", lambda: mh.many_entries(spec.MAX_ENTRIES)),
        "overlapping-headers-at-cap": data("overlapping-headers-at-cap.dduf",
                                           lambda: mh.overlapping_headers(spec.MAX_ENTRIES)),
        "tensors-at-cap-indexed": tensors("tensors-at-cap.dduf", [per_file] * (per_archive // per_file), index=True),
        "tensors-at-cap-indexed.zst": zst("tensors-at-cap.dduf.zst", [per_file] * (per_archive // per_file), index=True),
        "tensors-over-cap-many-files": tensors("tensors-over-cap.dduf", [per_file // 2] * 16),
        "components-at-cap": data("components-at-cap.dduf",
                                  lambda: mh.json_bomb_archive("wide", size=components * 28)),
        "components-x-entries-at-cap": lambda folder: mh.components_and_entries_archive(
            folder / "components-x-entries.dduf", components, spec.MAX_ENTRIES),
        "references-at-cap": lambda folder: mh.many_references_archive(folder / "references.dduf", references),
        "config-pairs-at-cap": data("config-pairs-at-cap.dduf", lambda: mh.json_bomb_archive(
            "pairs", "unet/config.json", size=spec.CONFIG_JSON_BUDGET.bytes - 64)),
        "index-files-at-cap": data("index-files-at-cap.dduf", lambda: mh.index_bomb_archive(index_files)),
    }


def measure(command: str, path: str | os.PathLike, *, timeout: float = 120.0, env: dict[str, str] | None = None) -> dict:
    """Run one command on ``path`` in a fresh process (this script's ``--child``): its wall and CPU seconds,
    peak RSS, exit code, output and the rule codes the output names.

    The child measures itself: CPU from getrusage(RUSAGE_SELF), peak RSS from /proc/self/status VmHWM (the
    high-water mark of its own memory map; ru_maxrss would carry over the spawning process's peak across exec,
    so a pytest process with torch loaded would lend the child its 500 MB)."""
    with tempfile.TemporaryDirectory(prefix="dduf-measure-") as tmp:
        result = Path(tmp) / "result.json"
        child_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
        started = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", command, str(path), str(result)],
                                  capture_output=True, text=True, env=child_env, cwd=ROOT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"seconds": timeout, "cpu": None, "rss": None, "rc": None, "codes": [], "output": "timed out"}
        seconds = time.perf_counter() - started
        if not result.is_file():
            raise RuntimeError(f"{command} {path}: the child died (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
        got = json.loads(result.read_text())
    return {"seconds": seconds, **got, "codes": sorted(set(_CODE.findall(got["output"])))}


def _child(command: str, path: str, result: str) -> None:
    """One command, in this process, output captured; then this process's own CPU time and peak RSS."""
    from dduf_plus.errors import DDUFError

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            if command == "open":
                from dduf_plus.format.archive import DDUFArchive

                DDUFArchive(path).close()
                rc = 0
            else:
                from dduf_plus.cli import main

                rc = main([command, path])
        except DDUFError as e:  # DDUFArchive's refusal (the CLI prints its own)
            print(e)
            rc = 1
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/status") as status:
        hwm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    text = out.getvalue()
    Path(result).write_text(json.dumps({"cpu": usage.ru_utime + usage.ru_stime, "rss": hwm_kib << 10, "rc": rc,
                                        "output": text[:20000] + ("\n..." if len(text) > 20000 else "")}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="only these cases (default: all)")
    parser.add_argument("--command", action="append", choices=COMMANDS, help="only these commands")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--child", nargs=3, metavar=("COMMAND", "PATH", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    builders = cases()
    chosen = [k for k in builders if not args.case or k in args.case]
    rows = []
    print(f"{'case':<34} {'size':>8} {'command':<9} {'wall s':>7} {'cpu s':>6} {'RSS MB':>7} {'rc':>3}  codes")
    with tempfile.TemporaryDirectory(prefix="dduf-budgets-") as tmp:
        env = {"HF_HOME": str(Path(tmp) / "hf"), "DDUF_PLUS_CACHE": str(Path(tmp) / "cache")}  # no user caches
        for name in chosen:
            folder = Path(tmp) / name
            folder.mkdir()
            path = builders[name](folder)
            size = path.stat().st_size
            for command in args.command or COMMANDS:
                if path.name.endswith(".zst") and command != "validate":
                    continue  # only validate reads .zst archives
                r = measure(command, path, timeout=args.timeout, env=env)
                within = r["cpu"] is not None and r["cpu"] <= BUDGET_SECONDS and r["rss"] <= BUDGET_RSS
                rows.append({"case": name, "size": size, "command": command, "within_budget": within,
                             **{k: v for k, v in r.items() if k != "output"}})
                cpu = f"{r['cpu']:>6.2f}" if r["cpu"] is not None else "     -"
                rss = f"{r['rss'] / 1e6:>7.0f}" if r["rss"] is not None else "      -"
                print(f"{name:<34} {size / 1e6:>6.1f}MB {command:<9} {r['seconds']:>7.2f} {cpu} {rss} {r['rc']!s:>3}  "
                      f"{' '.join(r['codes'][:8])}" + ("" if within else "  OVER BUDGET"), flush=True)
            for leftover in folder.iterdir():
                leftover.unlink()
    if args.json:
        from provenance import write_result

        write_result(Path(args.json), rows)
    return 0 if all(r["within_budget"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
