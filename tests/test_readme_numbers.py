"""Every number in README.md's headline benchmark table is the one in the latest bench/results/*.json, rounded
as the README shows it. Each row maps to its results fields; a number in a row that is neither one of them nor
a listed constant (a version, a model name) fails, so a rerun benchmark cannot leave a stale figure behind."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results"


def results(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def load_rows(r: dict) -> list[str]:
    warm, cold, folder = r["results"]["warm:dduf"], r["results"]["cold:dduf"], r["results"]["warm:folder"]
    ratios = r["ratios"]
    return [gb(r["archive_bytes"]), f"| {warm['load_touch']:.3f} s |", f"folder {folder['load_touch']:.3f} s",
            f"| {ratios['warm load+touch vs folder']:.2f}x |", f"| {cold['load_touch']:.2f} s |",
            f"archive {r['cat_archive_s']['cold']:.2f} s", f"| {ratios['cold load+touch vs cat']:.2f}x |"]


def old_diffusers_row(r: dict) -> list[str]:
    ratios = r["ratios"]
    return [f"| {r['results']['warm:dduf']['load']:.3f} s |", f"| {r['results']['warm:old-hub']['load']:.2f} s |",
            f"{ratios['speed-up vs diffusers 0.35.2']:.1f}x faster", f"{ratios['peak RSS vs diffusers 0.35.2']:.2f}x RSS"]


def validate_row(r: dict) -> list[str]:
    warm = r["structural_warm"]
    return [f"| {warm['dduf_validate_s'] * 1e3:.1f} ms |", f"`read_dduf_file` {warm['read_dduf_file_s'] * 1e3:.2f} ms"]


def verify_row(r: dict) -> list[str]:
    verify = r["verify_warm"]
    return [f"| {verify['gb_per_s']:.2f} GB/s |", f"one thread, {verify['sha256_one_thread_gb_per_s']:.2f} GB/s"]


def pack_row(r: dict) -> list[str]:
    ours = r["rows"]["dduf pack (fsync, default)"]["median_s"]
    hub = r["rows"]["hub export_folder_as_dduf + sync"]["median_s"]
    return [f"| {ours:.2f} s |", f"+ sync {hub:.2f} s", f"| {ours / hub:.2f}x |"]


def quant_row(r: dict) -> list[str]:
    ours, anchor = r["rows"]["qint8 dduf_plus"], r["rows"]["qint8 quanto requantize"]
    return [f"| {gb(ours['peak_delta_bytes'])} |", f"`requantize` {gb(anchor['peak_delta_bytes'])}",
            f"{gb(anchor['virtual_growth_bytes'])} address space", f"{ours['ratio_to_model']:.2f}x its size"]


def partial_row(r: dict) -> list[str]:
    return [f"({len(r['referenced'])} components referenced)", f"| {gb(r['partial_bytes'])} |",
            f"full {gb(r['complete_bytes'])}", f"{r['saved_pct']:.1f} % smaller"]


def remote_row(r: dict) -> list[str]:
    median = r["median_s"]
    return [gb(r["archive_bytes"]), f"{r['latency_s'] * 1e3:.0f} ms / {r['bandwidth_Bps'] / 1e6:.0f} MB/s link",
            f"| {median['first']:.1f} s / {median['second']:.2f} s |", f"download-then-load {median['download_then_load']:.1f} s"]


def hub_row(r: dict) -> list[str]:
    offline, first = r["load_repo"]["cached_offline"], r["load_repo"]["first"]
    return [f"| {offline['hub_step_s'] * 1e3:.1f} ms, {offline['requests']} requests |",
            f"first download {first['hub_step_s'] * 1e3:.1f} ms"]


def catalogue_row(r: dict) -> list[str]:
    threads = {run["jobs"]: run for run in r["runs"] if run["mode"] == "api-threads"}
    most = max(threads)
    return [f"{r['count']:,} archives", f"{r['latency_s'] * 1e3:.0f} ms link", f"{most} threads",
            f"| {threads[most]['archives_per_s']:.0f} archives/s |", f"1 thread {threads[1]['archives_per_s']:.1f}/s",
            f"| {r['ratios'][f'api-threads jobs {most} / jobs 1']:.0f}x |"]


def serve_row(r: dict) -> list[str]:
    upload = sorted((run for run in r["runs"] if run["mode"] == "upload"), key=lambda run: run["concurrency"])
    one, many = upload[0], upload[-1]
    return [f"{one['concurrency']} / {many['concurrency']} clients",
            f"| {one['p50_ms']:.1f} ({one['p99_ms']:.0f}) / {many['p50_ms']:.0f} ({many['p99_ms']:.0f}) ms |",
            f"| {sum(run['errors'] for run in upload)} errors |"]


# row (start of its first cell) -> (results file, expected figures, constants: text with digits not from results)
ROWS: dict[str, tuple[str, Callable[[dict], list[str]], tuple[str, ...]]] = {
    "load SD-1.5-shaped fp16": ("load", lambda r: load_rows(r)[:4], ("SD-1.5", "fp16", "diffusers 0.42")),
    "same, cold page cache": ("load", lambda r: load_rows(r)[4:], ()),
    "same vs diffusers 0.35.2": ("load", old_diffusers_row, ("diffusers 0.35.2",)),
    "`dduf validate`, structural": ("validate", validate_row, ()),
    "`dduf validate --verify`": ("validate", verify_row, ("sha256",)),
    "`dduf pack` (fsync)": ("pack", pack_row, ()),
    "qint8 UNet load": ("quant", quant_row, ("qint8",)),
    "partial archive": ("partial", partial_row, ()),
    # the disk's write speed is a `dd` run beside the benchmark (docs/benchmarks.md), not a results field
    "`load_dduf(URL)`": ("remote", remote_row, ("(53-59 MB/s writes)",)),
    "`load_dduf(\"org/repo\")` Hub step": ("hub", hub_row, ()),
    "`validate_many`": ("catalogue", catalogue_row, ()),
    "`dduf serve` upload": ("serve", serve_row, ("p50 (p99)",)),
}


def headline_rows() -> list[str]:
    section = README.read_text(encoding="utf-8").split("## Headline benchmarks", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert rows[0].startswith("| measure |"), rows[0]
    return rows[1:]


def test_every_row_is_mapped() -> None:
    rows = headline_rows()
    unmapped = [row for row in rows if not any(row.startswith(f"| {key}") for key in ROWS)]
    assert not unmapped, f"README rows with no results mapping in {__file__}: {unmapped}"
    assert len(rows) == len(ROWS), "a mapped row left README.md: drop its mapping"


@pytest.mark.parametrize("key", list(ROWS))
def test_row_equals_latest_results(key: str) -> None:
    name, expected, constants = ROWS[key]
    row = next(row for row in headline_rows() if row.startswith(f"| {key}"))
    rest = row
    for figure in [*expected(results(name)), *constants]:
        assert figure in rest, f"README row {row!r}: expected {figure!r} (bench/results/{name}.json)"
        rest = rest.replace(figure, "|" if figure.startswith("|") else " ", 1)
    stray = re.findall(r"\d[\d.,]*", rest)
    assert not stray, f"README row {row!r}: numbers {stray} come from no bench/results/{name}.json field"


def test_machine_sentence_matches_results() -> None:
    section = README.read_text(encoding="utf-8").split("## Headline benchmarks", 1)[1]
    assert f"{results('load')['cpus']}-vCPU VM" in section
