"""Chat-template restores are budgeted like stored entries: the original ``tokenizer_config.json`` a fold record
carries (its text and sha256 chosen by whoever wrote the archive) must parse equal to the stored file, chat
template aside (I002), and pass the stored file's budgets (D013, D014); the files a record restores count
against the entry cap (Z005). ``dduf validate`` reports the code, ``dduf unpack`` and ``dduf complete`` refuse
with it and write nothing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import PIPELINES
from dduf_plus import validate
from dduf_plus.cli import main
from dduf_plus.errors import DDUFValidationError
from dduf_plus.format import spec
from dduf_plus.format.chat_template import INDEX_KEY, TOKENIZER_CONFIG, canonical_json, restore_plan
from dduf_plus.format.pack import EntrySource, plan_folder, write_archive
from dduf_plus.format.unpack import unpack
from dduf_plus.packing.complete import complete_archive

ENTRY = f"tokenizer/{TOKENIZER_CONFIG}"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stored_config() -> dict[str, Any]:
    return json.loads((PIPELINES / "tiny-sd" / "tokenizer" / TOKENIZER_CONFIG).read_bytes())


def _archive(out: Path, templates: Any, original: bytes | None = None) -> Path:
    """tiny-sd with ``tokenizer_config.json`` holding ``templates`` (its chat_template value) and a fold record
    that restores each template and ``original`` as the original config (the record's sha256s all match)."""
    config = _stored_config()
    stored = canonical_json({**config, "chat_template": templates})
    names = ({"chat_template.jinja": templates} if isinstance(templates, str) else
             {(f"additional_chat_templates/{t['name']}.jinja" if t["name"] != "default" else "chat_template.jinja"):
              t["template"] for t in templates})
    raw = original if original is not None else canonical_json(config)
    record = {"into": TOKENIZER_CONFIG, "original": {"sha256": _sha(raw), "size": len(raw), "text": raw.decode()},
              "files": {rel: {"sha256": _sha(t.encode()), "size": len(t.encode())} for rel, t in names.items()}}
    plan = plan_folder(PIPELINES / "tiny-sd")
    sources = [EntrySource(ENTRY, data=stored) if s.name == ENTRY else s for s in plan.sources]
    write_archive(out, plan.model_index, plan.model_index_bytes, sources,
                  extra_components={"tokenizer": {INDEX_KEY: record}}, quiet=True, check=False)
    return out


def _refused(archive: Path, tmp_path: Path, code: str, *words: str) -> None:
    """validate reports ``code``; unpack (checked or not) and complete refuse with it and write nothing."""
    report = validate(archive)
    assert code in report.codes and not report.valid, report
    for check in (True, False):
        with pytest.raises(DDUFValidationError) as e:
            unpack(archive, tmp_path / "out", check=check)
        assert e.value.code == code and all(w in str(e.value) for w in words), str(e.value)
        assert not (tmp_path / "out").exists()
    with pytest.raises(DDUFValidationError) as e:
        complete_archive(archive, tmp_path / "full.dduf", quiet=True)
    assert e.value.code == code
    assert not list(tmp_path.glob("full.dduf*"))


def test_a_clean_record_restores_and_validates(tmp_path: Path) -> None:
    """The control: the same construction with the true original validates clean and unpacks the template."""
    archive = _archive(tmp_path / "ok.dduf", TEMPLATE)
    assert validate(archive).valid
    unpack(archive, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer" / "chat_template.jinja").read_text() == TEMPLATE
    assert json.loads((tmp_path / "out" / "tokenizer" / TOKENIZER_CONFIG).read_bytes()) == _stored_config()


def test_an_original_with_100k_added_tokens_is_refused_d014(tmp_path: Path) -> None:
    """The issue's case: a 2.6 MB original (within the 8 MiB JSON budget) with 100,000 added tokens found in no
    entry; the stored file is clean, so validate said valid and unpack wrote the original."""
    config = _stored_config()
    config["added_tokens_decoder"] = {str(50000 + i): {"content": f"<t{i}>", "special": False}
                                      for i in range(100_000)}
    archive = _archive(tmp_path / "a.dduf", TEMPLATE, canonical_json(config))
    _refused(archive, tmp_path, "D014", ENTRY, "added tokens")


def test_an_original_over_the_json_budget_is_refused_d013(tmp_path: Path) -> None:
    config = {**_stored_config(), "padding": " " * (spec.CONFIG_JSON_BUDGET.bytes + 1)}
    archive = _archive(tmp_path / "a.dduf", TEMPLATE, canonical_json(config))
    _refused(archive, tmp_path, "D013", ENTRY)


def test_an_original_that_is_another_tokenizer_is_refused_i002(tmp_path: Path) -> None:
    """Within every budget, but not the file that was validated: another model_max_length, an extra key."""
    config = {**_stored_config(), "model_max_length": 7, "unk_token": "<evil>", "extra": 1}
    archive = _archive(tmp_path / "a.dduf", TEMPLATE, json.dumps(config).encode())
    _refused(archive, tmp_path, "I002", "3 key(s)", "'extra'")
    not_object = _archive(tmp_path / "b.dduf", TEMPLATE, b"[1, 2]")
    _refused(not_object, tmp_path, "I002", "not a JSON object")


def test_the_original_may_differ_in_its_chat_template_and_layout(tmp_path: Path) -> None:
    """What a pack records for real: another layout (kept as text) and its own chat_template key."""
    original = json.dumps({**_stored_config(), "chat_template": "old"}, indent=4).encode() + b"\r\n"
    archive = _archive(tmp_path / "a.dduf", TEMPLATE, original)
    assert validate(archive).valid
    unpack(archive, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer" / TOKENIZER_CONFIG).read_bytes() == original


def test_restored_files_count_against_the_entry_cap_z005(tmp_path: Path) -> None:
    """A 15-entry archive whose record names 10,000 templates would unpack to 10,015 files."""
    templates = [{"name": f"t{i}", "template": "x"} for i in range(spec.MAX_ENTRIES)]
    archive = _archive(tmp_path / "a.dduf", templates)
    _refused(archive, tmp_path, "Z005", "10000 more file(s)")
    assert not list(tmp_path.rglob("*.jinja"))


def test_restore_plan_counts_only_new_files() -> None:
    """Restoring the stored tokenizer_config.json itself adds no file; the cap is on what unpack writes."""
    config = _stored_config()
    stored = canonical_json({**config, "chat_template": TEMPLATE})
    raw = canonical_json(config)
    record = {"into": TOKENIZER_CONFIG, "original": {"sha256": _sha(raw)},
              "files": {"chat_template.jinja": {"sha256": _sha(TEMPLATE.encode())}}}
    entries = {f"e{i}": 1 for i in range(spec.MAX_ENTRIES - 2)} | {ENTRY: len(stored)}
    plan = restore_plan({"components": {"tokenizer": {INDEX_KEY: record}}}, entries, lambda name: stored)
    assert not plan.findings and set(plan.files) == {ENTRY, "tokenizer/chat_template.jinja"}
    entries["one more"] = 1
    plan = restore_plan({"components": {"tokenizer": {INDEX_KEY: record}}}, entries, lambda name: stored)
    assert [f.code for f in plan.findings] == ["Z005"]


def test_cli_unpack_and_validate_say_the_code_on_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {**_stored_config(), "model_max_length": 7}
    archive = _archive(tmp_path / "a.dduf", TEMPLATE, canonical_json(config))
    assert main(["unpack", str(archive), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "I002" in err and "Traceback" not in err
    assert main(["validate", str(archive)]) != 0
    assert "I002" in capsys.readouterr().out


def test_a_template_no_file_can_hold_restores_nothing(tmp_path: Path) -> None:
    """A lone surrogate (``"\\ud800"``, valid JSON) in the stored template: the record cannot check out (was a
    UnicodeEncodeError traceback from unpack); the stored file is written, validate has no internal error."""
    stored = json.dumps({**_stored_config(), "chat_template": "\ud800"}).encode()
    record = {"into": TOKENIZER_CONFIG, "original": {"sha256": "0" * 64},
              "files": {"chat_template.jinja": {"sha256": "0" * 64}}}
    plan = plan_folder(PIPELINES / "tiny-sd")
    sources = [EntrySource(ENTRY, data=stored) if s.name == ENTRY else s for s in plan.sources]
    archive = write_archive(tmp_path / "a.dduf", plan.model_index, plan.model_index_bytes, sources,
                            extra_components={"tokenizer": {INDEX_KEY: record}}, quiet=True, check=False).path
    assert "X000" not in validate(archive).codes
    unpack(archive, tmp_path / "out")
    assert (tmp_path / "out" / ENTRY).read_bytes() == stored
