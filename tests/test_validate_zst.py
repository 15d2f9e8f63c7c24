"""`dduf validate X.dduf.zst`: the archive inside is validated (decompressed into a private temporary file) and
reported under the .zst path; a stream that cannot be decompressed is Z021, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from dduf_plus.cli import main as cli_main
from dduf_plus.errors import DDUFError
from dduf_plus.format.findings import RULES
from dduf_plus.format.validate import validate
from dduf_plus.storage import zst

HOSTILE = ROOT / "fixtures" / "hostile"
CASES = json.loads((HOSTILE / "cases.json").read_text())
MiB = 1 << 20


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Every decompression of this module lands in tmp_path, never in the user's cache."""
    root = tmp_path / "cache"
    monkeypatch.setenv(zst.CACHE_ENV, str(root))
    return root


@pytest.fixture(scope="module")
def multi_frame(packed, tmp_path_factory) -> Path:
    """tiny-sd packed, compressed in 1 MiB frames (several frames plus the seek table)."""
    out = tmp_path_factory.mktemp("zst") / "tiny-sd.dduf.zst"
    result = zst.compress(packed["tiny-sd"], out, frame_size=MiB, quiet=True)
    assert result.frames >= 2
    return out


def _compress(src: Path, dst: Path) -> Path:
    zst.compress(src, dst, quiet=True)
    return dst


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli_main(["validate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_z021_is_appended_to_the_zip_group():
    codes = list(RULES)
    assert codes.index("Z021") == codes.index("Z020") + 1 and codes[-1] == "X000"
    assert RULES["Z021"].severity == "error"


# --- valid streams --------------------------------------------------------------------------------------
def test_valid_zst_passes_and_is_reported_under_its_own_path(multi_frame, packed, cache):
    report = validate(multi_frame, verify=True, strict=True)
    assert report.valid, report
    assert report.path == str(multi_frame)
    plain = validate(packed["tiny-sd"], verify=True)
    assert report.as_dict() == {**plain.as_dict(), "path": str(multi_frame)}
    assert report.bytes_read >= multi_frame.stat().st_size  # the whole stream was read to decompress it
    assert not cache.exists()  # validation decompresses into a private temporary file, never the cache


def test_cli_json_and_human_output(multi_frame, capsys):
    rc, out, err = run_cli(capsys, "--json", "--verify", str(multi_frame))
    assert rc == 0, err
    (entry,) = json.loads(out)["files"]
    assert entry == {"schema_version": 1, "path": str(multi_frame), "valid": True, "errors": [], "warnings": [],
                     "infos": []}
    rc, out, _ = run_cli(capsys, str(multi_frame))
    assert rc == 0 and out.startswith(f"VALID    {multi_frame}")


def test_relative_path_is_kept(multi_frame, monkeypatch):
    monkeypatch.chdir(multi_frame.parent)
    report = validate(multi_frame.name)
    assert report.valid and report.path == multi_frame.name


# --- broken streams: Z021 -------------------------------------------------------------------------------
def _broken(multi_frame: Path, tmp_path: Path) -> dict[str, Path]:
    raw = multi_frame.read_bytes()
    fd = os.open(multi_frame, os.O_RDONLY)
    try:
        frames = [f for f in zst.read_layout(fd, len(raw), str(multi_frame)).frames if f.size]
    finally:
        os.close(fd)
    frame = frames[1]
    flip = frame.offset + frame.compressed_size // 2
    variants = {
        "truncated-half": raw[: len(raw) // 2],
        "truncated-tail": raw[:-3],  # inside the seek table's footer
        "truncated-at-frame": raw[: frames[1].offset],  # on a frame boundary
        "corrupted-frame": raw[:flip] + bytes([raw[flip] ^ 0x40]) + raw[flip + 1 :],
        "garbage": b"this is not zstd at all\n" * 64,
        "empty": b"",
        "plain-zip": (HOSTILE / "valid.dduf").read_bytes(),  # a .dduf renamed .dduf.zst
    }
    out = {}
    for name, data in variants.items():
        path = tmp_path / f"{name}.dduf.zst"
        path.write_bytes(data)
        out[name] = path
    return out


def test_broken_streams_are_z021(multi_frame, tmp_path, cache):
    for name, path in _broken(multi_frame, tmp_path).items():
        report = validate(path)
        assert not report.valid, name
        assert report.codes == ["Z021"], (name, report)
        finding = report.errors[0]
        assert finding.entry is None and str(path) in finding.message, finding
        assert str(cache) not in finding.message
    assert not list((cache / "zst").glob("*.dduf"))  # nothing half-written was left in the cache


def test_a_stream_is_named_as_the_caller_named_it(multi_frame, tmp_path, cache, monkeypatch):
    """Every finding of a broken or over-budget stream names the path as given (relative here), never the
    resolved one: the decompression reports under that name, so nothing rewrites a message afterwards."""
    broken = _broken(multi_frame, tmp_path)
    monkeypatch.chdir(tmp_path)
    for path in (broken["truncated-half"], broken["corrupted-frame"], multi_frame):
        given = os.path.relpath(path)
        report = validate(given, max_decompressed=1 << 10 if path == multi_frame else None)
        assert report.codes in (["Z021"], ["Z022"]), report
        message = report.errors[0].message
        assert message.startswith(given + ":") and str(tmp_path) not in message, message


def test_broken_streams_exit_1_with_json(multi_frame, tmp_path, capsys):
    broken = _broken(multi_frame, tmp_path)
    rc, out, err = run_cli(capsys, "--json", "--verify", *map(str, broken.values()), str(multi_frame))
    assert rc == 1, err
    files = json.loads(out)["files"]
    assert [f["path"] for f in files] == [*map(str, broken.values()), str(multi_frame)]
    assert [f["valid"] for f in files] == [False] * len(broken) + [True]
    assert all([e["code"] for e in f["errors"]] == ["Z021"] for f in files[:-1])


def test_cli_subprocess_no_traceback(multi_frame, tmp_path):
    broken = _broken(multi_frame, tmp_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", **{zst.CACHE_ENV: str(tmp_path / "sub-cache")})
    out = subprocess.run([sys.executable, "-m", "dduf_plus.cli", "validate", str(broken["corrupted-frame"]),
                          str(broken["garbage"])], capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert out.stdout.count("error   Z021") == 2 and "checksum" in out.stdout


def test_missing_zstandard_is_a_finding_with_the_install_command(multi_frame, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "zstandard", None)  # `import zstandard` now fails
    report = validate(multi_frame)
    assert report.codes == ["Z021"] and "pip install zstandard" in report.errors[0].message
    rc, out, _ = run_cli(capsys, str(multi_frame))
    assert rc == 1 and "pip install zstandard" in out


def test_missing_file_and_urls_are_io_errors(tmp_path, capsys):
    with pytest.raises(DDUFError, match="cannot open"):
        validate(tmp_path / "missing.dduf.zst")
    with pytest.raises(DDUFError, match="local file"):
        validate("https://example.invalid/model.dduf.zst")
    rc, out, err = run_cli(capsys, "--json", str(tmp_path / "missing.dduf.zst"))
    assert rc == 2 and "io_error" in json.loads(out)["files"][0]
    os.mkfifo(tmp_path / "fifo.dduf.zst")  # never blocks waiting for a writer
    rc, _out, err = run_cli(capsys, str(tmp_path / "fifo.dduf.zst"))
    assert rc == 2 and "not a regular file" in err


# --- hostile archives inside a valid stream -------------------------------------------------------------
HOSTILE_INSIDE = ["duplicate-name.dduf", "polyglot-suffix.dduf", "pickle-entry.dduf", "path-traversal.dduf",
                  "st-hole.dduf", "index-wrong-crc.dduf", "truncated.dduf"]


@pytest.mark.parametrize("case", HOSTILE_INSIDE)
def test_hostile_archive_inside_reports_its_own_code(case, tmp_path, cache):
    path = _compress(HOSTILE / case, tmp_path / f"{case}.zst")
    report = validate(path)
    assert CASES[case]["code"] in report.codes and "Z021" not in report.codes, report
    assert not report.valid and report.path == str(path)
    assert all(str(cache) not in f.message for f in report.errors + report.warnings)


def test_verify_only_damage_inside_needs_verify(tmp_path, capsys):
    path = _compress(HOSTILE / "crc-mismatch.dduf", tmp_path / "crc.dduf.zst")
    assert validate(path).valid  # the stream itself is intact: only --verify sees the damaged entry
    rc, out, _ = run_cli(capsys, "--json", "--verify", str(path))
    assert rc == 1 and "H001" in [e["code"] for e in json.loads(out)["files"][0]["errors"]]


def test_warnings_inside_and_strict(tmp_path):
    path = _compress(HOSTILE / "no-zip64.dduf", tmp_path / "no-zip64.dduf.zst")
    assert validate(path).valid and "Z018" in validate(path).codes
    assert validate(path, strict=True).valid  # Z018 is an info: --strict never promotes infos
    path = _compress(HOSTILE / "reference-without-source.dduf", tmp_path / "no-source.dduf.zst")
    assert validate(path).valid and not validate(path, strict=True).valid  # R003, a warning


# --- import weight --------------------------------------------------------------------------------------
def test_plain_validation_never_imports_zstandard_and_zst_needs_no_torch(multi_frame, tmp_path):
    code = ("import sys; from dduf_plus.cli import main; rc = main(['validate', '--verify', sys.argv[1]]); "
            "heavy = [m for m in ('torch', 'diffusers', 'transformers', 'numpy', 'fsspec', 'zstandard') "
            "if m in sys.modules]; print(rc, heavy)")
    env = dict(os.environ, **{zst.CACHE_ENV: str(tmp_path / "sub-cache")})
    plain = subprocess.run([sys.executable, "-c", code, str(HOSTILE / "valid.dduf")], capture_output=True,
                           text=True, cwd=ROOT, env=env, check=True)
    assert plain.stdout.strip().splitlines()[-1] == "0 []", plain
    packed = subprocess.run([sys.executable, "-c", code, str(multi_frame)], capture_output=True, text=True,
                            cwd=ROOT, env=env, check=True)
    assert packed.stdout.strip().splitlines()[-1] == "0 ['zstandard']", packed
