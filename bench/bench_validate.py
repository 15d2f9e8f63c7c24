"""Validation: speed and bytes read of `dduf validate` vs huggingface_hub `read_dduf_file` on the
SD-1.5-shaped fp16 archive (2.1 GB), warm and cold page cache, same run; `--verify` throughput; and which
hostile corpus cases each checker refuses (read_dduf_file, the npm @huggingface/dduf checkDDUF, ours).

    python bench/bench_validate.py [--repeat 20] [--no-cold] [--no-npm]
    python bench/bench_validate.py --load-check-only [--before DIR] [--repeat 20]

``--load-check-only`` times the opt-in load check (``dduf validate --load-check``: every model built on the
meta device, its state-dict table matched to the stored headers) in a fresh interpreter and warm, and default
structural validation, in process and as a CLI, against an earlier dduf_plus (``--before DIR``: a folder
holding its ``dduf_plus`` package, e.g. ``git archive REV dduf_plus | tar -x -C DIR``); it writes
bench/results/validate_load_check.json and leaves validate.json alone.

Cold-cache figures need write access to /proc/sys/vm/drop_caches (skipped otherwise). The npm checker
is installed into bench/_work/node on first use when npm is present.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, ROOT, WORK, drop_caches, median, sd15_archive, write_result  # noqa: E402

sys.path.insert(0, str(ROOT))
from dduf_plus.format.validate import validate  # noqa: E402

HOSTILE = ROOT / "fixtures" / "hostile"
NODE_DIR = WORK / "node"
NPM_PACKAGE = "@huggingface/dduf@0.0.2"
NODE_SCRIPT = r"""
const {checkDDUF} = require("@huggingface/dduf");
const fs = require("fs");
(async () => {
  const out = {};
  for (const path of process.argv.slice(1)) {
    try {
      const blob = new Blob([fs.readFileSync(path)]);
      for await (const _ of checkDDUF(blob)) { /* entries */ }
      out[path] = null;
    } catch (e) { out[path] = String(e.message || e).slice(0, 120); }
  }
  console.log(JSON.stringify(out));
})();
"""


def storage_read_bytes() -> int:
    """Bytes this process made the kernel fetch from storage (readahead included): /proc/self/io."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def cold(fn) -> dict | None:
    if not drop_caches():
        return None
    before = storage_read_bytes()
    t = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "storage_read_bytes": storage_read_bytes() - before, "result": result}


def cli_wall(cmd: list[str], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        out.append(time.perf_counter() - t)
    return out


def sha256_single_thread(path: Path) -> str:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        h = hashlib.sha256()
        view = memoryview(mm)
        for at in range(0, len(mm), 8 << 20):
            h.update(view[at : at + (8 << 20)])
        view.release()
        return h.hexdigest()


def zipfile_testzip(path: Path) -> None:
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None


def npm_checker() -> Path | None:
    if shutil.which("node") is None:
        return None
    for candidate in (NODE_DIR, ROOT / ".ci" / "node", Path("/tmp/npmdduf")):
        if (candidate / "node_modules" / "@huggingface" / "dduf").is_dir():
            return candidate
    if shutil.which("npm") is None:
        return None
    NODE_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run(["npm", "install", "--prefix", str(NODE_DIR), "--silent", "--no-audit", "--no-fund", NPM_PACKAGE],
                   check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return NODE_DIR if (NODE_DIR / "node_modules" / "@huggingface" / "dduf").is_dir() else None


def run_npm(paths: list[str]) -> dict[str, str | None] | None:
    where = npm_checker()
    if where is None:
        return None
    out = subprocess.run(["node", "-e", NODE_SCRIPT, *paths], cwd=where, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def hub_refuses(path: Path) -> str | None:
    from huggingface_hub import read_dduf_file

    try:
        read_dduf_file(path)
    except Exception as e:  # noqa: BLE001 - any refusal counts
        return f"{type(e).__name__}: {e}"[:120]
    return None


def hostile_table(use_npm: bool) -> list[dict]:
    cases = json.loads((HOSTILE / "cases.json").read_text())
    files = sorted(cases)
    npm = run_npm([str(HOSTILE / f) for f in files]) if use_npm else None
    rows = []
    for f in files:
        case = cases[f]
        report = validate(HOSTILE / f, verify=case["verify"])
        rows.append({
            "file": f, "code": case["code"], "verify": case["verify"], "what": case["what"],
            "read_dduf_file": hub_refuses(HOSTILE / f),
            "checkDDUF": None if npm is None else npm[str(HOSTILE / f)],
            "npm_ran": npm is not None,
            "dduf_validate": None if report.valid else ", ".join(sorted({x.code for x in report.errors})),
            "dduf_warnings": ", ".join(sorted({x.code for x in report.warnings})),
        })
    return rows


_IN_PROCESS = """
import json, statistics, sys, time
from dduf_plus.format.validate import validate
path, repeat = sys.argv[1], int(sys.argv[2])
first = validate(path)
runs = []
for _ in range(repeat):
    t = time.perf_counter(); validate(path); runs.append(time.perf_counter() - t)
print(json.dumps({"median_s": statistics.median(runs), "runs": runs, "valid": first.valid, "codes": first.codes}))
"""

_LOAD_CHECK = """
import json, sys, time
started = time.perf_counter()
import dduf_plus
report = dduf_plus.validate(sys.argv[1], load_check=True)
first = time.perf_counter() - started
runs = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter(); dduf_plus.validate(sys.argv[1], load_check=True); runs.append(time.perf_counter() - t)
print(json.dumps({"fresh_process_s": first, "warm_runs": runs, "valid": report.valid, "codes": report.codes}))
"""


def _python_json(code: str, args: list[str], pythonpath: str) -> dict:
    env = dict(os.environ, PYTHONPATH=pythonpath)
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def load_check_bench(archive: Path, repeat: int, before: Path | None) -> dict:
    """Default validation before/after (in process, CLI wall) and the load check (fresh process, warm)."""
    trees = {"after": str(ROOT)} | ({"before": str(before)} if before is not None else {})
    out: dict = {"archive_bytes": archive.stat().st_size, "cpus": os.cpu_count(), "structural": {}, "cli_wall_s": {}}
    for label, tree in trees.items():
        out["structural"][label] = _python_json(_IN_PROCESS, [str(archive), str(repeat)], tree)
        env = dict(os.environ, PYTHONPATH=tree)
        runs = []
        for _ in range(max(5, repeat // 2)):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "dduf_plus.cli", "validate", str(archive)], env=env,
                           stdout=subprocess.DEVNULL, check=False)
            runs.append(time.perf_counter() - started)
        out["cli_wall_s"][label] = median(runs)
        print(f"{label}: structural {out['structural'][label]['median_s'] * 1e3:.2f} ms in process, "
              f"CLI {median(runs) * 1e3:.0f} ms", flush=True)
    check = _python_json(_LOAD_CHECK, [str(archive), str(max(3, repeat // 4))], str(ROOT))
    check["warm_s"] = median(check["warm_runs"])
    out["load_check"] = check
    print(f"load check: {check['fresh_process_s']:.2f} s in a fresh interpreter (imports included), "
          f"{check['warm_s']:.3f} s warm; valid={check['valid']} {check['codes']}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache runs (they drop the page cache)")
    parser.add_argument("--no-npm", action="store_true")
    parser.add_argument("--load-check-only", action="store_true",
                        help="time the load check and default validation before/after, nothing else")
    parser.add_argument("--before", type=Path, default=None,
                        help="with --load-check-only: a folder holding an earlier dduf_plus package to compare")
    args = parser.parse_args()
    if args.load_check_only:
        archive = sd15_archive()
        result = load_check_bench(archive, args.repeat, args.before)
        write_result(RESULTS / "validate_load_check.json", result)
        return
    from huggingface_hub import read_dduf_file  # imported before timing, like ours

    archive = sd15_archive()
    size = archive.stat().st_size
    print(f"archive: {archive} ({size / 1e9:.2f} GB)", flush=True)
    results: dict = {"archive_bytes": size, "cpus": os.cpu_count()}

    # structural, warm
    first = validate(archive)
    assert first.valid, first
    read_dduf_file(archive)
    ours = timed(lambda: validate(archive), args.repeat)
    hub = timed(lambda: read_dduf_file(archive), args.repeat)
    results["structural_warm"] = {
        "dduf_validate_s": median(ours), "read_dduf_file_s": median(hub),
        "dduf_validate_bytes_read": first.bytes_read, "runs": {"ours": ours, "hub": hub}}
    print(f"structural warm: validate {median(ours) * 1e3:.2f} ms (reads {first.bytes_read / 1024:.1f} KiB), "
          f"read_dduf_file {median(hub) * 1e3:.2f} ms", flush=True)

    # structural, cold
    if not args.no_cold:
        c_ours = cold(lambda: validate(archive).bytes_read)
        c_hub = cold(lambda: read_dduf_file(archive) and None)
        if c_ours is not None:
            results["structural_cold"] = {"dduf_validate": c_ours, "read_dduf_file": c_hub}
            print(f"structural cold: validate {c_ours['seconds'] * 1e3:.1f} ms, storage reads "
                  f"{c_ours['storage_read_bytes'] / 1e6:.2f} MB (asked for {c_ours['result'] / 1024:.1f} KiB); "
                  f"read_dduf_file {c_hub['seconds'] * 1e3:.1f} ms, {c_hub['storage_read_bytes'] / 1e6:.2f} MB", flush=True)
        else:
            print("structural cold: skipped (cannot drop the page cache)", flush=True)

    # CLI wall, interpreter start included
    py = sys.executable
    env_cmds = {
        "python -c pass (interpreter start)": [py, "-c", "pass"],
        "dduf validate": [py, "-m", "dduf_plus.cli", "validate", str(archive)],
        "read_dduf_file in a fresh python": [py, "-c", "import sys; from huggingface_hub import read_dduf_file; "
                                             "read_dduf_file(sys.argv[1])", str(archive)],
    }
    results["cli_wall_s"] = {}
    for label, cmd in env_cmds.items():
        runs = cli_wall(cmd, max(5, args.repeat // 2))
        results["cli_wall_s"][label] = median(runs)
        print(f"wall: {label}: {median(runs) * 1e3:.0f} ms", flush=True)

    # --verify throughput, warm (file in the page cache) and cold
    subprocess.run(["cat", str(archive)], stdout=subprocess.DEVNULL, check=True)
    verify_runs = timed(lambda: validate(archive, verify=True), 3)
    assert validate(archive, verify=True).valid
    sha_runs = timed(lambda: sha256_single_thread(archive), 2)
    zip_runs = timed(lambda: zipfile_testzip(archive), 2)
    results["verify_warm"] = {
        "dduf_validate_verify_s": median(verify_runs), "gb_per_s": size / median(verify_runs) / 1e9,
        "sha256_one_thread_s": median(sha_runs), "sha256_one_thread_gb_per_s": size / median(sha_runs) / 1e9,
        "zipfile_testzip_s": median(zip_runs), "zipfile_testzip_gb_per_s": size / median(zip_runs) / 1e9}
    print(f"verify warm: {median(verify_runs):.2f} s = {size / median(verify_runs) / 1e9:.2f} GB/s "
          f"(CRC-32 + sha256 of every entry); anchors: sha256 alone, one thread {size / median(sha_runs) / 1e9:.2f} GB/s, "
          f"zipfile testzip (CRC only) {size / median(zip_runs) / 1e9:.2f} GB/s", flush=True)
    if not args.no_cold:
        c_verify = cold(lambda: validate(archive, verify=True).valid)
        if c_verify is not None:
            results["verify_cold"] = c_verify | {"gb_per_s": size / c_verify["seconds"] / 1e9}
            print(f"verify cold: {c_verify['seconds']:.2f} s = {size / c_verify['seconds'] / 1e9:.2f} GB/s", flush=True)

    # hostile corpus: who refuses what
    rows = hostile_table(not args.no_npm)
    results["hostile"] = rows
    npm_ran = rows and rows[0]["npm_ran"]

    def mark(value: str | None, ran: bool = True) -> str:
        return "n/a" if not ran else ("refused" if value else "**accepted**")

    print("\n| case | rule | read_dduf_file | checkDDUF (npm) | dduf validate |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        flag = " (--verify)" if r["verify"] else ""
        ours = f"refused ({r['dduf_validate']})" if r["dduf_validate"] else f"warns ({r['dduf_warnings']})"
        print(f"| {r['file'].removesuffix('.dduf')}: {r['what']} | {r['code']}{flag} | {mark(r['read_dduf_file'])} "
              f"| {mark(r['checkDDUF'], npm_ran)} | {ours} |")
    refused = [r for r in rows if r["dduf_validate"]]
    n = len(rows)
    summary = {
        "cases": n,
        "refused_by_read_dduf_file": sum(bool(r["read_dduf_file"]) for r in rows),
        "refused_by_checkDDUF": sum(bool(r["checkDDUF"]) for r in rows) if npm_ran else None,
        "refused_by_dduf_validate": len(refused),
        "warned_by_dduf_validate": n - len(refused),
    }
    results["hostile_summary"] = summary
    print(f"\nrefused of {n}: read_dduf_file {summary['refused_by_read_dduf_file']}, checkDDUF "
          f"{summary['refused_by_checkDDUF']}, dduf validate {summary['refused_by_dduf_validate']} "
          f"(+{summary['warned_by_dduf_validate']} warning-only cases reported as warnings)")

    w = results["structural_warm"]
    print("\nsummary:")
    print(f"  in-process structural: {w['dduf_validate_s'] * 1e3:.2f} ms vs read_dduf_file {w['read_dduf_file_s'] * 1e3:.2f} ms "
          f"(x{w['read_dduf_file_s'] / w['dduf_validate_s']:.2f})")
    walls = results["cli_wall_s"]
    print(f"  CLI wall: {walls['dduf validate'] * 1e3:.0f} ms (python start alone {walls['python -c pass (interpreter start)'] * 1e3:.0f} ms)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(RESULTS / "validate.json", results)
    print(f"wrote {RESULTS / 'validate.json'}")


if __name__ == "__main__":
    main()
