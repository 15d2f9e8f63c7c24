"""Tokenizer and weightless-config budgets (issue 18 item 6; dduf_plus/format/tokenizer_budget.py, rules D014 and
D015): tokenizer files over a cap and scheduler configs with out-of-range numbers (floats included) are refused by
``validate`` and by ``load_dduf`` with the same code, before transformers, tokenizers or sentencepiece see them.

Most cases lower the caps (monkeypatch) so the hostile files stay small; one case per kind of file runs at the real
caps (built with C-speed joins, a few MB). Before the budgets, the issue's 50-60 MB cases were reported valid and
loaded in 1.4-1.9 GB (docs/security.md, "Tokenizer and config budgets")."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PIPELINES, ROOT, load_make_hostile
from dduf_plus.errors import DDUFError
from dduf_plus.format import tokenizer_budget as tb
from dduf_plus.format.validate import validate

mh = load_make_hostile()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _piece(text: bytes, score: float = 0.0) -> bytes:
    body = b"\x0a" + _varint(len(text)) + text + b"\x15" + struct.pack("<f", score) + b"\x18\x01"
    return b"\x0a" + _varint(len(body)) + body


def _pieces(n: int) -> bytes:
    """``n`` SentencePiece records (field 1 of ModelProto), long ones too (over 127 bytes: a 2-byte length)."""
    return b"".join(_piece(b"p%d" % i + (b"x" * 130 if i % 7 == 0 else b"")) for i in range(n))


def _fixture_entries(name: str, **replace: bytes | None) -> tuple[dict[str, bytes], dict]:
    """A fixture pipeline's files as archive entries, some replaced (None: removed)."""
    root = PIPELINES / name
    entries = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.glob("*/*")) if p.is_file()}
    for key, value in replace.items():
        entry = key.replace("__", "/")
        if value is None:
            entries.pop(entry, None)
        else:
            entries[entry] = value
    return entries, json.loads((root / "model_index.json").read_text())


def _archive(tmp_path: Path, fixture: str, file: str = "x.dduf", **replace: bytes | None) -> Path:
    entries, model_index = _fixture_entries(fixture, **replace)
    return mh.write_valid(tmp_path / file, entries, model_index)


@pytest.fixture
def small_caps(monkeypatch):
    """Caps low enough for files of a few KB; the logic is the same."""
    monkeypatch.setattr(tb, "MAX_VOCAB", 1000)
    monkeypatch.setattr(tb, "MAX_MERGES", 1000)
    monkeypatch.setattr(tb, "MAX_ADDED_TOKENS", 50)
    monkeypatch.setattr(tb, "OTHER_OBJECTS", 20)


# --- the rules, file by file ------------------------------------------------------------------------------
def test_real_tokenizer_files_pass():
    files = [p for p in PIPELINES.glob("*/tokenizer/*") if tb.applies(p.name)]
    assert {p.name for p in files} >= {"tokenizer.json", "vocab.json", "merges.txt", "spiece.model", "tokenizer_config.json"}
    assert [p for p in files if tb.tokenizer_problem(f"tokenizer/{p.name}", p.read_bytes()) is not None] == []
    scheduler = json.loads((PIPELINES / "tiny-dit" / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["lambda_min_clipped"] == float("-inf")  # diffusers writes -Infinity itself: allowed
    assert all(tb.config_number_problem(json.loads(p.read_text())) is None
               for p in PIPELINES.glob("*/scheduler/scheduler_config.json"))


def _tokenizer_json(vocab: object = None, merges: object = None, added: int = 0) -> bytes:
    model: dict = {"type": "BPE", "vocab": vocab if vocab is not None else {"a": 0}, "merges": merges or []}
    added_tokens = [{"id": i, "content": f"<a{i}>", "special": True} for i in range(added)]
    return json.dumps({"version": "1.0", "added_tokens": added_tokens, "model": model}).encode()


@pytest.mark.parametrize(("name", "raw", "what"), [
    ("tokenizer.json", _tokenizer_json(vocab={f"t{i}": i for i in range(1001)}), "vocab as an object"),
    ("tokenizer.json", _tokenizer_json(vocab=[[f"t{i}", -1.0] for i in range(1001)]), "Unigram vocab as pairs"),
    ("tokenizer.json", _tokenizer_json(merges=[["a", f"b{i}"] for i in range(1001)]), "merges as pairs"),
    ("tokenizer.json", _tokenizer_json(merges=[f"a b{i}" for i in range(1001)]), "merges as strings"),
    ("tokenizer.json", _tokenizer_json(added=71), "added tokens (objects)"),
    ("vocab.json", json.dumps({f"t{i}": i for i in range(1001)}).encode(), "vocab.json"),
    ("special_tokens_map.json", json.dumps({"additional_special_tokens": [f"<s{i}>" for i in range(51)]}).encode(),
     "special tokens as strings"),
    ("special_tokens_map.json", json.dumps({"additional_special_tokens": [{"content": f"<s{i}>"} for i in range(51)]}
                                           ).encode(), "special tokens as objects"),
    ("added_tokens.json", json.dumps({f"<s{i}>": i for i in range(51)}).encode(), "added_tokens.json"),
    ("tokenizer_config.json", json.dumps({"added_tokens_decoder": {str(i): {"content": f"<s{i}>"} for i in range(71)}}
                                         ).encode(), "tokenizer_config added_tokens_decoder"),
    ("merges.txt", b"#version: 0.2\n" + b"".join(b"a b%d\n" % i for i in range(1001)), "merges.txt"),
    ("vocab.txt", b"".join(b"t%d\n" % i for i in range(1002)), "vocab.txt"),
    ("spiece.model", _pieces(1001), "SentencePiece pieces"),
])
def test_over_a_cap_is_D014(small_caps, name: str, raw: bytes, what: str) -> None:
    found = tb.tokenizer_problem(f"tokenizer/{name}", raw)
    assert found is not None and found[0] == "D014", (what, found)


@pytest.mark.parametrize(("name", "raw"), [
    ("tokenizer.json", _tokenizer_json(vocab={f"t{i}": i for i in range(900)}, merges=[["a", f"b{i}"] for i in range(900)],
                                       added=49)),
    ("tokenizer.json", _tokenizer_json(vocab={"," * 5000: 0, "[" * 3000: 1, "{" * 3000: 2, '\\"' * 2000: 3})),
    ("special_tokens_map.json", json.dumps({"additional_special_tokens": [f"<s{i}>" for i in range(50)]}).encode()),
    ("merges.txt", b"#version: 0.2\n" + b"".join(b"a b%d\n" % i for i in range(1000))),
    ("spiece.model", _pieces(1000) + b"\x12\x04\x08\x01\x10\x02" + b"\x1a\x00"),  # + trainer and normalizer specs
])
def test_just_within_the_caps_passes(small_caps, name: str, raw: bytes) -> None:
    """Counted on what the parser builds: commas and brackets inside strings do not count."""
    assert tb.tokenizer_problem(f"tokenizer/{name}", raw) is None


def test_a_model_of_other_fields_is_walked_within_the_same_bound(small_caps) -> None:
    """Field 2 (varint) records of 2 bytes each are not pieces: at most OTHER_FIELDS of them (a 64 MB file of
    them was a 32 M-step walk)."""
    assert tb.tokenizer_problem("tokenizer/spiece.model", b"\x10\x00" * 1024) is None
    found = tb.tokenizer_problem("tokenizer/spiece.model", b"\x10\x00" * 1025)
    assert found is not None and "fields besides its pieces" in found[1]


@pytest.mark.parametrize("raw", [b"\x0f\x00", b"\x0a\x05ab", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
                                 b"\x0a" + b"\x80" * 20])
def test_a_model_that_is_not_protobuf_is_D014(raw: bytes) -> None:
    found = tb.tokenizer_problem("tokenizer/spiece.model", raw)
    assert found is not None and found[0] == "D014" and "not a SentencePiece model" in found[1]


def test_real_caps_on_pieces_and_tokens() -> None:
    """At the real caps (1,048,576): one piece more is refused, in well under a second each."""
    piece = b"\x0a\x02\x0a\x00"  # an empty piece: the smallest record
    assert tb.sentencepiece_problem(piece * tb.MAX_VOCAB) is None
    assert "more than 1048576 pieces" in (tb.sentencepiece_problem(piece * (tb.MAX_VOCAB + 1)) or "")
    vocab = b'{"model":{"vocab":{' + b",".join(b'"t%d":%d' % (i, i) for i in range(tb.MAX_VOCAB + 1)) + b"}}}"
    assert tb.json_shape(vocab)[0] == tb.MAX_VOCAB + 1
    assert tb.tokenizer_problem("tokenizer/tokenizer.json", vocab)[0] == "D014"


@pytest.mark.parametrize(("config", "bad"), [
    ({"num_train_timesteps": 1e8}, True),  # the issue's case: a float passed the integer-only cap
    ({"num_train_timesteps": 1 << 40}, True),
    ({"trained_betas": [0.1, 0.2, -3e12]}, True),
    ({"nested": {"solver_order": 4294967296}}, True),
    ({"num_train_timesteps": 1000, "beta_end": 0.012, "clip_sample": True, "lambda_min_clipped": float("-inf")}, False),
    ({"flag": True, "x": 1048576, "y": -1048576.0, "nan": float("nan")}, False),
])
def test_weightless_config_numbers(config: dict, bad: bool) -> None:
    assert (tb.config_number_problem(config) is not None) == bad


# --- validate and load_dduf agree ---------------------------------------------------------------------------
@pytest.mark.parametrize(("fixture", "replace", "code"), [
    ("tiny-dit", {"tokenizer__spiece.model": None, "tokenizer__tokenizer.json": None}, None),  # the baseline
    ("tiny-dit", {"tokenizer__spiece.model": b"\x0a\x02\x0a\x00" * (tb.MAX_VOCAB + 1),
                  "tokenizer__tokenizer.json": None}, "D014"),
    ("tiny-sd", {"tokenizer__merges.txt": b"#version: 0.2\n" + b"a b\n" * (tb.MAX_MERGES + 1)}, "D014"),
    ("tiny-sd", {"tokenizer__special_tokens_map.json": b'{"additional_special_tokens": ['
                 + b",".join([b'"<s>"'] * (tb.MAX_ADDED_TOKENS + 1)) + b"]}"}, "D014"),
    # T5's tokenizers add extra_ids tokens, built from the number (2**31: 7.7 GB, 30 s, then a failure)
    ("tiny-dit", {"tokenizer__tokenizer_config.json": json.dumps(
        {**json.loads((PIPELINES / "tiny-dit" / "tokenizer" / "tokenizer_config.json").read_text()),
         "extra_ids": 1 << 31}).encode()}, "D014"),
    ("tiny-sd", {"scheduler__scheduler_config.json": json.dumps(
        {**json.loads((PIPELINES / "tiny-sd" / "scheduler" / "scheduler_config.json").read_text()),
         "num_train_timesteps": 1e8}).encode()}, "D015"),
])
def test_validate_and_load_refuse_with_the_same_code(tmp_path, fixture: str, replace: dict, code: str | None) -> None:
    from dduf_plus import load_dduf

    if code is None:  # the baseline: a spiece.model alone is valid
        replace = {"tokenizer__tokenizer.json": None}
    path = _archive(tmp_path, fixture, **replace)
    report = validate(path)
    if code is None:
        assert report.valid, report
        return
    assert code in [f.code for f in report.errors], report
    with pytest.raises(DDUFError) as caught:
        load_dduf(path)
    assert caught.value.code == code, caught.value
    assert code in str(caught.value)


def test_the_issue_scale_tokenizer_is_refused_cheaply(tmp_path) -> None:
    """The issue's case, a tokenizer.json of millions of tokens (here 1.5 M, 30 MB; the issue's 2.5 M took 1.37 GB
    and 22 s of CPU to load): validate and load_dduf refuse it (D014) in fresh processes, within 3 s of CPU and
    500 MB for validate and 800 MB (torch and diffusers imported: ~400 MB) for the load."""
    tokenizer = json.loads((PIPELINES / "tiny-sd" / "tokenizer" / "tokenizer.json").read_text())
    start = len(tokenizer["model"]["vocab"])
    head, _, tail = json.dumps(tokenizer).partition('"vocab": {')
    extra = ",".join(f'"t{i}": {start + i}' for i in range(1_500_000))
    path = _archive(tmp_path, "tiny-sd", **{"tokenizer__tokenizer.json": (head + '"vocab": {' + extra + "," + tail).encode()})
    assert path.stat().st_size > 25 << 20
    code = ("import json,resource,sys\nfrom dduf_plus.errors import DDUFError\ncmd, path = sys.argv[1:]\n"
            "try:\n    if cmd == 'validate':\n        from dduf_plus import validate\n"
            "        got = [f.code for f in validate(path).errors]\n"
            "    else:\n        from dduf_plus import load_dduf\n        load_dduf(path); got = ['loaded']\n"
            "except DDUFError as e:\n    got = [e.code]\n"
            "u = resource.getrusage(resource.RUSAGE_SELF)\n"
            "hwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
            "print(json.dumps({'codes': got, 'cpu': u.ru_utime + u.ru_stime, 'rss': hwm << 10}))\n")
    for cmd, cpu, rss in (("validate", 3.0, 500 << 20), ("load", 15.0, 800 << 20)):
        out = subprocess.run([sys.executable, "-c", code, cmd, str(path)], capture_output=True, text=True, cwd=ROOT,
                             timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                                               "DDUF_PLUS_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)})
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["codes"] == ["D014"] and got["cpu"] < cpu and got["rss"] < rss, (cmd, got, out.stderr[-2000:])


def test_a_reference_folder_gets_the_same_budgets(small_caps, tmp_path) -> None:
    """A component resolved to a folder (a reference) hands its path to transformers: its tokenizer files pass the
    same checks first."""
    from dduf_plus.loading.files import FolderComponentFiles

    folder = tmp_path / "tokenizer"
    shutil.copytree(PIPELINES / "tiny-sd" / "tokenizer", folder)
    assert FolderComponentFiles(folder).local_dir() == str(folder)
    (folder / "merges.txt").write_bytes(b"#version: 0.2\n" + b"a b\n" * 1001)
    with pytest.raises(DDUFError, match=r"D014 \[tokenizer/merges.txt\]") as caught:
        FolderComponentFiles(folder).local_dir()
    assert caught.value.code == "D014"
