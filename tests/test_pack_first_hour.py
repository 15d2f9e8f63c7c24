"""A shipper's first hour with `dduf pack` and its siblings: pack never writes what validate refuses, says
what it cannot honour (a typo'd class, a variant nobody has, a --dtype on a reference, an archive holding
nothing), writes outputs as cp does, and partial archives say whether they travel."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hfcache import cached

from conftest import PIPELINES
from dduf_plus import load_dduf, validate
from dduf_plus.cli import EXIT_INVALID, EXIT_OK, EXIT_USAGE, main
from dduf_plus.errors import DDUFPackError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.pack import pack_folder
from dduf_plus.packing import pack
from dduf_plus.packing.class_names import unknown_class_problems
from dduf_plus.packing.partial import hf_snapshot

TINY_SD = PIPELINES / "tiny-sd"
FINETUNE = PIPELINES / "tiny-sd-finetune"
TINY_DIT = PIPELINES / "tiny-dit"


def dduf(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dduf_plus.cli", *map(str, args)], capture_output=True, text=True,
                          **kwargs)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --- pack writes only what validate accepts ---------------------------------------------------------------
def test_a_config_that_is_not_json_is_refused_at_pack_with_its_rule(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(TINY_SD, src)
    (src / "vae" / "config.json").write_text("{not json")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DDUFPackError, match=r"D007 vae/config.json"):
        pack(src, out / "x.dduf", quiet=True)
    assert leftovers(out) == []  # neither the archive nor its temporary file
    done = dduf("pack", src, "-o", out / "x.dduf")
    assert done.returncode == EXIT_INVALID and "D007 vae/config.json" in done.stderr and "Traceback" not in done.stderr
    assert "not writing" in done.stderr and ".partial" not in done.stderr


def test_a_class_name_typo_is_said_at_pack(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(TINY_SD, src)
    index = json.loads((src / "model_index.json").read_text())
    index["unet"] = ["diffusers", "UNet2DConditionModle"]
    index["text_encoder"] = ["transformers", "CLIPTextModl"]
    (src / "model_index.json").write_text(json.dumps(index))
    problems = unknown_class_problems(index)
    assert len(problems) == 2
    assert "did you mean UNet2DConditionModel?" in problems[1] and "did you mean CLIPTextModel?" in problems[0]
    assert unknown_class_problems(json.loads((TINY_SD / "model_index.json").read_text())) == []
    assert unknown_class_problems(json.loads((TINY_DIT / "model_index.json").read_text())) == []
    assert unknown_class_problems({"tokenizer": ["transformers", "T5TokenizerFast"]}) == []  # v5 alias
    done = dduf("pack", src, "-o", tmp_path / "x.dduf", "-q")
    # said at once as a warning, then refused as dduf validate refuses it: no loader can build it (D017)
    assert done.returncode == EXIT_INVALID and not (tmp_path / "x.dduf").exists()
    assert "D017" in done.stderr and "did you mean UNet2DConditionModel?" in done.stderr


def test_fast_tokenizer_covers_spiece_model_so_strict_and_npm_accept(tmp_path):
    result = pack_folder(TINY_DIT, tmp_path / "dit.dduf", quiet=True)
    assert ("tokenizer/spiece.model" in {s.path for s in result.skipped})
    report = validate(tmp_path / "dit.dduf", strict=True)
    assert report.valid, report.codes
    with DDUFArchive(tmp_path / "dit.dduf") as archive:
        assert not any(n.endswith(".model") for n in archive.entries)
    from transformers import AutoTokenizer

    pipe = load_dduf(tmp_path / "dit.dduf")
    folder = AutoTokenizer.from_pretrained(TINY_DIT / "tokenizer")
    assert pipe.tokenizer("a red square").input_ids == folder("a red square").input_ids


def test_a_lone_spiece_model_is_kept_and_the_d009_warning_said(tmp_path, caplog):
    src = tmp_path / "src"
    shutil.copytree(TINY_DIT, src)
    (src / "tokenizer" / "tokenizer.json").unlink()
    with caplog.at_level(logging.WARNING, logger="dduf_plus"):
        pack_folder(src, tmp_path / "x.dduf", quiet=True)
    with DDUFArchive(tmp_path / "x.dduf") as archive:
        assert "tokenizer/spiece.model" in archive.entries  # the tokenizer needs it
    assert any("D009" in r.getMessage() for r in caplog.records)


def test_a_variant_no_component_has_is_refused(tmp_path):
    with pytest.raises(DDUFPackError, match=r"no component .* variant 'fp61' \(variants present: fp16"):
        pack(TINY_SD, tmp_path / "x.dduf", variant="fp61", quiet=True)
    done = dduf("pack", TINY_SD, "-o", tmp_path / "y.dduf", "--variant", "fp61")
    assert done.returncode == EXIT_INVALID and "fp61" in done.stderr
    assert leftovers(tmp_path) == []
    pack(TINY_SD, tmp_path / "ok.dduf", variant="fp16", quiet=True)  # one component has it: fine


# --- partial packs --------------------------------------------------------------------------------------
def test_base_equal_to_source_is_refused(tmp_path, hf_env):
    with pytest.raises(DDUFPackError, match="would hold no component"):
        pack(TINY_SD, tmp_path / "x.dduf", base=str(TINY_SD), quiet=True)
    assert not (tmp_path / "x.dduf").exists()


def test_dtype_on_referenced_components_is_said(tmp_path, hf_env, caplog):
    with pytest.raises(DDUFPackError, match="--dtype names vae, which is stored as a reference"):
        pack(FINETUNE, tmp_path / "a.dduf", base=str(TINY_SD), dtype={"vae": "bfloat16"}, quiet=True)
    with caplog.at_level(logging.WARNING, logger="dduf_plus"):
        pack(FINETUNE, tmp_path / "b.dduf", base=str(TINY_SD), dtype="bfloat16", quiet=True)
    said = [r.getMessage() for r in caplog.records if "--dtype" in r.getMessage()]
    assert said == ["--dtype bfloat16 not applied to text_encoder, vae: referenced, not stored, so loaded as the "
                    "source stores them"]


def test_base_in_the_hf_cache_is_recorded_as_repo_at_commit(tmp_path, hf_env, caplog):
    snapshot = cached(hf_env)  # .../models--org--tiny-sd/snapshots/<commit>
    assert hf_snapshot(snapshot) == (("org/tiny-sd", snapshot.name, None))
    assert hf_snapshot(snapshot / "vae") == ("org/tiny-sd", snapshot.name, "vae")
    assert hf_snapshot(tmp_path) is None
    with caplog.at_level(logging.WARNING, logger="dduf_plus"):
        _result, partial = pack(FINETUNE, tmp_path / "p.dduf", base=str(snapshot), quiet=True)
    assert not [r for r in caplog.records if "local path" in r.getMessage()]
    for ref in partial.references.values():
        assert ref["pretrained_model_name_or_path"] == "org/tiny-sd" and ref["revision"] == snapshot.name
    _result, partial = pack(FINETUNE, tmp_path / "q.dduf", exclude=["vae"], refs={"vae": str(snapshot / "vae")},
                            quiet=True)
    ref = partial.references["vae"]
    assert (ref["pretrained_model_name_or_path"], ref["revision"], ref["subfolder"]) == (
        "org/tiny-sd", snapshot.name, "vae")
    assert type(load_dduf(tmp_path / "p.dduf").vae).__name__ == "AutoencoderKL"  # found in the cache by repo


def test_a_plain_local_base_says_recipients_need_the_files(tmp_path, hf_env):
    done = dduf("pack", FINETUNE, "-o", tmp_path / "p.dduf", "--base", TINY_SD, "-q")
    assert done.returncode == EXIT_OK
    assert f"references record the local path {TINY_SD}" in done.stderr and "--base org/repo" in done.stderr
    assert done.stderr.count("local path") == 1, done.stderr  # once, not again per component (R004)


def test_ref_to_the_component_folder_itself_is_one_rule_at_pack_and_load(tmp_path, hf_env):
    _result, partial = pack(FINETUNE, tmp_path / "p.dduf", exclude=["vae"], refs={"vae": str(TINY_SD / "vae")},
                            quiet=True)
    ref = partial.references["vae"]
    assert (ref["pretrained_model_name_or_path"], ref["subfolder"]) == (str(TINY_SD), "vae")
    assert type(load_dduf(tmp_path / "p.dduf").vae).__name__ == "AutoencoderKL"
    pack(FINETUNE, tmp_path / "q.dduf", exclude=["vae"], quiet=True)  # no source recorded: given at load
    assert type(load_dduf(tmp_path / "q.dduf", refs={"vae": str(TINY_SD / "vae")}).vae).__name__ == "AutoencoderKL"


def test_unpack_of_a_partial_archive_says_what_to_do(tmp_path, hf_env):
    pack(FINETUNE, tmp_path / "p.dduf", exclude=["vae"], refs={"vae": str(TINY_SD)}, quiet=True)
    done = dduf("unpack", tmp_path / "p.dduf", "-o", tmp_path / "out")
    assert done.returncode == EXIT_OK
    assert "partial archive: vae" in done.stderr and "dduf complete" in done.stderr


# --- outputs, as cp -------------------------------------------------------------------------------------
def test_output_folder_must_exist_and_is_never_created(tmp_path):
    done = dduf("pack", TINY_SD, "-o", tmp_path / "missing" / "deeper" / "x.dduf")
    assert done.returncode == EXIT_USAGE and "no such folder" in done.stderr
    assert leftovers(tmp_path) == []


def test_trailing_slash_writes_name_inside_the_folder(tmp_path):
    (tmp_path / "out").mkdir()
    assert dduf("pack", TINY_SD, "-o", f"{tmp_path / 'out'}/", "-q").returncode == EXIT_OK
    assert leftovers(tmp_path / "out") == ["tiny-sd.dduf"]
    done = dduf("pack", TINY_SD, "-o", f"{tmp_path / 'newdir'}/", "-q")
    assert done.returncode == EXIT_USAGE and not (tmp_path / "newdir").exists()
    archive = tmp_path / "out" / "tiny-sd.dduf"
    for sub, args in (("c", ("compress", archive)), ("f", ("complete", archive))):
        (tmp_path / sub).mkdir()
        assert dduf(*args, "-o", f"{tmp_path / sub}/", "-q").returncode == EXIT_OK, args
    assert leftovers(tmp_path / "c") == ["tiny-sd.dduf.zst"] and leftovers(tmp_path / "f") == ["tiny-sd.dduf"]
    (tmp_path / "d").mkdir()
    assert dduf("decompress", tmp_path / "c" / "tiny-sd.dduf.zst", "-o", f"{tmp_path / 'd'}/", "-q").returncode == 0
    assert (tmp_path / "d" / "tiny-sd.dduf").read_bytes() == archive.read_bytes()
    done = dduf("unpack", archive, "-o", tmp_path / "nope" / "x")
    assert done.returncode == EXIT_USAGE and not (tmp_path / "nope").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_an_unwritable_output_is_named_not_the_temp_file(tmp_path):
    (tmp_path / "a.dduf").write_bytes(b"")
    for args in (("pack", TINY_SD), ("compress", tmp_path / "a.dduf")):
        done = dduf(*args, "-o", "/proc/x.out", "-q")
        assert done.returncode == EXIT_USAGE, done.stderr
        assert "/proc/x.out" in done.stderr and ".partial" not in done.stderr


def test_main_returns_usage_for_a_missing_output_folder(tmp_path, capsys):
    assert main(["pack", str(TINY_SD), "-o", str(tmp_path / "no" / "x.dduf")]) == EXIT_USAGE
    assert "no such folder" in capsys.readouterr().err


# --- quanto: the documented relative path ---------------------------------------------------------------
def test_save_quanto_component_with_a_relative_path(tmp_path, monkeypatch):
    from diffusers import AutoencoderKL

    try:
        from optimum.quanto import freeze, qint8, quantize
    except ImportError:  # the quanto extra
        pytest.skip("optimum-quanto not installed")

    from dduf_plus.loading.quant import save_quanto_component

    model = AutoencoderKL.from_pretrained(TINY_SD / "vae")
    quantize(model, weights=qint8)
    freeze(model)
    monkeypatch.chdir(tmp_path)
    out = save_quanto_component(model, "sd-q8/vae")
    assert out == tmp_path / "sd-q8" / "vae"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors",
                                                    "quanto_qmap.json"]
