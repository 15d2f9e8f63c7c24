"""`dduf pack | unpack | info`: exit codes, JSON shape, refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import pytest

from conftest import PIPELINES
from dduf_plus.cli import main
from dduf_plus.errors import DDUFFormatError
from dduf_plus.format.unpack import safe_target


def dduf(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dduf_plus.cli", *args], capture_output=True, text=True)


def test_pack_info_unpack_roundtrip(tmp_path, capsys):
    out = tmp_path / "a.dduf"
    assert main(["pack", str(PIPELINES / "tiny-sd"), "-o", str(out), "--quiet"]) == 0
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    unet = info["components"]["unet"]
    assert set(unet) >= {"library", "class", "dtype", "dtypes", "parameters", "bytes", "external"}
    assert (unet["library"], unet["class"], unet["dtype"], unet["external"]) == (
        "diffusers", "UNet2DConditionModel", "float16", False)
    assert set(unet["dtypes"]) == {"float16"} and unet["parameters"] > 0 and unet["bytes"] > 0
    assert info["components"]["text_encoder"]["dtype"] == "float32"
    assert "safety_checker" in info["null_components"]
    assert main(["unpack", str(out), "-o", str(tmp_path / "u"), "--quiet"]) == 0
    for f in (PIPELINES / "tiny-sd").rglob("*"):
        rel = f.relative_to(PIPELINES / "tiny-sd")
        if f.is_file() and rel.name != "README.md" and ".fp16." not in rel.name:
            assert (tmp_path / "u" / rel).read_bytes() == f.read_bytes(), rel
    # refuses to overwrite without --force
    assert main(["unpack", str(out), "-o", str(tmp_path / "u"), "--quiet"]) == 2  # usage: exists, no --force
    assert main(["unpack", str(out), "-o", str(tmp_path / "u"), "--quiet", "--force"]) == 0


def test_info_on_folder_matches_archive(tmp_path, capsys):
    out = tmp_path / "d.dduf"
    main(["pack", str(PIPELINES / "tiny-dit"), "-o", str(out), "--quiet"])
    capsys.readouterr()
    main(["info", str(out), "--json"])
    archive = json.loads(capsys.readouterr().out)["components"]
    main(["info", str(PIPELINES / "tiny-dit"), "--json"])
    folder = json.loads(capsys.readouterr().out)["components"]
    for name in archive:
        for key in ("library", "class", "dtype", "dtypes", "parameters", "bytes"):
            assert archive[name][key] == folder[name][key], (name, key)
    assert archive["transformer"]["dtype"] == "bfloat16"


def test_exit_codes_and_messages(tmp_path):
    usage = dduf("pack")
    assert usage.returncode == 2
    assert dduf().returncode == 2
    missing = dduf("info", str(tmp_path / "nope.dduf"))
    assert missing.returncode == 2 and "cannot open" in missing.stderr and "Traceback" not in missing.stderr  # I/O: 2
    bad = tmp_path / "bad.dduf"
    bad.write_bytes(b"garbage" * 100)
    invalid = dduf("info", str(bad))
    assert invalid.returncode == 1 and "Z001" in invalid.stderr and "Traceback" not in invalid.stderr
    sub = tmp_path / "src"
    sub.mkdir()
    refused = dduf("pack", str(sub), "-o", str(tmp_path / "x.dduf"))
    assert refused.returncode == 1 and "no model_index.json" in refused.stderr


def test_pack_reports_skipped_files(tmp_path):
    result = dduf("pack", str(PIPELINES / "tiny-sd"), "-o", str(tmp_path / "a.dduf"))
    assert result.returncode == 0, result.stderr
    assert "skipped README.md" in result.stdout
    assert "wrote" in result.stdout


def test_unpack_refuses_names_that_escape(tmp_path):
    evil = tmp_path / "evil.dduf"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("model_index.json", "{}")
        zf.writestr("../escaped.json", "{}")
    out = tmp_path / "target"
    assert main(["unpack", str(evil), "-o", str(out), "--quiet"]) == 1  # validation refuses it
    assert main(["unpack", str(evil), "-o", str(out), "--quiet", "--no-check"]) == 0
    assert not (tmp_path / "escaped.json").exists()
    for name in ("../x.json", "/etc/x.json", "a/../../x.json", "a\\..\\x.json", "C:/x.json", ""):
        with pytest.raises(DDUFFormatError, match="escape"):
            safe_target(out, name)
