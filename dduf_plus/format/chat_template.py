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
a record that does not check out leaves the folded file as stored). Standard library only."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import DDUFPackError
from .json_budget import parse_json_entry

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
INDEX_KEY = "chat_templates"
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
    raw = config_path.read_bytes()
    config, code, why = parse_json_entry(raw, entry)
    if code is not None:
        raise DDUFPackError(f"{code} {entry}: {why}; DDUF readers would refuse it")
    if not isinstance(config, dict):
        raise DDUFPackError(f"D007 {entry}: not a JSON object")
    texts: dict[str, bytes] = {rel: path.read_bytes() for rel, path in sorted(templates.items())}
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
