"""`dduf validate` as a model hub runs it on every upload: one documented JSON schema (versioned, a severity, a
rule code, an entry and a byte offset per finding), valid JSON on stdout and nothing else, the same bytes on
every run; adversarial uploads each answered with a clean report in a bounded number of reads and bytes
(counted, not timed); remote sources that lie; and what validate accepts, load_dduf loads.

Each test here was written for a finding of the hub review (docs/validation.md, "JSON report schema" and
"Hub review"); the ones marked *was:* failed on the code before the fix."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from conftest import HOSTILE, ROOT, load_make_hostile
from dduf_plus.format import spec
from dduf_plus.format.validate import FINDING_FIELDS, REPORT_SCHEMA_VERSION, json_text, validate
from dduf_plus.storage.source import BytesSource

mh = load_make_hostile()
U32 = 0xFFFFFFFF
CASES = json.loads((HOSTILE / "cases.json").read_text())


class CountingSource(BytesSource):
    """Bytes in memory that count the reads made of them and the bytes those reads return."""

    def __init__(self, data: bytes, name: str = "upload.dduf"):
        super().__init__(data, name)
        self.reads = 0
        self.returned = 0

    def read_at(self, offset: int, length: int) -> bytes:
        self.reads += 1
        self.returned += length
        return super().read_at(offset, length)


def checked(data: bytes, *, max_reads: int = 200, max_bytes: int | None = None) -> Any:
    """validate() of ``data`` from memory: a clean report (no X000, verdict = no errors) within a number of
    reads and bytes read (default: the file's size, plus the end record's search window when the last 22
    bytes are no end record: nothing else is read twice)."""
    source = CountingSource(bytes(data))
    report = validate(source)
    assert "X000" not in report.codes and report.valid == (not report.errors), report
    assert source.reads <= max_reads, (source.reads, report.codes)
    limit = len(data) + spec.EOCD_SIZE + spec.MAX_COMMENT if max_bytes is None else max_bytes
    assert source.returned <= limit, (source.returned, len(data))
    return report


def run_cli(*argv: str | bytes, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dduf_plus.cli", *argv], capture_output=True, timeout=120,
                          env={**os.environ, **(env or {})})


def strict_json(raw: bytes) -> Any:
    """What a strict parser (serde_json, Go) accepts: UTF-8 text, and no lone surrogate in any string."""
    doc = json.loads(raw.decode("utf-8"))

    def walk(value: Any) -> None:
        if isinstance(value, str):
            value.encode("utf-8")  # a lone surrogate raises here
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k)
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(doc)
    return doc


# --- the JSON report ------------------------------------------------------------------------------------------
def documented_schema() -> dict[str, dict[str, str]]:
    """docs/validation.md's "JSON report schema" tables: {table: {field: type}}."""
    text = (ROOT / "docs" / "validation.md").read_text(encoding="utf-8")
    section = text.split("## JSON report schema", 1)[1].split("\n## ", 1)[0]
    tables: dict[str, dict[str, str]] = {}
    current = None
    for line in section.splitlines():
        heading = re.match(r"\*\*(\w+)\*\*", line)
        if heading:
            current = heading.group(1)
            tables[current] = {}
        row = re.match(r"\| `(\w+)` \| `([^`]+)` \|", line)
        if row and current:
            tables[current][row.group(1)] = row.group(2).replace("\\|", "|")
    return tables


TYPES = {"int": int, "bool": bool, "string": str, "null": type(None), "list": list}


def _conforms(value: Any, documented: str) -> bool:
    return any(isinstance(value, TYPES[t]) and not (t == "int" and isinstance(value, bool))
               for t in documented.split(" | "))


def test_documented_schema_is_what_the_code_emits(tmp_path: Path) -> None:
    """The fields docs/validation.md lists (names, types) are exactly what --json emits, for a valid archive, an
    invalid one with ZIP offsets and an unreadable one. *was:* no schema version, no severity, no offsets,
    and no one place that said so."""
    schema = documented_schema()
    assert set(schema) == {"document", "report", "finding"}, schema
    assert tuple(schema["finding"]) == FINDING_FIELDS
    good = mh.write_valid(tmp_path / "good.dduf")
    got = run_cli("validate", "--json", str(good), str(HOSTILE / "overlapping-entries.dduf"),
                  str(HOSTILE / "index-missing.dduf"), str(tmp_path / "missing.dduf"))
    assert got.returncode == 2, got.stderr
    doc = strict_json(got.stdout)
    assert set(doc) == set(schema["document"]) and doc["schema_version"] == REPORT_SCHEMA_VERSION
    optional = {"io_error"}
    offsets = []
    for record in doc["files"]:
        assert set(schema["report"]) - optional <= set(record) <= set(schema["report"]), record
        for key, value in record.items():
            assert _conforms(value, schema["report"][key]), (key, value)
        for severity in ("errors", "warnings", "infos"):
            for f in record[severity]:
                assert list(f) == list(schema["finding"])
                assert all(_conforms(f[k], schema["finding"][k]) for k in f), f
                assert f["severity"] == severity[:-1] and re.fullmatch(r"[A-Z]\d{3}", f["code"])
                offsets += [f["offset"]] if f["offset"] is not None else []
    assert "io_error" in doc["files"][3] and doc["files"][2]["valid"] is True  # infos only: valid
    assert offsets, "an overlapping entry's finding gives its byte offset"


def test_json_is_strict_unicode_for_hostile_names_and_paths(tmp_path: Path) -> None:
    """A lone surrogate from model_index.json's ``\\udc80`` escapes and a path that is not UTF-8 (argv):
    --json and --json-lines stay what a strict parser reads. *was:* ``"\\udc80x"`` in the output, which
    serde_json refuses ("lone leading surrogate") and Go replaces."""
    raw = json.dumps(mh.MODEL_INDEX)[:-1] + ', "\\udc80x": ["diffusers", "\\ud800"]}'
    surrogate = mh.write_valid(tmp_path / "surrogate.dduf", model_index_bytes=raw.encode())
    odd = tmp_path.as_posix().encode() + b"/na\xffme\x1b.dduf"
    Path(os.fsdecode(odd)).write_bytes(surrogate.read_bytes())
    for mode in ("--json", "--json-lines"):
        got = run_cli("validate", mode, str(surrogate), odd)
        assert got.returncode == 1 and b"Traceback" not in got.stderr, got.stderr[-2000:]
        lines = [got.stdout] if mode == "--json" else got.stdout.splitlines()
        records = [r for raw_doc in lines for r in (lambda d: d.get("files", [d]))(strict_json(raw_doc))]
        assert len(records) == 2 and records[1]["path"].endswith("na\\udcffme\x1b.dduf"), records[1]["path"]
        assert any("\\udc80x" in f["message"] for f in records[0]["errors"])
    assert json_text("caf\u00e9 \udc80") == "caf\u00e9 \\udc80"


SAY_ON_STDOUT = """
import os, sys
import dduf_plus.format.validate as v
rule = v._check_components
def noisy(*args):
    print("a library prints this")
    os.write(1, b"a native library writes this\\n")
    return rule(*args)
v._check_components = noisy
from dduf_plus.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("mode", ["--json", "--json-lines"])
def test_stdout_holds_the_json_and_nothing_else(tmp_path: Path, mode: str) -> None:
    """Whatever a rule (or a model class the load check builds) prints, on sys.stdout or on file descriptor 1,
    goes to stderr: stdout parses. *was:* the two lines came first on stdout and json.loads failed."""
    good = mh.write_valid(tmp_path / "good.dduf")
    got = subprocess.run([sys.executable, "-c", SAY_ON_STDOUT, "validate", mode, str(good), str(good)],
                         capture_output=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    docs = [strict_json(got.stdout)] if mode == "--json" else [strict_json(line) for line in got.stdout.splitlines()]
    assert len(docs) == (1 if mode == "--json" else 2)
    assert got.stderr.count(b"a library prints this") == 2 and got.stderr.count(b"a native library") == 2


def test_json_is_the_same_bytes_on_every_run(tmp_path: Path) -> None:
    """No timestamps, durations or byte counts in the JSON; findings in a fixed order; with --jobs too; strict
    JSON for every case of the hostile corpus (names with NUL, ANSI escapes, bytes that are not UTF-8)."""
    files = [str(HOSTILE / name) for name in sorted(CASES)]
    first = run_cli("validate", "--json", "--verify", *files)
    again = run_cli("validate", "--json", "--verify", "--jobs", "2", *files)
    assert first.returncode == again.returncode == 1
    assert first.stdout == again.stdout
    assert not re.search(rb'"(seconds|bytes_read|time|date)"', first.stdout)
    assert len(strict_json(first.stdout)["files"]) == len(CASES)


def test_validate_many_reports_every_item_of_a_hub_list(tmp_path: Path) -> None:
    """A list as a pipeline builds it: a bytes path (os.listdirb), a None or a number by mistake. Each gets its
    report, in order, every report JSON-serializable. *was:* a None ended the batch silently (the sources after
    it never validated), a number raised TypeError out of the generator, and a bytes path gave a report whose
    ``as_dict()`` json.dumps refused."""
    from dduf_plus import validate_many

    good = mh.write_valid(tmp_path / "good.dduf")
    sources = [os.fsencode(good), None, 7, good, str(good)]
    reports = list(validate_many(sources, max_workers=2))
    assert [r.valid for r in reports] == [True, False, False, True, True]
    assert reports[0].path == str(good) and "not a path or URL" in (reports[1].io_error or "")
    for r in reports:
        strict_json(json.dumps(r.as_dict()).encode())


# --- adversarial uploads: each a clean report within counted reads --------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_hostile_case_is_answered_reading_each_byte_at_most_once(case: str) -> None:
    data = (HOSTILE / case).read_bytes()
    report = checked(data, max_reads=64)
    assert CASES[case]["verify"] or CASES[case]["code"] in report.codes
    assert all(0 <= f.offset <= len(data) for f in report.findings if f.offset is not None), report


def test_offsets_point_at_the_member_or_tensor_bytes() -> None:
    """A finding about a stored member gives its first data byte; about a tensor, the tensor's first byte."""
    import zipfile

    path = HOSTILE / "config-broken.dduf"
    data = path.read_bytes()
    (f,) = [f for f in validate(path).errors if f.code == "D007"]
    content = zipfile.ZipFile(path).read("unet/config.json")
    assert data[f.offset : f.offset + len(content)] == content
    path = HOSTILE / "st-hole.dduf"
    data = path.read_bytes()
    (hole,) = [f for f in validate(path).errors if f.code == "S006"]
    name, tensor = hole.entry.split(":")
    member = zipfile.ZipFile(path).read(name)
    (length,) = struct.unpack_from("<Q", member)
    begin = json.loads(member[8 : 8 + length])[tensor]["data_offsets"][0]
    assert data[hole.offset - 8 - length - begin : hole.offset - begin] == member[: 8 + length]


def test_a_comment_longer_than_the_file_is_Z002(tmp_path: Path) -> None:
    """*was:* valid (zipfile ignores the length; Go's archive/zip refuses the file: a parser differential)."""
    data = bytearray(mh.write_valid(tmp_path / "a.dduf").read_bytes())
    struct.pack_into("<H", data, len(data) - 2, 0xFFFF)
    report = checked(data)
    assert report.codes == ["Z002"] and "65535-byte archive comment" in report.errors[0].message
    assert report.errors[0].offset == len(data) - 2


def descriptor_archive(form: str, *, lie: str = "", merges: bytes | None = None) -> bytes:
    """The plain entries with tokenizer/merges.txt written as a streaming writer does (bit 3, CRC-32 and sizes
    in a data descriptor after the data): ``form`` is ``signed32``, ``signed64``, ``unsigned32`` or
    ``unsigned64``; ``lie`` makes the descriptor's ``crc`` or ``size``, or the local header's ``local``
    values, disagree with the central directory."""
    out, central = bytearray(), []
    entries = mh.plain_entries()
    for e in entries:
        if merges is not None and e["name"] == b"tokenizer/merges.txt":
            e["data"] = merges
        name, data = e["name"], e["data"]
        crc, n = zlib.crc32(data), len(data)
        deferred = name == b"tokenizer/merges.txt"
        flags = spec.FLAG_UTF8 | (spec.FLAG_DATA_DESCRIPTOR if deferred else 0)
        offset = len(out)
        zip64 = struct.pack("<HHQQ", spec.EXTRA_ZIP64, 16, n, n)
        if deferred:
            local = (crc + 1, n, n) if lie == "local" else (0, 0, 0)
            out += struct.pack(spec.LOCAL_HEADER_FMT, spec.SIG_LOCAL, 45, flags, 0, 0, spec.DOS_DATE, *local, len(name),
                               0) + name + data
            width = "Q" if form.endswith("64") else "I"
            out += (struct.pack("<I", spec.SIG_DATA_DESCRIPTOR) if form.startswith("signed") else b"")
            out += struct.pack(f"<I{width}{width}", crc + (lie == "crc"), n + (lie == "size"), n + (lie == "size"))
        else:
            out += struct.pack(spec.LOCAL_HEADER_FMT, spec.SIG_LOCAL, 45, flags, 0, 0, spec.DOS_DATE, crc, U32, U32,
                               len(name), len(zip64)) + name + zip64 + data
        extra = struct.pack("<HHQQQ", spec.EXTRA_ZIP64, 24, n, n, offset)
        central.append(struct.pack(spec.CENTRAL_HEADER_FMT, spec.SIG_CENTRAL, (3 << 8) | 45, 45, flags, 0, 0,
                                   spec.DOS_DATE, crc, U32, U32, len(name), len(extra), 0, 0, 0, 0o100644 << 16, U32)
                       + name + extra)
    directory = b"".join(central)
    cd_offset = len(out)
    return bytes(out + directory + mh.end_records(len(entries), cd_offset, len(directory), cd_offset + len(directory)))


ZIP_CODES = re.compile(r"Z\d{3}")


@pytest.mark.parametrize("form", ["signed32", "signed64", "unsigned32", "unsigned64"])
def test_honest_data_descriptors_are_accepted(form: str) -> None:
    """zipfile writes STORED entries with a descriptor to an unseekable stream. *was:* a 16-byte descriptor was
    taken for 24 bytes, so the next entry "overlapped" it (Z015) and was dropped (then D006 on its folder)."""
    report = checked(descriptor_archive(form))
    assert not [c for c in report.codes if ZIP_CODES.fullmatch(c)], report
    import io
    import zipfile

    assert zipfile.ZipFile(io.BytesIO(descriptor_archive(form))).testzip() is None  # the fixture is a sound ZIP


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        table.append(c)
    return table


def forced_crc(data: bytes, target: int) -> bytes:
    """Four bytes that, appended to ``data``, make its CRC-32 ``target`` (CRC-32 is linear: walk the table
    back from the target register, then choose each byte to hit the index found)."""
    table = _crc_table()
    by_top = {table[i] >> 24: i for i in range(256)}
    reg, indices = target ^ U32, []
    for _ in range(4):
        i = by_top[reg >> 24]
        indices.append(i)
        reg = ((reg ^ table[i]) << 8) & U32
    reg, out = zlib.crc32(data) ^ U32, bytearray()
    for i in reversed(indices):
        out.append((reg ^ i) & 0xFF)
        reg = (reg >> 8) ^ table[i]
    return bytes(out)


def test_an_unsigned_descriptor_whose_crc_is_the_signature_is_accepted() -> None:
    """An unsigned descriptor starts with the entry's CRC-32; when that equals the descriptor signature's value
    (1 in 2^32), the descriptor must still be read as unsigned. *was:* read as signed only: a false Z014."""
    for n in range(1000):  # a text whose four forced bytes are printable, so merges.txt stays text
        text = b"#version: 0.2\nh e\n#%d " % n
        tail = forced_crc(text, spec.SIG_DATA_DESCRIPTOR)
        if all(32 <= b < 127 for b in tail):
            break
    assert zlib.crc32(text + tail) == spec.SIG_DATA_DESCRIPTOR
    for form in ("unsigned32", "unsigned64"):
        report = checked(descriptor_archive(form, merges=text + tail))
        assert not [c for c in report.codes if ZIP_CODES.fullmatch(c)], report


@pytest.mark.parametrize("lie", ["crc", "size", "local"])
def test_a_lying_data_descriptor_or_deferred_local_header_is_Z014(lie: str) -> None:
    """A reader that streams local records trusts the descriptor (Go's archive/zip checks the CRC-32 against
    it), zipfile the central directory: they must agree. *was:* valid (descriptors were never compared)."""
    report = checked(descriptor_archive("signed32", lie=lie))
    z014 = [f for f in report.errors if f.code == "Z014"]
    assert [f.entry for f in z014] == ["tokenizer/merges.txt"] and z014[0].offset is not None, report
    assert "Z015" not in report.codes  # the next entry is not taken for an overlap


def entries_claimed(n: int) -> bytes:
    """A ZIP64 archive whose end records claim ``n`` entries in a directory of as many 46-byte records."""
    return mh.end_records(n, 0, n * spec.CENTRAL_HEADER_SIZE, 0)


@pytest.mark.parametrize("n", [65_535, 65_536, 1_000_000, 1 << 40])
def test_entry_counts_past_the_cap_are_refused_before_the_directory_is_read(n: int) -> None:
    report = checked(entries_claimed(n), max_reads=4, max_bytes=200)
    assert report.codes == ["Z005"]


def test_65535_entries_without_zip64_records_is_Z003() -> None:
    eocd = struct.pack(spec.EOCD_FMT, spec.SIG_EOCD, 0, 0, 0xFFFF, 0xFFFF, 0xFFFF * 46, 0, 0)
    assert checked(eocd, max_reads=4).codes == ["Z003"]


def better_zip_bomb(n: int) -> bytes:
    """Fifield's "better zip bomb" layout: ``n`` central records all naming one local header (the kernel)."""
    body = mh.raw_zip(mh.plain_entries())
    layout = mh.Layout(body)
    name = "tokenizer/merges.txt"
    kernel, size = layout.local[name], layout.size(name)
    crc = struct.unpack_from("<I", body, layout.central[name] + 16)[0]
    records = [(k.encode(), layout.local[k], layout.size(k), struct.unpack_from("<I", body, layout.central[k] + 16)[0])
               for k in layout.central]
    records += [(f"tokenizer/k{i:05d}.txt".encode(), kernel, size, crc) for i in range(n)]
    return mh._with_directory(bytearray(body[: layout.cd_offset]), records)


def test_the_better_zip_bomb_is_Z015_reading_the_kernel_once() -> None:
    data = better_zip_bomb(9_000)
    report = checked(data, max_reads=40)  # every byte at most once: the records, one read per distinct header
    z015 = [f for f in report.errors if f.code == "Z015"]
    assert len(z015) == 9_000 and all(f.offset is not None for f in z015)


@pytest.mark.parametrize("honest_size", [False, True])
def test_a_deflate_bomb_by_ratio_is_never_inflated_past_its_budget(honest_size: bool) -> None:
    """model_index.json deflated 1000:1 (64 MiB of JSON in ~64 KB), its size in the directory the real one
    (D013: over the 256 KiB budget, not inflated) or a lie (inflation stops one byte past it: no content)."""
    content = b'{"_class_name": "X", "pad": "' + b" " * (64 << 20) + b'"}'
    deflater = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    packed_bomb = deflater.compress(content) + deflater.flush()
    assert len(content) > 500 * len(packed_bomb)
    entries = mh.plain_entries()
    entries[0].update(data=packed_bomb, method=spec.METHOD_DEFLATED)
    data = mh.raw_zip(entries)
    if honest_size:  # the directory's uncompressed size (the ZIP64 extra's first value) is the real one
        layout = mh.Layout(data)
        for at in (layout.central[spec.MODEL_INDEX] + 46, layout.local[spec.MODEL_INDEX] + 30):
            at += len(spec.MODEL_INDEX) + 4  # past the name and the extra field's id and length: usize
            data = data[:at] + struct.pack("<Q", len(content)) + data[at + 8 :]
    report = checked(data)
    assert "Z011" in report.codes and ("D013" in report.codes) == honest_size, report


def test_a_central_record_pointing_into_the_directory_is_Z017() -> None:
    entries = mh.plain_entries()
    probe = mh.raw_zip(entries)
    cd_offset = mh.Layout(probe).cd_offset
    entries[2]["header_offset"] = cd_offset  # its local header "is" the central directory itself
    report = checked(mh.raw_zip(entries))
    assert "Z017" in report.codes


@pytest.mark.parametrize("at", ["eocd64", "locator"])
def test_a_directory_that_is_the_end_records_is_refused(at: str) -> None:
    """The ZIP64 end record's directory offset pointing at the end records themselves."""
    data = bytearray(mh.raw_zip(mh.plain_entries()))
    eocd64 = len(data) - spec.EOCD_SIZE - spec.LOCATOR_SIZE - spec.EOCD64_SIZE
    fields = list(struct.unpack_from(spec.EOCD64_FMT, data, eocd64))
    fields[9] = eocd64 if at == "eocd64" else eocd64 + spec.EOCD64_SIZE
    struct.pack_into(spec.EOCD64_FMT, data, eocd64, *fields)
    report = checked(data, max_reads=8)
    assert report.codes and set(report.codes) <= {"Z003", "Z005", "Z006"}, report


@pytest.mark.parametrize(("flags", "method", "code"), [
    (spec.FLAG_UTF8 | spec.FLAG_ENCRYPTED, 0, "Z012"),
    (spec.FLAG_UTF8 | spec.FLAG_STRONG_ENCRYPTION, 0, "Z012"),
    (spec.FLAG_UTF8, 99, "Z011"),  # WinZip AES
])
def test_encryption_in_any_form_is_refused(flags: int, method: int, code: str) -> None:
    entries = mh.plain_entries()
    entries[1].update(flags=flags, method=method)
    assert code in checked(mh.raw_zip(entries)).codes


def test_a_huge_safetensors_header_claim_is_never_read(tmp_path: Path) -> None:
    """A 100 MB+ header length in a tiny file: S001, found from the 8 length bytes (nothing near 100 MB read)."""
    weights = struct.pack("<Q", 200 << 20) + b"{}" + bytes(6)
    path = mh.write_valid(tmp_path / "h.dduf", mh.base_entries() | {"unet/diffusion_pytorch_model.safetensors": weights})
    assert "S001" in checked(path.read_bytes()).codes


@pytest.mark.parametrize(("where", "blob", "code"), [
    ("unet/config.json", b"\xef\xbb\xbf" + json.dumps({"_class_name": "UNet2DModel"}).encode(), "D007"),
    ("unet/config.json", json.dumps({"_class_name": "UNet2DModel"}).encode("utf-16"), "D007"),
    ("unet/config.json", '{"_class_name": "UNet2DModel", "x": "caf\u00e9"}'.encode("latin-1"), "D007"),
    ("model_index.json", b"\xef\xbb\xbf" + json.dumps(mh.MODEL_INDEX).encode(), "D002"),
    ("model_index.json", json.dumps(mh.MODEL_INDEX).encode("utf-32"), "D002"),
    # half a UTF-16 pair: JSON spells it, no UTF-8 file holds it (Python keeps it, serde_json refuses it)
    ("unet/config.json", b'{"_class_name": "UNet2DModel", "x": "a\\ud800b"}', "D007"),
    ("unet/config.json", b'{"_class_name": "UNet2DModel", "\\udc80": 1}', "D007"),
    ("tokenizer/vocab.json", b'{"h": 0, "e": 1, "\\udbff\\u0041": 2}', "D007"),  # left to the library: bytes only
    ("model_index.json", json.dumps({**mh.MODEL_INDEX, "_diffusers_version": "\udc80"}).encode(), "D002"),
])
def test_json_that_is_not_plain_utf8_is_refused(tmp_path: Path, where: str, blob: bytes, code: str) -> None:
    """RFC 8259: UTF-8, no BOM. diffusers and transformers read configs with ``open(encoding="utf-8")`` +
    ``json.loads``: a BOM or UTF-16 config fails there (``dduf unpack``'s folder would not load). *was:*
    valid, since ``json.loads(bytes)`` guesses UTF-16/32 and skips a BOM."""
    if where == spec.MODEL_INDEX:
        path = mh.write_valid(tmp_path / "a.dduf", model_index_bytes=blob)
    else:
        path = mh.write_valid(tmp_path / "a.dduf", mh.base_entries() | {where: blob})
    report = checked(path.read_bytes())
    assert code in report.codes and any(f.entry == where for f in report.errors if f.code == code), report
    if code == "D002":  # said once; the index is not then reported as naming other components (I002)
        assert set(report.codes) == {"D002"}, report


@pytest.mark.parametrize("text", [
    '{"_class_name": "UNet2DModel", "x": "\\ud83d\\ude00"}',  # an emoji as Python's json.dumps writes it
    '{"_class_name": "UNet2DModel", "x": "\\\\ud800"}',  # an escaped backslash, then the letters "ud800"
    '{"_class_name": "UNet2DModel", "x": "\U0001f600 caf\u00e9"}',  # the same as UTF-8
])
def test_surrogate_pairs_and_look_alikes_are_plain_text(tmp_path: Path, text: str) -> None:
    from dduf_plus.format.json_budget import lone_surrogate, may_hold_lone_surrogate

    raw = text.encode()
    assert lone_surrogate(json.loads(raw)) is None
    assert not may_hold_lone_surrogate(raw) or "\\\\" in text  # the byte filter lets only the look-alike through
    path = mh.write_valid(tmp_path / "a.dduf", mh.base_entries() | {"unet/config.json": raw})
    assert not [c for c in checked(path.read_bytes()).codes if c.startswith("D")]


def test_a_lone_surrogate_in_a_big_tokenizer_file_is_found_from_its_bytes(tmp_path: Path) -> None:
    """A vocabulary over the size validate parses without ``--verify``: the byte filter finds the escape and only
    then is the file parsed (a vocabulary without one is never parsed here: the library reads it)."""
    vocab = {f"tok{i}": i for i in range(40_000)} | {"bad\udc80": 40_000}
    entries = mh.base_entries() | {"tokenizer/vocab.json": json.dumps(vocab).encode()}
    report = checked(mh.write_valid(tmp_path / "a.dduf", entries).read_bytes())
    assert [f.entry for f in report.errors if f.code == "D007"] == ["tokenizer/vocab.json"], report


@pytest.mark.parametrize(("text", "code"), [
    ('{"_class_name": "UNet2DModel", "sample_size": ' + "[" * 100 + "]" * 100 + "}", "D013"),
    ('{"_class_name": "UNet2DModel", "sample_size": 1e400}', "D013"),
    ('{"_class_name": "UNet2DModel", "sample_size": ' + "9" * 5000 + "}", "D013"),
    ('{"_class_name": "UNet2DModel", "sample_size": NaN, "x": -Infinity}', None),  # json.dumps writes these
    ('{"_class_name": "UNet2DModel", "sample_size": 4, "sample_size": 8}', None),  # the last wins, everywhere
])
def test_json_values_in_configs(tmp_path: Path, text: str, code: str | None) -> None:
    path = mh.write_valid(tmp_path / "a.dduf", mh.base_entries() | {"unet/config.json": text.encode()})
    report = checked(path.read_bytes())
    assert (code in report.codes) if code else not [c for c in report.codes if c.startswith("D")], report


def safetensors_archive(tmp_path: Path, weights: bytes) -> bytes:
    return mh.write_valid(tmp_path / "st.dduf",
                          mh.base_entries() | {"unet/diffusion_pytorch_model.safetensors": weights}).read_bytes()


@pytest.mark.parametrize(("tensors", "code"), [
    ({"a": ("F32", [2], bytes(8)), "b": ("F32", [4], bytes(8))}, "S005"),  # b's shape says 16 bytes
])
def test_safetensors_shapes_must_fill_their_span(tmp_path: Path, tensors: dict, code: str) -> None:
    assert code in checked(safetensors_archive(tmp_path, mh.safetensors(tensors))).codes


@pytest.mark.parametrize(("offsets", "code"), [([0, 8, 4, 12], "S006"), ([0, 8, 8, 1 << 40], "S006")])
def test_safetensors_offsets_overlapping_or_past_the_entry(tmp_path: Path, offsets: list[int], code: str) -> None:
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": offsets[:2]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": offsets[2:]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    weights = struct.pack("<Q", len(raw)) + raw + bytes(16)
    assert code in checked(safetensors_archive(tmp_path, weights)).codes


def test_a_safetensors_header_with_duplicate_keys_is_S010(tmp_path: Path) -> None:
    raw = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}'
    raw += b" " * (-len(raw) % 8)
    assert "S010" in checked(safetensors_archive(tmp_path, struct.pack("<Q", len(raw)) + raw + bytes(4))).codes


RUST_HEADER = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F16","shape":[8],"data_offsets":[8,24]}}'


@pytest.mark.parametrize(("edit", "code"), [
    ((b'"a"', b'"\\udc80"'), "S002"),  # a lone surrogate: serde_json refuses the header
    ((b"[0,8]", b"[-0,8]"), "S002"),  # -0: "invalid type: floating point -0.0"
    ((b'"a"', b'"a\\u0000x"'), "S012"),  # NUL: the library opens it, C readers see "a" (safetensors#748)
    ((b'"a"', b'"\\u001b[2Ja"'), "S012"),
    ((b'"a"', b'"\\ud83d\\ude00"'), None),  # a surrogate pair: one character, fine everywhere
    ((b'"a"', b'"block-0"'), None),  # "-0" inside a name is no number
    ((b'"dtype":"F32"', b'"dtype":"F32","extra":1'), None),
])
def test_safetensors_headers_are_read_as_the_safetensors_library_reads_them(tmp_path: Path, edit: tuple[bytes, bytes],
                                                                           code: str | None) -> None:
    """Python's json and the Rust reader differ on -0 and lone surrogates: validate now refuses (S002) what the
    safetensors library refuses, and a name with NUL or control characters (S012). *was:* all valid."""
    safetensors = pytest.importorskip("safetensors")
    raw = RUST_HEADER.replace(*edit)
    raw += b" " * (-len(raw) % 8)
    weights = struct.pack("<Q", len(raw)) + raw + bytes(24)
    single = tmp_path / "w.safetensors"
    single.write_bytes(weights)
    try:
        with safetensors.safe_open(single, "np"):
            library_opens = True
    except Exception:  # noqa: BLE001 - SafetensorError: what the library refuses
        library_opens = False
    report = checked(safetensors_archive(tmp_path, weights))
    assert (code in report.codes) if code else report.valid, report
    assert library_opens == (code != "S002")


# --- remote sources ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hostile_site(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from hostile_server import HostileServer

    root = tmp_path_factory.mktemp("hub-site")
    mh.write_valid(root / "a.dduf")
    with HostileServer(root, "honest", extra=1 << 20) as server:
        yield server


@pytest.mark.parametrize("mode", ["honest", "size-lie", "ignore-range", "redirect-loop", "probe-size", "range-lie"])
def test_remote_uploads_end_in_one_json_record_with_bounded_bytes(hostile_site: Any, mode: str) -> None:
    """A URL as the hub meets it: the honest server gives the verdict from a few requests; a server that lies
    about the size, ignores Range or redirects forever gives one record with ``io_error`` (exit 2) or a
    verdict (the bytes as served), never a hang or a traceback; bytes sent are bounded by the size plus one
    refused answer (a hub's validator never downloads a lying server's body)."""
    hostile_site.mode = mode
    hostile_site.reset()
    try:
        got = run_cli("validate", "--json", hostile_site.url("a.dduf"), env={"DDUF_REMOTE_DEADLINE": "20"})
    finally:
        hostile_site.mode = "honest"
    (record,) = strict_json(got.stdout)["files"]
    assert b"Traceback" not in got.stderr and got.returncode in (0, 1, 2), got.stderr[-2000:]
    if mode == "honest":
        assert got.returncode == 0 and record["valid"] and hostile_site.requests <= 4
    elif mode == "size-lie":  # a file 1000x longer, zeros past the real end, as served: no end record there
        assert got.returncode == 1 and [f["code"] for f in record["errors"]] == ["Z001"], record
    else:
        assert got.returncode == 2 and record["io_error"], record
    size = (Path(hostile_site.root) / "a.dduf").stat().st_size
    assert hostile_site.sent < 2 * size + (1 << 20) + (256 << 10), hostile_site.sent
