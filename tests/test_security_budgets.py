"""Time and memory budgets on hostile archives (issue 10 item 6): archives of at most 64 MB that used to take
15-56 s and up to 1.4 GB in every reader are now answered quickly with their cap's rule code. Measured in a
fresh process (CPU time and peak RSS of that process only); the full table is `python bench/bench_budgets.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, load_make_hostile

CPU_BUDGET_S = 3.0
RSS_BUDGET_MB = 500

_MEASURE = """
import json, resource, sys
from dduf_plus.format.validate import validate
report = validate(sys.argv[1])
usage = resource.getrusage(resource.RUSAGE_SELF)
# VmHWM belongs to this process's own memory map (ru_maxrss would carry the spawning process's peak over exec)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"codes": report.codes, "cpu": usage.ru_utime + usage.ru_stime, "rss_mb": hwm / 1024}))
"""


def measure(path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def mh():
    return load_make_hostile()


def test_a_million_tensors_is_S011_within_budget(tmp_path: Path, mh) -> None:
    path = mh.many_tensors_archive(tmp_path / "million.dduf", [1_000_000])
    assert path.stat().st_size <= 64 << 20
    got = measure(path)
    assert "S011" in got["codes"], got
    assert got["cpu"] < CPU_BUDGET_S and got["rss_mb"] < RSS_BUDGET_MB, got


@pytest.mark.parametrize("kind", ["wide", "deep", "values"])
def test_json_bombs_are_D013_within_budget(tmp_path: Path, mh, kind: str) -> None:
    path = tmp_path / f"{kind}.dduf"
    path.write_bytes(mh.json_bomb_archive(kind, size=60 << 20))
    got = measure(path)
    assert "D013" in got["codes"], got
    assert got["cpu"] < CPU_BUDGET_S and got["rss_mb"] < RSS_BUDGET_MB, got


def test_overlapping_entries_are_Z015_within_budget(tmp_path: Path, mh) -> None:
    path = tmp_path / "overlap.dduf"
    path.write_bytes(mh.overlapping_data(10_000, span=512 << 10))
    got = measure(path)
    assert "Z015" in got["codes"], got
    assert got["cpu"] < CPU_BUDGET_S and got["rss_mb"] < RSS_BUDGET_MB, got


def test_entry_cap_is_Z005(tmp_path: Path, mh) -> None:
    path = tmp_path / "entries.dduf"
    path.write_bytes(mh.many_entries(12_000))
    got = measure(path)
    assert "Z005" in got["codes"], got
    assert got["cpu"] < CPU_BUDGET_S, got


def test_measurement_is_of_the_child_only(tmp_path: Path) -> None:
    """The helper must not report the test process's own (large) peak: a tiny archive measures small."""
    from conftest import HOSTILE

    assert measure(HOSTILE / "valid.dduf")["rss_mb"] < 200
