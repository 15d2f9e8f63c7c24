"""Chat templates in a form DDUF allows.

transformers 5 saves a tokenizer's chat template as ``chat_template.jinja`` (more templates under
``additional_chat_templates/NAME.jinja``); DDUF allows neither the extension nor the sub-folder. Every
transformers version also reads the template from ``tokenizer_config.json``'s ``chat_template`` key (a
string, or ``[{"name": ..., "template": ...}]`` for several), so the archive stores that: the template
files are *folded* into ``tokenizer_config.json``. Any reader of the archive then gets the template.

The index records what was folded (component key :data:`INDEX_KEY`)::

    "chat_templates": {
      "into": "tokenizer_config.json",
      "original": {"sha256": "...", "size": 1234},   # + "text" when not transformers' canonical JSON
      "files": {"chat_template.jinja": {"sha256": "...", "size": 567}}
    }

so ``dduf unpack`` and ``dduf complete`` give back the original files byte for byte (checked by sha256;
a record that does not check out leaves the folded file as stored). Standard library only.

The record is untrusted and its ``text`` is written as a file: :func:`restore_plan` (what unpack, complete and
validate all ask) lets a restored ``tokenizer_config.json`` through only when it parses equal to the stored one
(``chat_template`` aside: ``I002`` otherwise) and passes the stored one's budgets (``D013`` JSON budget,
``D014`` tokenizer caps), and the restored files count against the entry cap (``Z005``)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import DDUFPackError
from . import spec
from .findings import Finding, finding
from .json_budget import parse_json_entry
from .source_folder import read_source
from .tokenizer_budget import tokenizer_problem

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
INDEX_KEY = "chat_templates"
_BUDGET = spec.CONFIG_JSON_BUDGET.bytes  # tokenizer_config.json's (D013): the folded templates are part of it
_EXTRA_NAME = re.compile(rf"^{TEMPLATE_DIR}/([A-Za-z0-9_.\-]+)\.jinja$")


class Fold(NamedTuple):
    """``tokenizer_config.json`` with the templates folded in, and what the index records."""

    data: bytes
    source_sha256: str  # of the original tokenizer_config.json
    record: dict[str, Any]
    originals: dict[str, Path]  # every original file: tokenizer_config.json and the templates


def canonical_json(value: Any) -> bytes:
    """JSON as transformers writes ``tokenizer_config.json``."""
    return (json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def template_files(folder: Path) -> dict[str, Path]:
    """``{relative name: path}`` of the chat template files in a component folder."""
    found: dict[str, Path] = {}
    if (folder / TEMPLATE_FILE).is_file():
        found[TEMPLATE_FILE] = folder / TEMPLATE_FILE
    extra = folder / TEMPLATE_DIR
    if extra.is_dir() and not extra.is_symlink():
        for path in sorted(extra.iterdir()):
            rel = f"{TEMPLATE_DIR}/{path.name}"
            if path.is_file() and _EXTRA_NAME.match(rel):
                found[rel] = path
    return found


def is_template_name(rel: str) -> bool:
    return rel == TEMPLATE_FILE or bool(_EXTRA_NAME.match(rel))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fold(component: str, config_path: Path, templates: Mapping[str, Path]) -> Fold:
    """Fold ``templates`` (from :func:`template_files`) into the tokenizer config at ``config_path``.

    Raises:
        DDUFPackError: the config is not a JSON object, or a template is not UTF-8 text.
    """
    entry = f"{component}/{TOKENIZER_CONFIG}"
    if not templates:
        raise ValueError(f"{entry}: no chat template to fold")
    raw = read_source(config_path, config_path, _BUDGET, "D013")  # bounded: never more than its budget + 1 bytes
    config, code, why = parse_json_entry(raw, entry)
    if code is not None:
        raise DDUFPackError(f"{code} {entry}: {why}; DDUF readers would refuse it")
    if not isinstance(config, dict):
        raise DDUFPackError(f"D007 {entry}: not a JSON object")
    texts = _read_templates(templates)
    decoded: dict[str, str] = {}
    for rel, data in texts.items():
        try:
            decoded[rel] = data.decode("utf-8")
        except UnicodeDecodeError:
            raise DDUFPackError(f"{component}/{rel}: chat template is not UTF-8 text") from None
    folded = {k: v for k, v in config.items() if k != "chat_template"}
    folded["chat_template"] = _template_value(decoded)
    original: dict[str, Any] = {"sha256": _sha(raw), "size": len(raw)}
    if canonical_json({k: v for k, v in config.items() if k != "chat_template"}) != raw:
        try:  # not as transformers writes it: keep the text, restored byte for byte by unpack/complete
            original["text"] = raw.decode("utf-8")
        except UnicodeDecodeError:  # (UTF-16 JSON): unpack then keeps the folded file
            pass
    record = {"into": TOKENIZER_CONFIG, "original": original,
              "files": {rel: {"sha256": _sha(data), "size": len(data)} for rel, data in texts.items()}}
    return Fold(canonical_json(folded), _sha(raw), record, {TOKENIZER_CONFIG: config_path, **dict(templates)})


def _read_templates(templates: Mapping[str, Path]) -> dict[str, bytes]:
    """Each template's bytes, read bounded: all together at most the budget of the tokenizer_config.json they
    are folded into (D013), so a sparse 10 GB template (or a thousand 8 MB ones) is refused, not read."""
    texts: dict[str, bytes] = {}
    left = _BUDGET
    for rel, path in sorted(templates.items()):
        texts[rel] = read_source(path, path, left, "D013")
        left -= len(texts[rel])
    return texts


def _template_value(decoded: Mapping[str, str]) -> Any:
    """One template: the string; several: transformers' list form (``default`` first)."""
    named = {m.group(1): text for rel, text in decoded.items() if (m := _EXTRA_NAME.match(rel))}
    if not named:
        return decoded[TEMPLATE_FILE]
    value = [{"name": "default", "template": decoded[TEMPLATE_FILE]}] if TEMPLATE_FILE in decoded else []
    return value + [{"name": n, "template": t} for n, t in sorted(named.items())]


def unfold(folded: bytes, record: Any) -> dict[str, bytes] | None:
    """The original files (``{relative name: bytes}``) a fold record describes, each checked by sha256;
    None when the record (from an untrusted index) does not check out."""
    if not isinstance(record, dict) or record.get("into") != TOKENIZER_CONFIG:
        return None
    original, files = record.get("original"), record.get("files")
    if not isinstance(original, dict) or not isinstance(files, dict) or not files:
        return None
    config, _, _ = parse_json_entry(folded, TOKENIZER_CONFIG)
    if not isinstance(config, dict):
        return None
    try:
        return _unfold_checked(config, original, files)
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON): no file can hold it as UTF-8
        return None


def _unfold_checked(config: dict[str, Any], original: dict[str, Any], files: dict[str, Any]) -> dict[str, bytes] | None:
    """:func:`unfold` once the record's shape is checked (raises UnicodeEncodeError for unencodable text)."""
    templates = _templates_of(config.pop("chat_template", None))
    out: dict[str, bytes] = {}
    for rel, rec in files.items():
        text = templates.get(rel) if isinstance(rel, str) and is_template_name(rel) else None
        if text is None or not isinstance(rec, dict) or _sha(text.encode("utf-8")) != rec.get("sha256"):
            return None
        out[rel] = text.encode("utf-8")
    text = original.get("text")
    raw = text.encode("utf-8") if isinstance(text, str) else canonical_json(config)
    if _sha(raw) != original.get("sha256"):
        return None
    out[TOKENIZER_CONFIG] = raw
    return out


def _templates_of(value: Any) -> dict[str, str]:
    """``{relative file name: template}`` from a ``chat_template`` value."""
    if isinstance(value, str):
        return {TEMPLATE_FILE: value}
    out: dict[str, str] = {}
    if isinstance(value, list):
        for item in value:
            if isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str):
                name = item["name"]
                out[TEMPLATE_FILE if name == "default" else f"{TEMPLATE_DIR}/{name}.jinja"] = item["template"]
    return out


def restore_problem(component: str, folded: bytes, restored: Mapping[str, bytes]) -> tuple[str, str] | None:
    """``(code, why)`` when the files :func:`unfold` gives back for ``component`` may not be written: the
    original ``tokenizer_config.json`` (the record's text, attacker-chosen with its sha256) over the budgets the
    stored one passes (``D013``, ``D014``), or not parsing equal to the stored one once both lose their
    ``chat_template`` (``I002``: the record would swap in another tokenizer than the one validated)."""
    entry = f"{component}/{TOKENIZER_CONFIG}"
    raw = restored.get(TOKENIZER_CONFIG, b"")
    over = tokenizer_problem(entry, raw)
    if over is not None:
        return over[0], f"the original this archive's index records (restored by unpack/complete): {over[1]}"
    mine, code, why = parse_json_entry(raw, entry)
    stored, _, _ = parse_json_entry(folded, entry)
    if code is not None or not isinstance(mine, dict) or not isinstance(stored, dict):
        return code or "I002", f"the original this archive's index records is not a JSON object ({why or 'a ' + type(mine).__name__})"
    mine.pop("chat_template", None)
    stored.pop("chat_template", None)
    if mine != stored:
        differ = sorted(k for k in mine.keys() | stored.keys() if mine.get(k, ...) != stored.get(k, ...))
        return "I002", (f"the original this archive's index records differs from the stored file beyond the chat "
                        f"template ({len(differ)} key(s): {', '.join(map(repr, differ[:3]))})")
    return None


class RestorePlan(NamedTuple):
    """What unpack writes in place of (or beside) the stored entries, and why it may not."""

    files: dict[str, bytes]  # entry name -> restored bytes (records that check out)
    findings: list[Finding]  # errors: unpack and complete refuse, validate reports them
    unchecked: list[str]  # components whose record does not check out (their stored file is kept)


def restore_plan(index: Any, entries: Mapping[str, int], read: Callable[[str], bytes]) -> RestorePlan:
    """The chat-template restores of an archive whose index is ``index`` and entries ``{name: length}``
    (``read(name)`` gives an entry's bytes): every restored file checked by :func:`restore_problem`, and the
    entries plus the new files within the archive entry cap (Z005: a 15-entry archive whose records name
    40,000 templates would otherwise unpack to 40,015 files). Restored bytes are bounded by construction:
    templates are strings of the stored config (at most its size in all), the config within its JSON budget."""
    components = index.get("components") if isinstance(index, dict) else None
    plan = RestorePlan({}, [], [])
    for component, record in (components or {}).items() if isinstance(components, dict) else ():
        fold_record = record.get(INDEX_KEY) if isinstance(record, dict) else None
        entry = f"{component}/{TOKENIZER_CONFIG}"
        if fold_record is None or entries.get(entry, spec.CONFIG_JSON_BUDGET.bytes + 1) > spec.CONFIG_JSON_BUDGET.bytes:
            continue  # (a config over its budget is D013 already; it is not read)
        folded = read(entry)
        files = unfold(folded, fold_record)
        if files is None:
            plan.unchecked.append(component)
            continue
        problem = restore_problem(component, folded, files)
        if problem is not None:
            plan.findings.append(finding(problem[0], entry, problem[1]))
            continue
        plan.files.update({f"{component}/{rel}": data for rel, data in files.items()})
    added = sum(1 for name in plan.files if name not in entries)
    if len(entries) + added > spec.MAX_ENTRIES:
        plan.findings.append(finding("Z005", spec.INDEX_NAME, (
            f"its chat-template records restore {added} more file(s): {len(entries) + added} files after unpacking "
            f"is more than the {spec.MAX_ENTRIES} entries allowed")))
    return plan
