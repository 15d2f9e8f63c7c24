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




def fresh_row(r: dict) -> list[str]:
    ours, folder = r["results"]["fresh:dduf"], r["results"]["fresh:folder"]
    return [f"| {ours['load']:.2f} s |", f"folder {folder['load']:.2f} s",
            f"| {r['ratios']['fresh-process first load vs folder']:.2f}x |"]


def sdxl_row(r: dict) -> list[str]:
    x = r["shapes"]["sdxl"]
    warm, cold = x["warm"], x["cold"]
    ours = [warm["load_dduf + touch"]["median"], cold["load_dduf + touch"]["median"]]
    theirs = [warm["diffusers folder load + touch"]["median"], cold["diffusers folder load + touch"]["median"]]
    return [f"({x['archive_bytes'] / 1e9:.2f} GB)", f"| {ours[0]:.2f} / {ours[1]:.2f} s |",
            f"folder {theirs[0]:.2f} / {theirs[1]:.2f} s", f"| {ours[0] / theirs[0]:.2f}x / {ours[1] / theirs[1]:.2f}x |"]


def gpu_row(r: dict) -> list[str]:
    loads = r["pipeline_loads"]
    ours, theirs = loads["load_dduf_s"], loads["diffusers_device_map_s"]
    return [f"| {ours:.3f} s |", f"`device_map` {theirs:.3f} s", f"| {ours / theirs:.2f}x |"]


def backends_row(r: dict) -> list[str]:
    rows = r["backends"]["rows"].values()
    ours = {x["backend"]: x["ratio_to_stored"] for x in rows if x["loader"] == "dduf_plus"}
    theirs = {x["backend"]: x["ratio_to_stored"] for x in rows if x["loader"] == "diffusers fp16"}
    ratio = [ours[b] / theirs[b] for b in ours]
    return [f"{len(ours)} backends", f"| {min(ours.values()):.2f}-{max(ours.values()):.2f}x stored |",
            f"diffusers at the saved dtype (fp16) {min(theirs.values()):.2f}-{max(theirs.values()):.2f}x",
            f"| {min(ratio):.2f}-{max(ratio):.2f}x |"]


def first_step_row(r: dict) -> list[str]:
    x = r["results"]
    o = [x["warm:dduf"]["load_first_step"], x["cold:dduf"]["load_first_step"]]
    f = [x["warm:folder"]["load_first_step"], x["cold:folder"]["load_first_step"]]
    return [f"| {o[0]:.2f} / {o[1]:.2f} s |", f"folder {f[0]:.2f} / {f[1]:.2f} s",
            f"| {o[0] / f[0]:.2f}x / {o[1] / f[1]:.2f}x |"]


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




def partial_row(r: dict) -> list[str]:
    return [f"| {gb(r['archive_partial_bytes'])}, {r['pack_base_s']:.2f} s |",
            f"full {gb(r['archive_complete_bytes'])}, {r['pack_complete_s']:.2f} s",
            f"{100 * r['saved_fraction']:.1f} % smaller, {r['pack_base_ratio']:.2f}x"]


def remote_row(r: dict) -> list[str]:
    median = r["median_s"]
    return [gb(r["archive_bytes"]), f"{r['latency_s'] * 1e3:.0f} ms / {r['bandwidth_Bps'] / 1e6:.0f} MB/s link",
            f"| {median['first']:.2f} s / {median['second']:.2f} s |",
            f"download-then-load {median['download_then_load']:.2f} s", f"link limit {median['link_limit']:.2f} s",
            f"| {r['ratios']['first_vs_link_limit']:.2f}x link limit |"]


def remote_per_connection_row(r: dict) -> list[str]:
    m = r["median_s"]
    return [f"capped at {r['per_connection_Bps'] / 1e6:.0f} MB/s", f"| {m['first']:.2f} s |",
            f"ranged download-then-load {m['ranged_download_then_load']:.2f} s",
            f"| {r['ratios']['first_vs_ranged_download_then_load']:.2f}x |"]


def model_dirs_row(r: dict) -> list[str]:
    ours, cache, ratio = r["load_seconds"]["model_dirs"], r["load_seconds"]["hf_cache"], r["ratio_model_dirs_vs_hf_cache"]
    assert r["vae_layout_in_model_dirs"] == "ldm"
    return [f"{r['found_bytes'] / 1e9:.1f} GB from app folders",
            f"| {ours['first']['median']:.2f} / {ours['second']['median']:.2f} s |",
            f"HF cache {cache['first']['median']:.2f} / {cache['second']['median']:.2f} s",
            f"| {ratio['first']:.2f}x / {ratio['second']:.2f}x |"]


def model_dirs_shards_row(r: dict) -> list[str]:
    ours, cache = r["load_seconds"]["model_dirs"], r["load_seconds"]["hf_cache"]
    ratio = r["ratio_vs_hf_cache"]["model_dirs"]
    assert "BFL" in r["app_file"]
    return [f"({r['transformer_bytes'] / 1e9:.2f} GB in {r['shards']} shards)",
            f"| {ours['first']['median']:.2f} / {ours['second']['median']:.2f} s |",
            f"HF cache {cache['first']['median']:.2f} / {cache['second']['median']:.2f} s",
            f"| {ratio['first']:.2f}x / {ratio['second']:.2f}x |"]


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


def lora_row(r: dict) -> list[str]:
    median = r["load_median"]
    return [f"rank {r['rank']}", f"({r['lora_bytes'] / 1e6:.1f} MB)", f"+{r['overhead_bytes'] / 1e3:.0f} kB",
            f"{median['ours']:.2f} s |", f"`load_lora_weights` {median['anchor']:.2f} s", f"| {r['load_ratio']:.2f}x |"]


# row (start of its first cell) -> (results file, expected figures, constants: text with digits not from results)
ROWS: dict[str, tuple[str, Callable[[dict], list[str]], tuple[str, ...]]] = {
    "load SD-1.5-shaped fp16": ("load", lambda r: load_rows(r)[:4], ("SD-1.5", "fp16", "diffusers 0.42")),
    "same, cold page cache": ("load", lambda r: load_rows(r)[4:], ()),
    "same, fresh process (tiny-sd, imports included)": ("load", fresh_row, ()),
    "load SD-1.5-shaped fp16 + first denoising step": ("first_step", first_step_row, ("SD-1.5", "fp16", "64x64")),
    "load SDXL-shaped fp16": ("scale", sdxl_row, ("SDXL", "fp16")),
    "load SD-1.5-shaped fp16 to an H200": ("gpu_load", gpu_row, ("SD-1.5", "fp16", "H200", "0.6.0 code")),
    "`dduf validate`, structural": ("validate", validate_row, ()),
    "`dduf validate --verify`": ("validate", verify_row, ("sha256",)),
    "`dduf pack` (fsync)": ("pack", pack_row, ()),
    "quantized UNet load, peak RSS": ("quant", backends_row, ()),
    "`pack --base` of a `save_pretrained` fine-tune": ("trainer_partial", partial_row, ("SD-1.5",)),
    "same, SDXL-shaped; re-basing": ("trainer_partial_sdxl", lambda r: [
        *partial_row(r), f"the complete archive {r['rebase_archive_vs_folder_ratio']:.2f}x"], ()),
    "LoRA archive": ("lora", lora_row, ("SD-1.5",)),
    "SDXL-shaped partial, ": ("model_dirs_sdxl", model_dirs_row, ("SDXL",)),
    "Flux-shaped sharded transformer": ("model_dirs_shards", model_dirs_shards_row, ()),
    "`load_dduf(URL)`": ("remote", remote_row, ()),
    "same, each connection capped": ("remote_per_connection_ranged", remote_per_connection_row, ()),
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
