"""Every benchmark result says where it came from: a top-level "provenance" (commit, library versions, command,
machine) in each bench/results/*.json, written by bench/provenance.py's write_result for every bench; a result
whose provenance was added after its run says so ("recorded_after": true)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from conftest import ROOT

RESULTS = ROOT / "bench" / "results"
KEYS = {"commit", "versions", "command", "machine"}


def bench_provenance():
    spec = importlib.util.spec_from_file_location("bench_provenance", ROOT / "bench" / "provenance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_result_has_its_provenance(path: Path) -> None:
    data = json.loads(path.read_text())
    assert isinstance(data, dict) and next(iter(data)) == "provenance", f"{path.name}: no top-level provenance"
    record = data["provenance"]
    assert KEYS <= set(record), (path.name, sorted(KEYS - set(record)))
    if not record.get("recorded_after"):  # recorded by the run itself: real values, not placeholders
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", record["commit"]), record["commit"]
        assert "dduf_plus" in record["versions"] and record["machine"], record


def test_every_bench_writes_through_write_result() -> None:
    """No bench writes a results file by hand (it would have no provenance)."""
    for script in sorted((ROOT / "bench").glob("*.py")):
        text = script.read_text()
        if script.name in ("provenance.py", "fuzz_loader.py"):  # the writer itself; the fuzzer writes findings
            continue
        by_hand = re.search(r"(RESULTS|results|\bOUT|\bout|args\.json|target)[^\n]*\.write_text\(json\.dumps", text)
        assert not by_hand, f"{script.name} writes a result by hand: {by_hand[0]}"


def test_write_result_puts_the_run_first(tmp_path: Path) -> None:
    provenance = bench_provenance()
    out = provenance.write_result(tmp_path / "x.json", [{"a": 1}])
    assert list(out) == ["provenance", "rows"] and out["rows"] == [{"a": 1}]
    record = json.loads((tmp_path / "x.json").read_text())["provenance"]
    assert KEYS <= set(record) and "dduf_plus" in record["versions"] and record["machine"]["cpus"] >= 1
    kept = provenance.with_provenance({"provenance": {"old": 1}, "b": 2}, kept_from_earlier=["b"])
    assert "old" not in kept["provenance"] and kept["provenance"]["kept_from_earlier_runs"] == ["b"]
