"""validate(): the report, every rule it adds to the reader's, verify, strict, internal-error containment,
I/O errors, and the `dduf validate` command (exit codes, JSON shape, human output, --jobs)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest

from conftest import HOSTILE, load_make_hostile
from dduf_plus.cli import main as cli_main
from dduf_plus.errors import DDUFError
from dduf_plus.format import spec
from dduf_plus.format import validate as validate_module
from dduf_plus.format.findings import RULES
from dduf_plus.format.validate import ValidationReport, validate
from dduf_plus.storage.source import LocalSource

ROOT = Path(__file__).resolve().parent.parent


mh = load_make_hostile()


def build(tmp_path: Path, name: str = "a.dduf", entries: dict | None = None, **kwargs) -> Path:
    return mh.write_valid(tmp_path / name, entries, **kwargs)


def codes(report: ValidationReport) -> set[str]:
    return set(report.codes)


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


# --- the report --------------------------------------------------------------------------------------
def test_valid_archive_is_clean_structurally_and_verified(tmp_path):
    path = build(tmp_path)
    for verify in (False, True):
        report = validate(path, verify=verify, strict=True)
        assert report.valid and report.errors == () and report.warnings == (), report
    structural = validate(path)
    assert 0 < structural.bytes_read <= path.stat().st_size
    assert validate(path, verify=True).bytes_read > structural.bytes_read


def test_seconds_is_the_time_the_check_took(tmp_path, monkeypatch):
    """On a clock the test drives (each reading 1.5 s later than the one before): ``seconds`` is the span from
    the first reading to the last, whatever the machine's load."""
    import dduf_plus.format.validate as validate_module

    path = build(tmp_path)
    ticks = iter(range(1000))
    monkeypatch.setattr(validate_module.time, "perf_counter", lambda: 1.5 * next(ticks))
    report = validate(path)
    assert report.seconds == 1.5 * (next(ticks) - 1)  # started at 0; the last reading was the one before this


def test_report_shape_and_immutability(tmp_path):
    path = build(tmp_path, entries=mh.base_entries() | {"unet/config.json": b"[1]"})
    report = validate(path)
    d = report.as_dict()
    assert list(d) == ["schema_version", "path", "valid", "errors", "warnings", "infos"]
    assert d["path"] == str(path) and d["valid"] is False
    assert d["errors"] == [{"code": "D007", "severity": "error", "entry": "unet/config.json",
                            "message": d["errors"][0]["message"], "offset": d["errors"][0]["offset"]}]
    assert isinstance(d["errors"][0]["offset"], int)  # the config's first byte
    assert "not an object" in d["errors"][0]["message"]
    json.dumps(d)
    with pytest.raises(AttributeError):
        report.valid = True  # type: ignore[misc]
    assert str(report).startswith("INVALID ")


def test_structural_validation_reads_only_headers(tmp_path):
    weights = mh.safetensors({"w": ("F16", [1024, 1024], os.urandom(2 << 20))}, {"format": "pt"})
    path = build(tmp_path, entries=mh.base_entries() | {"unet/diffusion_pytorch_model.safetensors": weights})
    report = validate(path)
    assert report.valid, report
    assert report.bytes_read < 16 << 10, report.bytes_read  # of a 2 MB archive


def test_strict_turns_warnings_into_errors(tmp_path):
    mi = dict(mh.MODEL_INDEX, vae=["diffusers", "AutoencoderKL"])
    path = build(tmp_path, model_index=mi)
    lenient, strict = validate(path), validate(path, strict=True)
    assert lenient.valid and [f.code for f in lenient.warnings] == ["D008"]
    assert not strict.valid and [f.code for f in strict.errors] == ["D008"] and strict.warnings == ()
    assert strict.errors[0].severity == "error"


# --- rules validate adds -----------------------------------------------------------------------------
@pytest.mark.parametrize("blob", [b"{broken", b"\xff\xfe{}", b'"a string"'])
def test_D007_configs_must_parse_as_objects(tmp_path, blob):
    path = build(tmp_path, entries=mh.base_entries() | {"scheduler/scheduler_config.json": blob})
    report = validate(path)
    assert "D007" in codes(report) and not report.valid


def test_D007_large_json_only_with_verify(tmp_path):
    big = b'{"a": ' + b" " * (validate_module.STRUCTURAL_JSON_LIMIT + 1) + b"["  # broken, and too big for structural
    path = build(tmp_path, entries=mh.base_entries() | {"tokenizer/vocab.json": big})
    assert validate(path).valid
    assert "D007" in codes(validate(path, verify=True))


def test_D011_shard_index(tmp_path):
    ok = {"weight_map": {"bias": "diffusion_pytorch_model.safetensors", "weight": "diffusion_pytorch_model.safetensors"}}
    name = "unet/diffusion_pytorch_model.safetensors.index.json"
    assert validate(build(tmp_path, "ok.dduf", mh.base_entries() | {name: json.dumps(ok).encode()})).valid
    for bad in ({"weight_map": {"w": "../x.safetensors"}}, {"weight_map": [1]}, {"weight_map": {"w": 3}}):
        report = validate(build(tmp_path, "bad.dduf", mh.base_entries() | {name: json.dumps(bad).encode()}))
        assert "D011" in codes(report), bad


GOOD_REF = {"pretrained_model_name_or_path": "org/base", "subfolder": "vae", "revision": None,
            "files": {"config.json": {"size": 2, "sha256": "a" * 64},
                      "diffusion_pytorch_model.safetensors": {"size": 10, "sha256": "b" * 64}}}


@pytest.mark.parametrize("ref, ok", [
    (GOOD_REF, True),
    (GOOD_REF | {"extra_key": [1, 2]}, True),  # unknown keys are for later versions
    ([1], False),
    ({k: v for k, v in GOOD_REF.items() if k != "pretrained_model_name_or_path"}, False),
    (GOOD_REF | {"pretrained_model_name_or_path": 3}, False),
    (GOOD_REF | {"revision": 7}, False),
    (GOOD_REF | {"files": {}}, False),
    (GOOD_REF | {"files": []}, False),
    (GOOD_REF | {"files": {"config.json": {"size": "2", "sha256": "a" * 64}}}, False),
    (GOOD_REF | {"files": {"config.json": {"size": True, "sha256": "a" * 64}}}, False),
    (GOOD_REF | {"files": {"config.json": {"size": -1, "sha256": "a" * 64}}}, False),
    (GOOD_REF | {"files": {"config.json": {"size": 2, "sha256": "A" * 64}}}, False),
    (GOOD_REF | {"files": {"config.json": {"size": 2}}}, False),
    (GOOD_REF | {"files": {"sub/config.json": {"size": 2, "sha256": "a" * 64}}}, False),
    (GOOD_REF | {"files": {"..": {"size": 2, "sha256": "a" * 64}}}, False),
    (GOOD_REF | {"files": {"config.json": {"size": 2, "sha256": "a" * 64, "git_sha1": "xyz"}}}, False),
    # small non-LFS Hub files are known by their git blob id only (what `pack --ref org/repo` records)
    (GOOD_REF | {"files": {"config.json": {"size": 2, "git_sha1": "c" * 40}}}, True),
    (GOOD_REF | {"files": {"config.json": {"size": 2, "git_sha1": None}}}, False),
    # no source (`pack --exclude` without --ref): valid, with the R003 warning (tested below)
    (GOOD_REF | {"pretrained_model_name_or_path": None}, True),
    (GOOD_REF | {"pretrained_model_name_or_path": None, "files": {}}, True),
    (GOOD_REF | {"pretrained_model_name_or_path": ""}, False),
])
def test_R001_reference_shape(tmp_path, ref, ok):
    mi = dict(mh.MODEL_INDEX, vae=["diffusers", "AutoencoderKL"], **{spec.REFERENCES_KEY: {"vae": ref}})
    report = validate(build(tmp_path, model_index=mi))
    assert report.valid is ok, report
    assert ("R001" in codes(report)) is not ok
    assert ("R003" in codes(report)) is (ok and isinstance(ref, dict) and ref["pretrained_model_name_or_path"] is None)


def test_our_own_partial_packs_validate(tmp_path, hf_env):
    """What `dduf pack --exclude` writes is valid: without --ref it warns R003 (no source), nothing else."""
    from conftest import PIPELINES
    from dduf_plus.packing import pack

    out, _ = pack(PIPELINES / "tiny-sd", tmp_path / "p.dduf", exclude=["text_encoder"], quiet=True)
    report = validate(out.path, verify=True)
    assert report.valid, report
    assert codes(report) == {"R003"}


def test_R001_reference_to_unknown_component_and_non_object(tmp_path):
    mi = dict(mh.MODEL_INDEX, **{spec.REFERENCES_KEY: {"ghost": GOOD_REF}})
    assert "R001" in codes(validate(build(tmp_path, "a.dduf", model_index=mi)))
    mi = dict(mh.MODEL_INDEX, **{spec.REFERENCES_KEY: ["vae"]})
    assert "R001" in codes(validate(build(tmp_path, "b.dduf", model_index=mi)))


def _rewrite_index(fn):
    def rewrite(index: dict) -> dict:
        fn(index)
        return index
    return rewrite


@pytest.mark.parametrize("edit, code", [
    (lambda i: i["files"]["unet/config.json"].update(crc32="zz"), "I001"),
    (lambda i: i["files"]["unet/config.json"].update(sha256=5), "I001"),
    (lambda i: i["files"]["unet/config.json"].update(crc32="00000000"), "I002"),
    (lambda i: i["files"]["unet/diffusion_pytorch_model.safetensors"].update(tensor_data_offset=1), "I002"),
    (lambda i: i["components"].pop("scheduler"), "I002"),
    (lambda i: i["components"]["unet"].update(files=["unet/config.json"]), "I002"),
    (lambda i: i["files"]["unet/config.json"].update(size=True), "I002"),
    (lambda i: i.update(files=[]), "I001"),
    (lambda i: i.update(format_version=2, files=[]), "I001"),  # newer versions still need a files object
    (lambda i: i.update(format_version=2, components=None), None),  # the rest of a newer version is ignored
])
def test_index_agreement(tmp_path, edit, code):
    report = validate(build(tmp_path, index=_rewrite_index(edit)))
    if code is None:
        assert report.valid, report
    else:
        assert code in codes(report) and not report.valid, report


def test_index_reference_must_match_model_index(tmp_path):
    mi = dict(mh.MODEL_INDEX, vae=["diffusers", "AutoencoderKL"], **{spec.REFERENCES_KEY: {"vae": GOOD_REF}})
    assert validate(build(tmp_path, "ok.dduf", model_index=mi)).valid
    edited = _rewrite_index(lambda i: i["components"]["vae"].update(external={"other": 1}))
    assert "I002" in codes(validate(build(tmp_path, "bad.dduf", model_index=mi, index=edited)))


# --- verify -------------------------------------------------------------------------------------------
def test_verify_finds_crc_and_sha256_mismatches(tmp_path):
    path = build(tmp_path)
    lay = mh.Layout(path.read_bytes())
    flip(path, lay.data_offset("tokenizer/merges.txt"))
    assert validate(path).valid  # invisible without hashing
    report = validate(path, verify=True)
    assert {f.code for f in report.errors} == {"H001", "H002"}
    assert all(f.entry == "tokenizer/merges.txt" for f in report.errors)


def test_verify_tensor_data_and_foreign_archive(tmp_path):
    # no index: only CRC-32 can be checked, and is
    path = build(tmp_path, index=False)
    lay = mh.Layout(path.read_bytes())
    name = "unet/diffusion_pytorch_model.safetensors"
    flip(path, lay.data_offset(name) + lay.size(name) - 1)
    report = validate(path, verify=True)
    assert [f.code for f in report.errors] == ["H001"] and report.errors[0].entry == name


def test_verify_many_entries_in_parallel(tmp_path):
    before = threading.active_count()  # daemon threads of earlier tests (servers, clusters) may still be alive
    entries = mh.base_entries() | {f"tokenizer/part{i}.txt": os.urandom(50_000 + i) for i in range(12)}
    path = build(tmp_path, entries=entries)
    assert validate(path, verify=True).valid
    lay = mh.Layout(path.read_bytes())
    for i in (3, 7):
        flip(path, lay.data_offset(f"tokenizer/part{i}.txt") + 100)
    report = validate(path, verify=True)
    assert sorted((f.code, f.entry) for f in report.errors) == [
        ("H001", "tokenizer/part3.txt"), ("H001", "tokenizer/part7.txt"),
        ("H002", "tokenizer/part3.txt"), ("H002", "tokenizer/part7.txt")]
    assert threading.active_count() <= before  # the hashing pool is gone


def test_verify_hashes_of_a_local_file_match_hashlib(tmp_path):
    import hashlib

    path = build(tmp_path)
    with LocalSource(path) as src:
        from dduf_plus.format.archive import DDUFArchive

        archive = DDUFArchive(src, check=False)
        entries = [e for e in archive.entries.values() if e.length]
        got = validate_module._hash_local(src.fd, entries, workers=2)
        data = path.read_bytes()
        for e in entries:
            chunk = data[e.offset : e.offset + e.length]
            assert got[e.name][0] == zlib.crc32(chunk) == e.crc32
            assert e.sha256 is None or got[e.name][1] == hashlib.sha256(chunk).hexdigest() == e.sha256


# --- containment: bugs become X000, I/O failures become DDUFError --------------------------------------
def test_internal_error_in_a_rule_becomes_X000(tmp_path, monkeypatch):
    def boom(*args):
        raise KeyError("bug")

    monkeypatch.setattr(validate_module, "_check_index", boom)
    report = validate(build(tmp_path))
    assert [f.code for f in report.errors] == ["X000"] and "KeyError" in report.errors[0].message


def test_internal_error_in_the_reader_becomes_X000(tmp_path, monkeypatch):
    monkeypatch.setattr(validate_module, "DDUFArchive", lambda *a, **k: [][1])
    report = validate(build(tmp_path))
    assert not report.valid and report.errors[0].code == "X000" and "IndexError" in report.errors[0].message


def test_recursion_is_contained(tmp_path):
    deep = b"[" * 100_000 + b"]" * 100_000
    path = build(tmp_path, entries=mh.base_entries() | {"unet/config.json": deep},
                 model_index_bytes=b'{"a": ' + deep + b"}")
    report = validate(path)
    # refused on the bytes, before any parser recurses (D013: nesting over spec.MAX_JSON_DEPTH)
    deep_entries = {f.entry for f in report.errors if f.code == "D013"}
    assert {"model_index.json", "unet/config.json"} <= deep_entries and "X000" not in codes(report)


def test_out_of_bounds_read_is_a_bug_not_io(tmp_path, monkeypatch):
    def reads_past_the_end(archive, source, verify):
        source.read_at(source.size - 4, 8)

    monkeypatch.setattr(validate_module, "_check_index", reads_past_the_end)
    report = validate(build(tmp_path))
    assert report.errors[0].code == "X000"


class FlakySource:
    """A source whose reads fail after ``ok_reads`` reads, as a dying disk or network would."""

    def __init__(self, path: Path, ok_reads: int):
        self.inner = LocalSource(path)
        self.name, self.size, self.bytes_read = str(path), self.inner.size, 0
        self.left = ok_reads

    def read_at(self, offset: int, length: int) -> bytes:
        self.left -= 1
        if self.left < 0:
            raise DDUFError(f"{self.name}: read failed at {offset}: Input/output error")
        return self.inner.read_at(offset, length)

    def close(self) -> None:
        self.inner.close()


def test_io_failure_raises_ddferror_not_a_verdict(tmp_path):
    path = build(tmp_path)
    for ok_reads in (0, 3, 8):
        with pytest.raises(DDUFError, match="Input/output error"):
            validate(FlakySource(path, ok_reads))


def test_missing_directory_and_fifo_are_io_errors(tmp_path):
    with pytest.raises(DDUFError, match="No such file"):
        validate(tmp_path / "missing.dduf")
    with pytest.raises(DDUFError, match="not a regular file"):
        validate(tmp_path)
    fifo = tmp_path / "pipe.dduf"
    os.mkfifo(fifo)
    with pytest.raises(DDUFError, match="not a regular file"):  # and does not wait for a writer
        validate(fifo)


@pytest.mark.parametrize("data", [b"", b"PK", b"\0" * 100, b"PK\x05\x06" + b"\0" * 18])
def test_tiny_files(tmp_path, data):
    (tmp_path / "x.dduf").write_bytes(data)
    report = validate(tmp_path / "x.dduf", verify=True)
    assert not report.valid and report.errors[0].code in ("Z001", "D001")


def test_entries_past_the_file_are_never_read(tmp_path):
    # a central record claiming more data than the file has: reported (Z017), not an out-of-bounds read
    path = build(tmp_path)
    lay = mh.Layout(path.read_bytes())
    name = "model_index.json"
    big = struct.pack("<QQ", 1 << 33, 1 << 33)
    n = len(name)
    path.write_bytes(mh.patched(path.read_bytes(), (lay.local[name] + 30 + n + 4, big),
                                (lay.central[name] + 46 + n + 4, big)))
    report = validate(path, verify=True)
    assert "Z017" in codes(report) and "X000" not in codes(report)


def test_rule_table_has_every_code_once_and_X000_last():
    assert list(RULES)[-1] == "X000"
    assert all(rule.severity in ("error", "warning", "info") for rule in RULES.values())


# --- import weight ----------------------------------------------------------------------------------
def test_format_layer_and_cli_import_no_torch(tmp_path):
    path = build(tmp_path)
    code = ("import sys; from dduf_plus.cli import main; rc = main(['validate', '--verify', sys.argv[1]]); "
            "heavy = [m for m in ('torch', 'diffusers', 'transformers', 'numpy', 'fsspec') if m in sys.modules]; "
            "print(rc, heavy)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip().splitlines()[-1] == "0 []", out


# --- the command ------------------------------------------------------------------------------------
def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli_main(["validate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_exit_codes(tmp_path, capsys):
    good = build(tmp_path, "good.dduf")
    warn = build(tmp_path, "warn.dduf", index=False)
    bad = HOSTILE / "duplicate-name.dduf"
    assert run_cli(capsys, str(good))[0] == 0
    assert run_cli(capsys, str(good), str(warn))[0] == 0
    assert run_cli(capsys, "--strict", str(warn))[0] == 0  # I003 is an info: --strict never promotes infos
    assert run_cli(capsys, "--strict", str(HOSTILE / "reference-without-source.dduf"))[0] == 1  # R003: a warning
    assert run_cli(capsys, str(good), str(bad))[0] == 1
    rc, _, err = run_cli(capsys, str(good), str(tmp_path / "missing.dduf"), str(bad))
    assert rc == 2 and "missing.dduf" in err
    assert run_cli(capsys)[0] == 2  # no FILE
    assert run_cli(capsys, "--jobs", "0", str(good))[0] == 2
    assert run_cli(capsys, "--bogus", str(good))[0] == 2


def test_cli_human_output(tmp_path, capsys):
    good = build(tmp_path, "good.dduf")
    warn = build(tmp_path, "warn.dduf", index=False)
    bad = HOSTILE / "st-hole.dduf"
    rc, out, _ = run_cli(capsys, str(good), str(warn), str(bad))
    lines = out.splitlines()
    assert rc == 1
    assert lines[0] == f"VALID    {good}"  # the serve page's words (findings.VERDICT_LABELS)
    assert lines[1] == f"VALID    {warn} (1 info)" and lines[2].split()[:2] == ["info", "I003"]
    assert lines[3].startswith(f"INVALID  {bad} (1 error)")
    assert lines[4].split()[:3] == ["error", "S006", "unet/diffusion_pytorch_model.safetensors:b:"]
    rc, out, _ = run_cli(capsys, "--quiet", str(good), str(warn), str(bad))
    assert out.splitlines() == [f"INVALID  {bad} (1 error)", lines[4]]


def test_cli_json(tmp_path, capsys):
    good = build(tmp_path, "good.dduf")
    bad = HOSTILE / "crc-mismatch.dduf"
    rc, out, _ = run_cli(capsys, "--json", "--verify", str(good), str(bad), str(tmp_path / "nope.dduf"))
    assert rc == 2
    doc = json.loads(out)
    assert list(doc) == ["schema_version", "files"] and [f["path"] for f in doc["files"]] == [str(good), str(bad), str(tmp_path / "nope.dduf")]
    first, second, third = doc["files"]
    assert first == {"schema_version": 1, "path": str(good), "valid": True, "errors": [], "warnings": [], "infos": []}
    assert second["valid"] is False and {e["code"] for e in second["errors"]} == {"H001", "H002"}
    assert all(set(e) == {"code", "severity", "entry", "message", "offset"} for e in second["errors"])
    assert third["valid"] is False and "No such file" in third["io_error"]
    rc, out, _ = run_cli(capsys, "--json", str(good))
    assert rc == 0 and json.loads(out)["files"][0]["valid"] is True


def test_cli_jobs_in_parallel_processes_keeps_order(tmp_path, capsys):
    files = [str(HOSTILE / f) for f in sorted(json.loads((HOSTILE / "cases.json").read_text()))[:12]]
    files.append(str(build(tmp_path)))
    rc1, out1, _ = run_cli(capsys, "--json", *files)
    rc2, out2, _ = run_cli(capsys, "--json", "--jobs", "3", *files)
    assert rc1 == rc2 == 1
    assert json.loads(out1) == json.loads(out2)


def test_cli_subprocess(tmp_path):
    good = build(tmp_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "dduf_plus.cli", "validate", "--json", str(good)],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["files"][0]["valid"] is True
    out = subprocess.run([sys.executable, "-m", "dduf_plus.cli", "validate", str(HOSTILE / "pickle-entry.dduf")],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 1 and "D003" in out.stdout


def test_every_rule_is_documented():
    doc = (ROOT / "docs" / "validation.md").read_text()
    rows = {line.split("|")[1].strip() for line in doc.splitlines() if line.startswith("| ") and line.count("|") > 6}
    assert set(RULES) <= rows, set(RULES) - rows


def test_bytes_in_memory_validate_and_open():
    """An upload still in memory: BytesSource is a ByteSource over bytes."""
    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.storage.source import BytesSource

    data = (HOSTILE / "valid.dduf").read_bytes()
    report = validate(BytesSource(data, "upload.dduf"))
    assert report.valid and report.path == "upload.dduf" and 0 < report.bytes_read < len(data)
    with DDUFArchive(BytesSource(data)) as archive:
        assert "model_index.json" in archive
    assert not validate(BytesSource(data[:-30], "cut.dduf")).valid
    with pytest.raises(DDUFError, match="outside the data"):
        BytesSource(b"abc").read_at(2, 5)
