"""Command-line edges: each refusal is one line with the right exit code and no traceback; one --force rule;
arguments checked before work (and before torch); one exit-code table, the one docs/cli.md documents."""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PIPELINES, ROOT, load_make_hostile
from dduf_plus.cli import EXIT_INVALID, EXIT_OK, EXIT_USAGE, main
from dduf_plus.errors import DDUFError, DDUFNotFoundError
from dduf_plus.format.archive import DDUFArchive

mh = load_make_hostile()
TINY_SD = PIPELINES / "tiny-sd"


def dduf(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dduf_plus.cli", *args], capture_output=True, text=True, **kwargs)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"dduf {command}: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("edges") / "sd.dduf"
    assert main(["pack", str(TINY_SD), "-o", str(out), "-q"]) == 0
    return out


# --- outputs that are of the wrong kind ----------------------------------------------------------------------


def test_pack_into_an_existing_folder_is_one_line(tmp_path):
    done = dduf("pack", str(TINY_SD), "-o", str(tmp_path))
    assert done.returncode == EXIT_USAGE
    assert "is a folder" in one_error_line(done.stderr, "pack")
    assert list(tmp_path.iterdir()) == []  # no temp file left either


def test_unpack_onto_an_existing_file_is_one_line(tmp_path, archive):
    target = tmp_path / "file.txt"
    target.write_text("mine")
    done = dduf("unpack", str(archive), "-o", str(target))
    assert done.returncode == EXIT_USAGE
    assert "is not a folder" in one_error_line(done.stderr, "unpack")
    assert target.read_text() == "mine"


def test_a_write_that_fails_is_one_line(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    done = dduf("pack", str(TINY_SD), "-o", str(blocker / "out.dduf"), "--force")  # a parent that is a file
    assert done.returncode == EXIT_USAGE, done.stderr
    one_error_line(done.stderr, "pack")


# --- printed once ----------------------------------------------------------------------------------------------


def test_pack_prints_each_skipped_line_once_on_a_terminal(tmp_path):
    """A terminal shows stdout and stderr together: each "skipped" line appears once in the two."""
    done = subprocess.run([sys.executable, "-m", "dduf_plus.cli", "pack", str(TINY_SD), "-o", str(tmp_path / "a.dduf")],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, done.stdout
    assert done.stdout.count("skipped README.md") == 1, done.stdout
    assert done.stdout.count("skipped vae/diffusion_pytorch_model.fp16.safetensors") == 1


# --- one --force rule -----------------------------------------------------------------------------------------


def test_every_command_that_writes_a_file_refuses_an_existing_one(tmp_path, archive, capsys):
    pytest.importorskip("zstandard")
    existing = tmp_path / "existing.bin"
    partial = tmp_path / "partial.dduf"
    assert main(["pack", str(TINY_SD), "-o", str(partial), "--exclude", "vae", "--ref", str(TINY_SD), "-q"]) == 0
    zst = tmp_path / "sd.dduf.zst"
    assert main(["compress", str(archive), "-o", str(zst), "-q"]) == 0
    capsys.readouterr()
    commands = {
        "pack": ["pack", str(TINY_SD), "-o", str(existing), "-q"],
        "complete": ["complete", str(partial), "-o", str(existing), "-q"],
        "compress": ["compress", str(archive), "-o", str(existing), "-q"],
        "decompress": ["decompress", str(zst), "-o", str(existing), "-q"],
    }
    for name, args in commands.items():
        existing.write_bytes(b"keep me")
        code, _, err = run_cli(capsys, *args)
        assert code == EXIT_USAGE, (name, err)
        assert "exists (use --force to overwrite)" in one_error_line(err, name)
        assert existing.read_bytes() == b"keep me", name
        code, _, err = run_cli(capsys, *args, "--force")
        assert code == EXIT_OK, (name, err)
        assert existing.read_bytes() != b"keep me", name
        code, _, err = run_cli(capsys, *args, "-f")
        assert code == EXIT_OK, (name, err)


def test_unpack_force_rule(tmp_path, archive, capsys):
    out = tmp_path / "u"
    assert main(["unpack", str(archive), "-o", str(out), "-q"]) == EXIT_OK
    code, _, err = run_cli(capsys, "unpack", str(archive), "-o", str(out), "-q")
    assert code != EXIT_OK and "use --force" in err
    assert main(["unpack", str(archive), "-o", str(out), "-q", "-f"]) == EXIT_OK


def test_unpack_clash_exits_like_the_other_outputs(tmp_path, archive):
    out = tmp_path / "u"
    assert main(["unpack", str(archive), "-o", str(out), "-q"]) == EXIT_OK
    assert main(["unpack", str(archive), "-o", str(out), "-q"]) == EXIT_USAGE


# --- arguments checked first ---------------------------------------------------------------------------------


def test_bad_dtype_is_refused_before_torch_is_imported(tmp_path):
    code = ("import sys; from dduf_plus.cli import main; rc = main(sys.argv[1:]); "
            "print('torch' in sys.modules, rc)")
    for value, shown in (("nonsense", "--dtype nonsense: 'nonsense' is not a storage dtype"),
                         ("unet=nonsense", "--dtype unet=nonsense: 'nonsense' is not a storage dtype"),
                         ("unet=fp8:int8", "--dtype unet=fp8:int8: 'int8' is not a compute dtype"),
                         ("unet=", "--dtype unet=: expected COMPONENT=DTYPE")):
        done = subprocess.run([sys.executable, "-c", code, "pack", str(TINY_SD), "-o", str(tmp_path / "x.dduf"),
                               "--dtype", value], capture_output=True, text=True)
        assert done.stdout.split() == ["False", str(EXIT_USAGE)], (value, done.stdout, done.stderr)
        assert shown in one_error_line(done.stderr, "pack"), done.stderr
    assert not (tmp_path / "x.dduf").exists()


def test_a_missing_source_folder_says_it_does_not_exist(tmp_path, capsys):
    code, _, err = run_cli(capsys, "pack", str(tmp_path / "nope"), "-o", str(tmp_path / "x.dduf"))
    assert code == EXIT_USAGE and "does not exist" in one_error_line(err, "pack")
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(capsys, "pack", str(tmp_path / "file"), "-o", str(tmp_path / "x.dduf"))
    assert code == EXIT_USAGE and "is not a folder" in one_error_line(err, "pack")
    with pytest.raises(DDUFNotFoundError, match="does not exist"):  # the Python API says the same
        from dduf_plus.format.pack import pack_folder

        pack_folder(tmp_path / "nope", tmp_path / "x.dduf")


@pytest.mark.parametrize("args", [
    ["--base", "./missing-folder"],
    ["--base", "missing.dduf"],
    ["--base", "~/surely-missing-dduf-plus-folder"],
    ["--exclude", "vae", "--ref", "vae=./missing-folder"],
    ["--exclude", "vae", "--ref", "./missing-folder:vae"],
    ["--base", "fixtures/no-such-folder"],  # its first folder exists here: a path, not a Hub repo id
])
def test_path_looking_sources_that_do_not_exist(tmp_path, capsys, monkeypatch, args):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "x.dduf"
    code, stdout, err = run_cli(capsys, "pack", str(PIPELINES / "tiny-sd-finetune"), "-o", str(out), *args)
    assert code == EXIT_USAGE, err
    assert "does not exist" in one_error_line(err, "pack")
    assert not out.exists() and stdout == ""


def test_refs_and_complete_check_their_ref_paths(tmp_path, capsys, archive):
    code, _, err = run_cli(capsys, "refs", str(archive), "--ref", "./missing-folder")
    assert code == EXIT_USAGE and "does not exist" in one_error_line(err, "refs")
    code, _, err = run_cli(capsys, "complete", str(archive), "-o", str(tmp_path / "x.dduf"), "--ref", "x=missing.dduf")
    assert code == EXIT_USAGE and "does not exist" in one_error_line(err, "complete")


def test_a_hub_repo_id_is_not_taken_for_a_path(tmp_path, capsys, hf_env):
    """``org/repo`` with no ./org here is a repo id: the pack fails for the Hub reason (offline), not 'does not exist'."""
    code, _, err = run_cli(capsys, "pack", str(PIPELINES / "tiny-sd-finetune"), "-o", str(tmp_path / "x.dduf"),
                           "--base", "no-such-org-here/base-model")
    assert code != EXIT_OK and "does not exist" not in err


# --- not-found errors --------------------------------------------------------------------------------------------


def test_missing_archive_is_a_ddf_error_and_a_file_not_found_error(tmp_path):
    missing = tmp_path / "missing.dduf"
    for opener in (DDUFArchive, lambda p: __import__("dduf_plus").load_dduf(p)):
        with pytest.raises(FileNotFoundError) as caught:
            opener(missing)
        error = caught.value
        assert isinstance(error, DDUFError) and isinstance(error, DDUFNotFoundError)
        assert error.errno == errno.ENOENT and error.filename == str(missing)
        assert str(error).startswith(f"cannot open {missing}") and "[Errno" not in str(error)


# --- info --variant --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["folder", "archive"])
def test_info_variant_says_describing_not_packing_and_skips_weightless(archive, capsys, caplog, source):
    target = TINY_SD if source == "folder" else archive
    with caplog.at_level(logging.INFO, logger="dduf_plus"):
        code, out, _ = run_cli(capsys, "info", "--variant", "fp16", str(target))
    assert code == EXIT_OK
    said = [r.getMessage() for r in caplog.records if "variant" in r.getMessage()]
    assert not any("packing" in m for m in said), said
    named = {m.split(":")[0] for m in said}
    assert not named & {"scheduler", "tokenizer"}, said  # no weights: no variant to lack
    assert "unet" in named and "text_encoder" in named  # tiny-sd has fp16 weights for the vae only
    assert ("vae" in named) == (source == "archive")  # the archive was packed without --variant


def test_info_json_reports_the_variant_used(capsys):
    code, out, _ = run_cli(capsys, "info", "--json", "--variant", "fp16", str(TINY_SD))
    import json

    comps = json.loads(out)["components"]
    assert comps["vae"]["variant"] == "fp16" and comps["unet"]["variant"] is None


# --- one exit-code table ---------------------------------------------------------------------------------------


def test_exit_codes_are_the_same_for_every_command(tmp_path, capsys, archive):
    pytest.importorskip("zstandard")
    bad = tmp_path / "bad.dduf"
    bad.write_bytes(b"garbage" * 100)
    missing = str(tmp_path / "missing.dduf")
    out = str(tmp_path / "out.bin")
    cases = {  # command: (args with a missing input, args with an invalid input)
        "info": ([missing], [str(bad)]),
        "validate": ([missing], [str(bad)]),
        "refs": ([missing], [str(bad)]),
        "unpack": ([missing, "-o", str(tmp_path / "u")], [str(bad), "-o", str(tmp_path / "u")]),
        "complete": ([missing, "-o", out], [str(bad), "-o", out]),
        "compress": ([missing, "-o", out], None),
        "decompress": ([missing + ".zst", "-o", out], None),
        "pack": ([str(tmp_path / "nope"), "-o", out], [str(tmp_path), "-o", out]),  # a folder without model_index
    }
    for command, (missing_args, invalid_args) in cases.items():
        code, _, err = run_cli(capsys, command, *missing_args)
        assert code == EXIT_USAGE, (command, err)
        one_error_line(err, command)
        if invalid_args is not None:
            code, stdout, err = run_cli(capsys, command, *invalid_args)
            assert code == EXIT_INVALID, (command, stdout, err)
        code, _, err = run_cli(capsys, command, "--no-such-option")
        assert code == EXIT_USAGE, command


def test_docs_cli_md_documents_the_table():
    doc = (ROOT / "docs" / "cli.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\|\s*`?(\d+)`?\s*\|(.+)\|\s*$", doc, re.M)}
    assert {"0", "1", "2", "130"} <= set(rows), rows
    from dduf_plus.cli import COMMANDS

    for command in COMMANDS:
        assert f"dduf {command}" in doc, command


# --- one [NAME=]VALUE parser: a name given twice is refused by every command ------------------------------------


@pytest.mark.parametrize("command", ["pack", "complete", "refs"])
def test_a_ref_given_twice_for_one_name_is_refused(tmp_path, capsys, archive, command):
    out = tmp_path / "x.dduf"
    twice = ["--ref", f"vae={TINY_SD}", "--ref", f"vae={PIPELINES / 'tiny-sd-finetune'}"]
    args = {"pack": ["pack", str(TINY_SD), "-o", str(out), "--exclude", "vae", *twice],
            "complete": ["complete", str(archive), "-o", str(out), *twice],
            "refs": ["refs", str(archive), *twice]}[command]
    code, stdout, err = run_cli(capsys, *args)
    assert code == EXIT_USAGE and stdout == "", err
    assert "--ref given twice for 'vae'" in one_error_line(err, command)
    assert not out.exists()
    code, _, err = run_cli(capsys, *args[:-4], "--ref", str(TINY_SD), "--ref", str(TINY_SD))
    assert code == EXIT_USAGE and "--ref given twice for the default" in one_error_line(err, command)


def test_a_dtype_given_twice_for_one_name_is_refused(tmp_path, capsys):
    out = tmp_path / "x.dduf"
    for twice in (["--dtype", "unet=bf16", "--dtype", "unet=fp16"], ["--dtype", "bf16", "--dtype", "fp16"]):
        code, _, err = run_cli(capsys, "pack", str(TINY_SD), "-o", str(out), *twice)
        assert code == EXIT_USAGE and "--dtype given twice for" in one_error_line(err, "pack")
    assert not out.exists()


def test_one_parser_for_every_assignment_option():
    from dduf_plus.assignments import parse_assignments
    from dduf_plus.dtype_names import parse_dtype_args
    from dduf_plus.errors import DDUFPackError, DDUFReferenceError, DDUFUsageError
    from dduf_plus.refs.resolve import parse_ref_args

    assert parse_assignments(["x=b", "org/r=c"], "--opt", default_key="*") == {"x": "b", "*": "org/r=c"}
    with pytest.raises(DDUFUsageError, match="--opt given twice for 'x'"):
        parse_assignments(["x=a", "x=b"], "--opt", default_key="*")
    with pytest.raises(DDUFReferenceError, match="--ref given twice for 'vae'"):
        parse_ref_args(["vae=a/b", "vae=c/d"])
    with pytest.raises(DDUFPackError, match="--dtype given twice for 'unet'"):
        parse_dtype_args(["unet=bf16", "unet=bf16"])


def test_relative_outputs_in_a_subfolder(tmp_path: Path) -> None:
    """Outputs named relative to the working directory, inside a subfolder (the folder must not be joined
    twice: a regression of the one-atomic-writer change)."""
    (tmp_path / "w").mkdir()
    src = str(ROOT / "fixtures" / "pipelines" / "tiny-sd")
    for argv in (["pack", src, "-o", "w/a.dduf", "-q"], ["compress", "w/a.dduf", "-o", "w/a.dduf.zst"],
                 ["decompress", "w/a.dduf.zst", "-o", "w/b.dduf"], ["unpack", "w/b.dduf", "-o", "w/u"]):
        done = subprocess.run([sys.executable, "-m", "dduf_plus.cli", *argv], cwd=tmp_path, capture_output=True,
                              text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert done.returncode == 0, (argv, done.stderr)
    assert (tmp_path / "w" / "a.dduf").read_bytes() == (tmp_path / "w" / "b.dduf").read_bytes()
    assert (tmp_path / "w" / "u" / "model_index.json").is_file() and not (tmp_path / "w" / "w").exists()


def test_a_missing_path_offers_the_hub_reading_only_for_a_repo_id(tmp_path, monkeypatch):
    """``--base models/sd15`` where ./models exists: the path is missing, and the message says how to mean the
    Hub repo instead, but only when the text is a repo id (the one test, remote.hub.is_repo_id)."""
    from dduf_plus.cli._common import path_like_missing

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(DDUFNotFoundError, match=r"does not exist \(to mean the Hub repo models/sd15, run from"):
        path_like_missing("models/sd15@main", "--base")
    with pytest.raises(DDUFNotFoundError) as caught:
        path_like_missing("models/sd 15", "--base")  # a space: no repo is named so
    assert "does not exist" in str(caught.value) and "Hub repo" not in str(caught.value)
