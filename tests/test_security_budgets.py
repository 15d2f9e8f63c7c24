"""Time and memory budgets on hostile archives (issue 10 item 6, docs/security.md): any archive of at most 64 MB is
answered by `dduf validate`, `dduf info`, `dduf refs` and opening `DDUFArchive` within 3 s and 500 MB, by speed or
by a cap with its own rule code. Cases that took 15-56 s and up to 1.4 GB are answered with their code; archives
doing the most work each cap allows still pass (valid ones still open).

Each command runs in a fresh process that measures itself (bench/bench_budgets.py's `measure`: CPU time of that
process, its own peak RSS from VmHWM), so the verdict does not depend on how loaded the machine is; wall time gets
a generous bound that still catches a command waiting on something. Full table: `python bench/bench_budgets.py`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from conftest import HOSTILE, ROOT, load_make_hostile
from dduf_plus.format import spec

CPU_BUDGET_S = 3.0
RSS_BUDGET = 500 << 20
COMMANDS = ("validate", "info", "refs", "open")
mh = load_make_hostile()


def _bench():
    module = sys.modules.get("bench_budgets")
    if module is None:
        module_spec = importlib.util.spec_from_file_location("bench_budgets", ROOT / "bench" / "bench_budgets.py")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules["bench_budgets"] = module
        module_spec.loader.exec_module(module)
    return module


@pytest.fixture
def run(tmp_path: Path):
    """run(command, path) -> measurement, asserted within the budgets; caches confined to tmp_path."""
    env = {"HF_HOME": str(tmp_path / "hf"), "DDUF_PLUS_CACHE": str(tmp_path / "dduf-cache")}

    def run(command: str, path: Path) -> dict:
        got = _bench().measure(command, path, timeout=60, env=env)
        assert got["rc"] is not None, f"{command} {path.name} ran past 60 s"
        # CPU seconds and peak RSS are the process' own (a busy machine stretches wall time, not these); a
        # process that waits instead (a retry loop, a hang) is ended by the 60 s limit above
        assert got["cpu"] < CPU_BUDGET_S and got["rss"] < RSS_BUDGET, \
            {k: v for k, v in got.items() if k != "output"}
        assert "Traceback" not in got["output"] and "X000" not in got["codes"], got["output"][-2000:]
        return got

    return run


def refused_by_all(run, path: Path, code: str, commands=COMMANDS) -> None:
    for command in commands:
        got = run(command, path)
        assert got["rc"] == 1 and code in got["codes"], (command, got["codes"], got["output"][-1000:])


# --- the cases the review found -----------------------------------------------------------------------------
def test_a_million_tensor_header_is_S011_everywhere(run, tmp_path: Path) -> None:
    path = mh.many_tensors_archive(tmp_path / "million.dduf", [1_000_000])  # 59 MB; was 15 s / 890 MB, "OK"
    assert path.stat().st_size <= 64 << 20
    refused_by_all(run, path, "S011")


def test_a_zst_of_three_million_tensor_headers_is_S011(run, tmp_path: Path) -> None:
    pytest.importorskip("zstandard")
    plain = mh.many_tensors_archive(tmp_path / "plain.dduf", [1_000_000] * 3)
    path = mh.zst_file(plain, tmp_path / "three.dduf.zst")  # 2 MB; was 55 s / 1.4 GB, "OK"
    plain.unlink()
    got = run("validate", path)
    assert got["rc"] == 1 and "S011" in got["codes"], got["output"][-1000:]


def test_overlapping_entries_are_Z015_and_read_once(run, tmp_path: Path) -> None:
    # every entry's data runs over all later entries: 10,000 x 4 MiB of reads before (46 s)
    path = tmp_path / "overlap-data.dduf"
    path.write_bytes(mh.overlapping_data(spec.MAX_ENTRIES))
    refused_by_all(run, path, "Z015")
    # every local header's 64 KiB extra field lies over the next ~1,300 headers
    path = tmp_path / "overlap-headers.dduf"
    path.write_bytes(mh.overlapping_headers(spec.MAX_ENTRIES))
    refused_by_all(run, path, "Z015")


@pytest.mark.parametrize(("kind", "entry"), [("wide", spec.MODEL_INDEX), ("deep", spec.MODEL_INDEX),
                                             ("values", "unet/config.json"), ("values", spec.INDEX_NAME)])
def test_json_bombs_are_D013(run, tmp_path: Path, kind: str, entry: str) -> None:
    path = tmp_path / f"{kind}.dduf"
    path.write_bytes(mh.json_bomb_archive(kind, entry, size=60 << 20))  # was up to 56 s / 1.7 GB
    # configs are parsed by validate only; model_index.json and the index by every command
    refused_by_all(run, path, "D013", ("validate",) if entry == "unet/config.json" else COMMANDS)


def test_entry_cap_is_Z005(run, tmp_path: Path) -> None:
    path = tmp_path / "entries.dduf"
    path.write_bytes(mh.many_entries(spec.MAX_ENTRIES + 1))
    refused_by_all(run, path, "Z005", ("validate", "open"))


# --- the most each cap allows ---------------------------------------------------------------------------------
def test_an_indexed_archive_at_the_tensor_caps_opens_within_budget(run, tmp_path: Path) -> None:
    per_file = [spec.MAX_TENSORS_PER_FILE] * (spec.MAX_TENSORS_PER_ARCHIVE // spec.MAX_TENSORS_PER_FILE)
    path = mh.many_tensors_archive(tmp_path / "at-cap.dduf", per_file, index=True)
    for command in COMMANDS:
        got = run(command, path)
        assert got["rc"] == 0, (command, got["output"][-1000:])
        assert "S011" not in got["codes"]


def test_tensors_over_the_archive_cap_in_many_files_stop_early(run, tmp_path: Path) -> None:
    path = mh.many_tensors_archive(tmp_path / "spread.dduf", [spec.MAX_TENSORS_PER_FILE // 2] * 16)
    refused_by_all(run, path, "S011", ("validate", "open"))


def test_one_tensor_over_a_cap_is_S011_in_process(tmp_path: Path) -> None:
    """The caps are exact: at the cap opens, one more is refused (per file, and per archive with the excess in
    the last file)."""
    from dduf_plus.errors import DDUFValidationError
    from dduf_plus.format.archive import DDUFArchive

    per_file, per_archive = spec.MAX_TENSORS_PER_FILE, spec.MAX_TENSORS_PER_ARCHIVE
    DDUFArchive(mh.many_tensors_archive(tmp_path / "file-cap.dduf", [per_file])).close()
    for name, layout in (("file", [per_file + 1]), ("archive", [per_file] * (per_archive // per_file) + [1])):
        with pytest.raises(DDUFValidationError) as refused:
            DDUFArchive(mh.many_tensors_archive(tmp_path / f"{name}.dduf", layout))
        assert "S011" in refused.value.codes, refused.value


def test_json_at_its_budget_is_parsed_and_within_budget(run, tmp_path: Path) -> None:
    # a config of 8 MiB of members, the most its budget lets a parser build
    path = tmp_path / "config.dduf"
    path.write_bytes(mh.json_bomb_archive("pairs", "unet/config.json", size=spec.CONFIG_JSON_BUDGET.bytes - 64))
    assert run("validate", path)["rc"] == 0
    # an index naming ~200,000 files the archive does not hold: one I002 finding per file up to 20, then a count
    index_budget = spec.JSON_BUDGETS[spec.INDEX_NAME]
    path = tmp_path / "index.dduf"
    path.write_bytes(mh.index_bomb_archive(min(index_budget.values // 5, index_budget.bytes // 80) - 1000))
    got = run("validate", path)
    assert got["rc"] == 1 and "I002" in got["codes"] and "more indexed files" in got["output"]
    assert got["output"].count("indexed file is not in the archive") == 20
    refused_by_all(run, path, "I002", ("open",))


def test_components_times_entries_at_their_caps(run, tmp_path: Path) -> None:
    # ~5,400 components (model_index.json's value budget) and 10,000 entries: validate's index check looked
    # up each component's files by scanning every entry (11 s before)
    components = spec.JSON_BUDGETS[spec.MODEL_INDEX].values // 3 - 100
    path = mh.components_and_entries_archive(tmp_path / "cxe.dduf", components, spec.MAX_ENTRIES)
    for command in COMMANDS:
        assert run(command, path)["rc"] == 0, command


def test_references_at_the_model_index_budget(run, tmp_path: Path) -> None:
    budget = spec.JSON_BUDGETS[spec.MODEL_INDEX]
    path = mh.many_references_archive(tmp_path / "refs.dduf", min(budget.values // 10, budget.bytes // 230) - 20)
    assert run("validate", path)["rc"] == 0
    got = run("refs", path)  # offline: every reference unresolved, each costs a cache lookup
    assert got["rc"] == 1 and "unresolved" in got["output"].lower()


def test_measurement_is_of_the_child_only() -> None:
    """The helper must not report the test process's own (large) peak: a tiny archive measures small."""
    got = _bench().measure("validate", HOSTILE / "valid.dduf")
    assert got["rc"] == 0 and got["rss"] < 200 << 20
