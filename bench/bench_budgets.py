"""Time and memory budgets on hostile archives (docs/security.md): every command that reads an untrusted
archive answers within 3 s and 500 MB peak RSS for any archive of at most 64 MB.

Builds each budget case (fixtures/hostile/make_hostile.py builders: too big to commit) in a temporary
folder, then runs ``dduf validate``, ``dduf info``, ``dduf refs`` and opening ``DDUFArchive`` on it, each
in a fresh process, and prints one row per (case, command): file size, wall and CPU seconds, the child's
peak RSS (``os.wait4``), exit code and the rule codes the verdict names.

Run from the repository root:  python bench/bench_budgets.py [--case NAME ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_SECONDS = 3.0
BUDGET_RSS = 500 << 20

_OPEN = ("import sys\nfrom dduf_plus.errors import DDUFValidationError\nfrom dduf_plus.format.archive import DDUFArchive\n"
         "try:\n    DDUFArchive(sys.argv[1]).close()\n    print('opened')\n"
         "except DDUFValidationError as e:\n    print('refused', *sorted(set(e.codes)))\n    sys.exit(1)\n")
COMMANDS: dict[str, list[str]] = {
    "validate": ["-m", "dduf_plus.cli", "validate"],
    "info": ["-m", "dduf_plus.cli", "info"],
    "refs": ["-m", "dduf_plus.cli", "refs"],
    "open": ["-c", _OPEN],
}
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
        "references-at-cap": lambda folder: mh.many_references_archive(folder / "references.dduf", references),
        "config-pairs-at-cap": data("config-pairs-at-cap.dduf", lambda: mh.json_bomb_archive(
            "pairs", "unet/config.json", size=spec.CONFIG_JSON_BUDGET.bytes - 64)),
        "index-files-at-cap": data("index-files-at-cap.dduf", lambda: mh.index_bomb_archive(index_files)),
    }


def run_measured(argv: list[str], timeout: float = 120.0) -> dict:
    """Run ``python ARGV`` in a fresh process: wall and CPU seconds, peak RSS (``os.wait4`` on its pid),
    exit code, the rule codes its output names."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryFile() as out:
        started = time.perf_counter()
        pid = os.posix_spawn(sys.executable, [sys.executable, *argv], env,
                             file_actions=[(os.POSIX_SPAWN_DUP2, out.fileno(), 1), (os.POSIX_SPAWN_DUP2, out.fileno(), 2)])
        status, usage, killed = _wait(pid, started + timeout)
        seconds = time.perf_counter() - started
        out.seek(0)
        output = out.read().decode("utf-8", "replace")
    return {
        "seconds": seconds,
        "cpu": usage.ru_utime + usage.ru_stime,
        "rss": usage.ru_maxrss * 1024,  # Linux reports KiB
        "rc": -9 if killed else os.waitstatus_to_exitcode(status),
        "codes": sorted(set(_CODE.findall(output))),
        "output": output,
    }


def _wait(pid: int, deadline: float):
    killed = False
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return status, usage, killed
        if time.perf_counter() > deadline and not killed:
            os.kill(pid, 9)
            killed = True
        time.sleep(0.005)


def build_case(name: str, folder: Path) -> Path:
    """Build one case in a child process: wait4's peak RSS of a process includes that of the process it was
    spawned from (Linux keeps the high-water mark across exec), so the measuring process must stay small."""
    proc = subprocess.run([sys.executable, __file__, "--build", name, "--out", str(folder)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode:
        raise RuntimeError(f"building {name} failed:\n{proc.stderr}")
    return Path(proc.stdout.strip())


def measure(argv: list[str], timeout: float = 120.0) -> dict:
    """:func:`run_measured` from a fresh, small process (this script's ``--measure``): callers such as
    pytest, with torch loaded, would otherwise lend the child their own peak RSS."""
    proc = subprocess.run([sys.executable, __file__, "--measure", "--timeout", str(timeout), "--", *argv],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode:
        raise RuntimeError(f"measuring {argv} failed:\n{proc.stderr}")
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="only these cases (default: all)")
    parser.add_argument("--command", action="append", choices=sorted(COMMANDS), help="only these commands")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--build", help=argparse.SUPPRESS)  # internal: build one case into --out
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # internal: see measure()
    parser.add_argument("argv", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build:
        print(cases()[args.build](Path(args.out)))
        return 0
    if args.measure:
        print(json.dumps(run_measured(args.argv, args.timeout)))
        return 0
    chosen = [k for k in cases() if not args.case or k in args.case]
    rows = []
    print(f"{'case':<34} {'size':>8} {'command':<9} {'wall s':>7} {'cpu s':>6} {'RSS MB':>7} {'rc':>3}  codes")
    with tempfile.TemporaryDirectory(prefix="dduf-budgets-") as tmp:
        for name in chosen:
            folder = Path(tmp) / name
            folder.mkdir()
            path = build_case(name, folder)
            size = path.stat().st_size
            for command in args.command or COMMANDS:
                result = run_measured([*COMMANDS[command], str(path)], args.timeout)
                within = result["seconds"] <= BUDGET_SECONDS and result["rss"] <= BUDGET_RSS
                rows.append({"case": name, "size": size, "command": command, **{k: v for k, v in result.items() if k != "output"},
                             "within_budget": within})
                print(f"{name:<34} {size / 1e6:>6.1f}MB {command:<9} {result['seconds']:>7.2f} {result['cpu']:>6.2f} "
                      f"{result['rss'] / 1e6:>7.0f} {result['rc']:>3}  {' '.join(result['codes'][:8])}"
                      + ("" if within else "  OVER BUDGET"), flush=True)
            for leftover in folder.iterdir():
                leftover.unlink()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["within_budget"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
