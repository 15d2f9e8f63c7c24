"""Severities that mean something: error = will not load, unsafe or loads differently; warning = loads, but a user
must know (``--strict`` promotes them); info = a foreign or slower archive (never promoted). An archive
huggingface_hub's exporter writes from a good folder passes ``--strict``; an ordinary deflated ZIP gets Z011 and
what is really wrong, not false ZIP or DDUF errors; the CLI and ``dduf serve``'s page use the same words."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest

from conftest import HOSTILE, PIPELINES
from dduf_plus.cli import main as cli_main
from dduf_plus.format.findings import RULES, SEVERITIES, VERDICT_LABELS, count_text
from dduf_plus.format.validate import validate

TINY_SD = PIPELINES / "tiny-sd"


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = cli_main(["validate", *argv])
    return code, capsys.readouterr().out


def hub_export(tmp_path: Path, folder: Path = TINY_SD) -> Path:
    from huggingface_hub import export_folder_as_dduf

    out = tmp_path / "hub.dduf"
    export_folder_as_dduf(out, folder)
    return out


def deflated(tmp_path: Path, folder: Path = TINY_SD, name: str = "deflated.dduf", skip: tuple[str, ...] = ()) -> Path:
    """An ordinary ZIP of a pipeline folder, every entry deflated (what `zip -r` or zipfile writes)."""
    out = tmp_path / name
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        z.write(folder / "model_index.json", "model_index.json")
        for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
            for f in sorted(sub.iterdir()):
                if f"{sub.name}/{f.name}" not in skip:
                    z.write(f, f"{sub.name}/{f.name}")
    return out


# --- the table ----------------------------------------------------------------------------------------------
def test_foreign_or_slower_archive_rules_are_infos():
    assert set(SEVERITIES) == {"error", "warning", "info"}
    assert {c for c, r in RULES.items() if r.severity == "info"} >= {"I003", "S008", "S009", "Z018"}
    assert all(r.severity in SEVERITIES for r in RULES.values())
    assert RULES["R003"].severity == "warning" and RULES["D016"].severity == RULES["D017"].severity == "error"


def test_strict_promotes_warnings_never_infos():
    info_only = validate(HOSTILE / "index-missing.dduf", strict=True)  # I003
    assert info_only.valid and [f.code for f in info_only.infos] == ["I003"] and not info_only.warnings
    warned = validate(HOSTILE / "reference-without-source.dduf")
    assert warned.valid and "R003" in [f.code for f in warned.warnings]
    strict = validate(HOSTILE / "reference-without-source.dduf", strict=True)
    assert not strict.valid and "R003" in [f.code for f in strict.errors] and not strict.warnings


def test_report_dict_keeps_each_severity_apart():
    d = validate(HOSTILE / "st-unaligned-page.dduf").as_dict()
    assert d["valid"] and not d["warnings"] and "S008" in [f["code"] for f in d["infos"]]


# --- huggingface_hub's exporter: a foreign archive, not a bad one ---------------------------------------------
def test_hub_exported_archive_of_a_good_folder_passes_strict(tmp_path, capsys):
    archive = hub_export(tmp_path)
    report = validate(archive, strict=True, verify=True)
    assert report.valid and not report.errors and not report.warnings, report
    assert {"I003", "S008", "Z018"} <= {f.code for f in report.infos}  # no index, unaligned, no ZIP64 extras
    code, out = run_cli(capsys, "--strict", str(archive))
    assert code == 0 and out.startswith(f"{VERDICT_LABELS[True]}    {archive} (")
    assert " infos)" in out.splitlines()[0] and "  info    I003" in out


# --- an ordinary deflated ZIP -----------------------------------------------------------------------------------
def test_deflated_zip_gets_z011_not_false_zip_or_dduf_errors(tmp_path):
    archive = deflated(tmp_path)
    for verify in (False, True):
        report = validate(archive, verify=verify)
        assert not report.valid
        assert {f.code for f in report.errors} == {"Z011"}, report  # was also Z014 x14, Z017, D001
        assert len(report.errors) == 15  # one per entry
        assert {f.code for f in report.infos} <= {"Z018", "I003"}


def test_deflated_zip_still_says_what_else_is_wrong(tmp_path):
    """model_index.json is inflated (within its budget) so the layout rules see the real pipeline: a folder
    missing its config (D006), a component with no folder (D008); compressed weights count as present (no
    D016) and compressed configs are not parsed as garbage (no D007)."""
    folder = tmp_path / "p"
    shutil.copytree(TINY_SD, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["safety_checker"] = ["stable_diffusion", "StableDiffusionSafetyChecker"]
    (folder / "model_index.json").write_text(json.dumps(index))
    archive = deflated(tmp_path, folder, skip=("vae/config.json",))
    codes = {f.code for f in validate(archive).findings}
    assert {"Z011", "D006", "D008"} <= codes and not codes & {"Z014", "Z017", "Z019", "D001", "D002", "D007", "D016"}


def test_stored_entries_of_a_mixed_zip_are_still_checked(tmp_path):
    """Only the compressed entries are set aside: a STORED safetensors file next to them is read and checked
    (its unaligned data is S008), and the data spans of both kinds still tile the file (no Z015/Z016)."""
    out = tmp_path / "mixed.dduf"
    with zipfile.ZipFile(out, "w") as z:
        z.write(TINY_SD / "model_index.json", "model_index.json", compress_type=zipfile.ZIP_DEFLATED)
        for sub in sorted(p for p in TINY_SD.iterdir() if p.is_dir()):
            for f in sorted(sub.iterdir()):
                kind = zipfile.ZIP_STORED if f.suffix == ".safetensors" else zipfile.ZIP_DEFLATED
                z.write(f, f"{sub.name}/{f.name}", compress_type=kind)
    report = validate(out)
    errors = {f.entry for f in report.errors if f.code == "Z011"}
    assert errors and not any(e.endswith(".safetensors") for e in errors)
    assert {f.code for f in report.errors} == {"Z011"}
    assert "S008" in {f.code for f in report.infos}


# --- one label table -------------------------------------------------------------------------------------------
def test_cli_and_serve_page_use_the_same_words(tmp_path, capsys):
    from dduf_plus.serve import page

    code, out = run_cli(capsys, str(HOSTILE / "index-missing.dduf"))
    report = validate(HOSTILE / "index-missing.dduf").as_dict()
    html = page.render_result({"files": [report], "info": None})
    assert out.startswith(f"{VERDICT_LABELS[True]}    ") and "(1 info)" in out
    assert f"<strong>{VERDICT_LABELS[True]}</strong>" in html and "0 errors, 0 warnings, 1 info" in html
    assert "<td>info</td>" in html and "<tr class='info'>" in html
    labels = page.labels()  # what /v1/rules hands app.js
    assert labels["verdicts"] == {"valid": VERDICT_LABELS[True], "invalid": VERDICT_LABELS[False]}
    assert {k: (v["label"], v["plural"]) for k, v in labels["severities"].items()} == {
        s.name: (s.label, s.plural) for s in SEVERITIES.values()}
    js = (Path(page.__file__).parent / "static" / "app.js").read_text()
    assert "labels.verdicts[verdict]" in js and "error(s)" not in js  # no words of its own


@pytest.mark.parametrize("counts, text", [
    ({"error": 2, "warning": 1}, "2 errors, 1 warning"),
    ({"info": 1}, "1 info"),
    ({}, ""),
])
def test_count_text(counts, text):
    assert count_text(counts) == text
    assert count_text({}, all_severities=True) == "0 errors, 0 warnings, 0 infos"
