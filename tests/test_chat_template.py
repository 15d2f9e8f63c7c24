"""Chat templates survive the archive: transformers 5 saves them as ``chat_template.jinja`` (and
``additional_chat_templates/NAME.jinja``), which DDUF does not allow; pack, save_dduf and complete fold them
into ``tokenizer_config.json``'s ``chat_template`` (what every transformers version reads), ``--strict``
accepts the result, and unpack / complete give back the original files byte for byte."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from conftest import PIPELINES
from dduf_plus import load_dduf, validate
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.chat_template import INDEX_KEY, unfold
from dduf_plus.format.pack import plan_folder, write_archive
from dduf_plus.format.unpack import unpack
from dduf_plus.packing import pack

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
TOOLS = "TOOLS {{ messages | length }}"
MESSAGES = [{"role": "user", "content": "a red square"}]


def _with_template(out: Path, base: str = "tiny-sd", *, extra: bool = False) -> Path:
    """A copy of a fixture pipeline whose tokenizer transformers saved with a chat template."""
    from transformers import AutoTokenizer

    shutil.copytree(PIPELINES / base, out)
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    tok.chat_template = {"default": TEMPLATE, "tools": TOOLS} if extra else TEMPLATE
    tok.save_pretrained(out / "tokenizer")
    assert (out / "tokenizer" / "chat_template.jinja").is_file()  # transformers 5's layout, the case at hand
    return out


@pytest.fixture(scope="module")
def chat_sd(tmp_path_factory) -> Path:
    return _with_template(tmp_path_factory.mktemp("chat") / "chat-sd")


@pytest.fixture(scope="module")
def chat_sd_extra(tmp_path_factory) -> Path:
    return _with_template(tmp_path_factory.mktemp("chat2") / "chat-sd", extra=True)


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_pack_folds_the_template_and_strict_accepts_it(chat_sd, tmp_path):
    out = tmp_path / "chat.dduf"
    result, _ = pack(chat_sd, out, quiet=True)
    assert validate(out, strict=True).valid
    with DDUFArchive(out) as archive:
        assert not any(n.endswith(".jinja") for n in archive.entries)
        config = json.loads(archive.read_bytes("tokenizer/tokenizer_config.json"))
        record = archive.index["components"]["tokenizer"][INDEX_KEY]
        source_sha = archive.index["files"]["tokenizer/tokenizer_config.json"]["source_sha256"]
    assert config["chat_template"] == TEMPLATE
    original = (chat_sd / "tokenizer" / "tokenizer_config.json").read_bytes()
    assert source_sha == hashlib.sha256(original).hexdigest() == record["original"]["sha256"]
    assert [s.reason for s in result.skipped if s.path == "tokenizer/chat_template.jinja"] == [
        "folded into tokenizer_config.json's chat_template"]


def test_pipeline_from_the_archive_applies_the_chat_template(chat_sd, chat_sd_extra, tmp_path):
    from transformers import AutoTokenizer

    for i, src in enumerate((chat_sd, chat_sd_extra)):
        out = tmp_path / f"c{i}.dduf"
        pack(src, out, quiet=True)
        pipe = load_dduf(out)
        reference = AutoTokenizer.from_pretrained(src / "tokenizer")
        got = pipe.tokenizer.apply_chat_template(MESSAGES, tokenize=False)
        assert got == reference.apply_chat_template(MESSAGES, tokenize=False) == "<|user|>a red square\n"
        assert pipe.tokenizer.apply_chat_template(MESSAGES, tokenize=True) == reference.apply_chat_template(
            MESSAGES, tokenize=True)
    assert pipe.tokenizer.apply_chat_template(MESSAGES, tokenize=False, chat_template="tools") == "TOOLS 1"


def test_unpack_restores_the_original_files_and_repacks_identically(chat_sd_extra, tmp_path):
    first = tmp_path / "a.dduf"
    pack(chat_sd_extra, first, quiet=True)
    unpack(first, tmp_path / "out")
    want = {k: v for k, v in _files(chat_sd_extra / "tokenizer").items()}
    assert _files(tmp_path / "out" / "tokenizer") == want  # tokenizer_config.json, both .jinja files
    again = tmp_path / "b.dduf"
    pack(tmp_path / "out", again, quiet=True)
    assert again.read_bytes() == first.read_bytes()


def test_non_canonical_tokenizer_config_is_restored_byte_for_byte(chat_sd, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(chat_sd, src)
    config = src / "tokenizer" / "tokenizer_config.json"
    config.write_bytes(json.dumps(json.loads(config.read_bytes()), indent=4).encode() + b"\r\n")  # hand-edited
    pack(src, tmp_path / "x.dduf", quiet=True)
    unpack(tmp_path / "x.dduf", tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer" / "tokenizer_config.json").read_bytes() == config.read_bytes()


def test_save_dduf_keeps_the_template(chat_sd_extra, tmp_path):
    from diffusers import DiffusionPipeline

    from dduf_plus import save_dduf

    pipe = DiffusionPipeline.from_pretrained(chat_sd_extra)
    save_dduf(pipe, tmp_path / "saved.dduf", quiet=True)
    assert validate(tmp_path / "saved.dduf", strict=True).valid
    loaded = load_dduf(tmp_path / "saved.dduf")
    assert loaded.tokenizer.apply_chat_template(MESSAGES, tokenize=False) == "<|user|>a red square\n"
    assert loaded.tokenizer.apply_chat_template(MESSAGES, tokenize=False, chat_template="tools") == "TOOLS 1"


def test_complete_of_a_referenced_tokenizer_equals_a_direct_pack(chat_sd, tmp_path, hf_env):
    from dduf_plus.packing.complete import complete_archive

    finetune = tmp_path / "ft"
    shutil.copytree(PIPELINES / "tiny-sd-finetune", finetune)
    shutil.rmtree(finetune / "tokenizer")
    shutil.copytree(chat_sd / "tokenizer", finetune / "tokenizer")
    _result, partial = pack(finetune, tmp_path / "ft.partial.dduf", base=str(chat_sd), quiet=True)
    assert "chat_template.jinja" in partial.references["tokenizer"]["files"]
    pipe = load_dduf(tmp_path / "ft.partial.dduf")  # the referenced folder holds chat_template.jinja
    assert pipe.tokenizer.apply_chat_template(MESSAGES, tokenize=False) == "<|user|>a red square\n"
    complete_archive(tmp_path / "ft.partial.dduf", tmp_path / "full.dduf", quiet=True)
    pack(finetune, tmp_path / "direct.dduf", quiet=True)
    assert (tmp_path / "full.dduf").read_bytes() == (tmp_path / "direct.dduf").read_bytes()
    assert validate(tmp_path / "full.dduf", strict=True).valid


def test_additional_templates_keep_the_tokenizer_stored_under_base(chat_sd_extra, tmp_path, hf_env):
    """A reference names files of one folder: a tokenizer with additional_chat_templates/ stays stored."""
    finetune = tmp_path / "ft"
    shutil.copytree(PIPELINES / "tiny-sd-finetune", finetune)
    shutil.rmtree(finetune / "tokenizer")
    shutil.copytree(chat_sd_extra / "tokenizer", finetune / "tokenizer")
    _result, partial = pack(finetune, tmp_path / "p.dduf", base=str(chat_sd_extra), quiet=True)
    assert "tokenizer" not in partial.references
    assert any("additional_chat_templates/tools.jinja is in a sub-folder" in line for line in partial.report)


def test_a_record_that_does_not_check_out_keeps_the_stored_file(chat_sd, tmp_path):
    """The index is untrusted: a record whose hashes do not match, or that names a path outside the
    component, restores nothing; the folded file (which transformers reads) is written as stored."""
    plan = plan_folder(chat_sd)
    folded = next(s for s in plan.sources if s.folded is not None)
    bogus = {"into": "tokenizer_config.json", "original": {"sha256": "0" * 64},
             "files": {"../../evil.jinja": {"sha256": hashlib.sha256(TEMPLATE.encode()).hexdigest()}}}
    assert unfold(folded.data, bogus) is None
    assert unfold(folded.data, {**folded.folded.record, "original": {"sha256": "0" * 64}}) is None
    sources = [s._replace(folded=None) for s in plan.sources]
    write_archive(tmp_path / "x.dduf", plan.model_index, plan.model_index_bytes, sources,
                  extra_components={"tokenizer": {INDEX_KEY: bogus}}, quiet=True)
    unpack(tmp_path / "x.dduf", tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer" / "tokenizer_config.json").read_bytes() == folded.data
    assert not list(tmp_path.rglob("*.jinja"))  # neither the template nor ../../evil.jinja


def test_a_hub_source_pack_downloads_the_templates():
    """`dduf pack org/repo` downloads only what the archive stores: the templates are part of it (folded)."""
    from dduf_plus.remote.hub import pack_selection

    files = ["model_index.json", "tokenizer/tokenizer_config.json", "tokenizer/chat_template.jinja",
             "tokenizer/additional_chat_templates/tools.jinja", "tokenizer/README.md", "tokenizer/deep/x.jinja"]
    assert pack_selection(files, ["tokenizer"], None) == [
        "model_index.json", "tokenizer/tokenizer_config.json", "tokenizer/additional_chat_templates/tools.jinja",
        "tokenizer/chat_template.jinja"]
