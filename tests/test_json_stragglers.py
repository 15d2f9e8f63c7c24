"""Pack-side JSON reads (chat-template folding, `dduf complete`'s original model_index, `pack --dtype`'s
config and shard-index reads) go through the budgeted reader: deep nesting is a D013 refusal or a clean
"not usable", never a RecursionError from the json module."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from dduf_plus.errors import DDUFPackError
from dduf_plus.format.chat_template import fold, unfold
from dduf_plus.format.pack import EntrySource
from dduf_plus.packing.complete import full_model_index
from dduf_plus.packing.convert import _read_config
from dduf_plus.packing.partial import ORIGINAL_MODEL_INDEX_KEY

DEEP = b"[" * 100_000 + b"]" * 100_000  # json.loads raises RecursionError on this


def test_fold_refuses_a_deep_tokenizer_config_with_d013(tmp_path: Path) -> None:
    config = tmp_path / "tokenizer_config.json"
    config.write_bytes(b'{"a": ' + DEEP + b"}")
    template = tmp_path / "chat_template.jinja"
    template.write_text("{{ messages }}")
    with pytest.raises(DDUFPackError, match="D013 tokenizer/tokenizer_config.json"):
        fold("tokenizer", config, {"chat_template.jinja": template})


def test_unfold_of_a_deep_folded_config_is_no_record() -> None:
    record = {"into": "tokenizer_config.json", "original": {"sha256": "0" * 64}, "files": {"x.jinja": "0" * 64}}
    assert unfold(DEEP, record) is None


def test_complete_ignores_a_deep_original_model_index() -> None:
    raw = DEEP.decode()
    model_index = {"_class_name": "X", ORIGINAL_MODEL_INDEX_KEY: {
        "text": raw, "sha256": hashlib.sha256(raw.encode()).hexdigest()}}
    restored, data = full_model_index(model_index)
    assert restored == {"_class_name": "X"} and b"[[[" not in data


def test_dtype_conversion_reads_a_deep_config_as_no_config() -> None:
    source = EntrySource(name="unet/config.json", data=DEEP, size=len(DEEP))
    assert _read_config([source], "unet") is None
