"""One exit-status table for every command (docs/cli.md): 0 ok, 1 the input is refused, 2 usage or I/O,
130 interrupted. Each row below is a case that disagreed with the table before (issue 19), or its sibling."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from servers import count_connects

from dduf_plus.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
TINY_SD = ROOT / "fixtures" / "pipelines" / "tiny-sd"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def partial(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-sd with vae referenced to the fixture folder (it resolves here)."""
    from dduf_plus.packing.partial import pack_partial

    out = tmp_path_factory.mktemp("exit") / "partial.dduf"
    pack_partial(TINY_SD, out, exclude=["vae"], refs={"*": str(TINY_SD)}, quiet=True)
    return out


def dead_endpoint() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# --- usage: a component-name typo is a bad argument, like a dtype typo (2, not 1) --------------------------
@pytest.mark.parametrize("args", [
    ["--dtype", "unte=bf16"], ["--dtype", "nonsense"], ["--exclude", "vea"],
    ["--exclude", "vae", "--ref", f"vea={TINY_SD}"],
])
def test_pack_typos_are_usage_errors(capsys, tmp_path, args) -> None:
    code, _, err = run_cli(capsys, "pack", str(TINY_SD), "-o", str(tmp_path / "x.dduf"), "-q", *args)
    assert code == 2, err
    assert not (tmp_path / "x.dduf").exists()


def test_refs_and_complete_ref_typos_are_usage_errors(capsys, tmp_path, partial) -> None:
    assert run_cli(capsys, "refs", str(partial), "--ref", f"vea={TINY_SD}")[0] == 2
    assert run_cli(capsys, "complete", str(partial), "-o", str(tmp_path / "full.dduf"), "--ref", f"vea={TINY_SD}")[0] == 2
    assert not (tmp_path / "full.dduf").exists()
    assert run_cli(capsys, "refs", str(partial))[0] == 0  # the sibling that works


# --- the Hub unreachable: an I/O error (2) whether it is SRC or --base, and fast ---------------------------
@pytest.fixture
def unreachable_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    import huggingface_hub.constants as constants

    dead = dead_endpoint()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "DDUF_PLUS_HUB_PROBE"):
        monkeypatch.delenv(var, raising=False)
    return dead


def test_unreachable_hub_is_exit_2_from_src_and_from_base_without_retries(capsys, tmp_path, unreachable_hub,
                                                                         monkeypatch) -> None:
    attempts = count_connects(monkeypatch)
    code, _, err = run_cli(capsys, "pack", "org/absent", "-o", str(tmp_path / "a.dduf"))
    assert code == 2 and "the Hub cannot be reached (connection refused" in err, err
    code, _, err = run_cli(capsys, "pack", str(TINY_SD), "-o", str(tmp_path / "b.dduf"), "-q", "--base", "org/absent")
    assert code == 2 and "the Hub cannot be reached (connection refused" in err, err
    # one connection attempt per command: huggingface_hub's 5 retries (with back-off: ~23 s per call) are not made
    assert 1 <= len(attempts) <= 2, attempts


def test_offline_hub_base_is_exit_2(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    code, _, err = run_cli(capsys, "pack", str(TINY_SD), "-o", str(tmp_path / "b.dduf"), "-q", "--base", "org/absent")
    assert code == 2 and "not in the Hugging Face cache" in err, err


# --- a folder given where an archive is expected -----------------------------------------------------------
@pytest.mark.parametrize("command", ["validate", "refs", "unpack"])
def test_a_folder_for_an_archive_is_2_and_says_what_to_do(capsys, tmp_path, command) -> None:
    extra = ["-o", str(tmp_path / "out")] if command == "unpack" else []
    code, _, err = run_cli(capsys, command, str(TINY_SD), *extra)
    assert code == 2, err
    assert "a folder" in err and "dduf pack" in err, err


def test_info_of_a_folder_is_0(capsys) -> None:
    assert run_cli(capsys, "info", str(TINY_SD))[0] == 0


# --- the input refused: 1 --------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["validate", "refs", "unpack"])
def test_a_safetensors_file_is_refused_with_1(capsys, tmp_path, command) -> None:
    extra = ["-o", str(tmp_path / "out")] if command == "unpack" else []
    code, out, err = run_cli(capsys, command, str(TINY_SD / "vae" / "diffusion_pytorch_model.safetensors"), *extra)
    assert code == 1
    assert "single-file safetensors checkpoint" in out + err and "dduf pack FILE --base BASE" in out + err


def test_missing_input_is_2_for_every_reading_command(capsys, tmp_path) -> None:
    missing = str(tmp_path / "missing.dduf")
    for argv in (["validate", missing], ["info", missing], ["refs", missing],
                 ["unpack", missing, "-o", str(tmp_path / "o")], ["complete", missing, "-o", str(tmp_path / "f.dduf")],
                 ["compress", missing], ["decompress", missing + ".zst"]):
        assert run_cli(capsys, *argv)[0] == 2, argv


# --- log lines once ----------------------------------------------------------------------------------------
def test_a_library_log_line_is_printed_once(tmp_path: Path) -> None:
    """huggingface_hub adds its own stderr handler and propagates: every retry line came out twice."""
    script = (
        "import logging, sys\n"
        "import huggingface_hub\n"
        "import dduf_plus.cli.info as info\n"
        "def run(args):\n"
        "    logging.getLogger('huggingface_hub.utils._http').warning('Retrying in 1s [Retry 1/5].')\n"
        "    logging.getLogger('huggingface_hub.utils._http').warning('second \\x1b[31m line')\n"
        "    logging.getLogger('dduf_plus.x').warning('ours')\n"
        "    return 0\n"
        "info.run = run\n"
        "from dduf_plus.cli import main\n"
        "sys.exit(main(['info', 'x']))\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines.count("Retrying in 1s [Retry 1/5].") == 1, lines
    assert lines.count("ours") == 1, lines
    assert "\x1b" not in proc.stderr  # the library's handler escapes like ours


def test_every_error_class_maps_to_its_row() -> None:
    from dduf_plus.assignments import DDUFNameError, LoadNameError, PackNameError, ReferenceNameError
    from dduf_plus.cli import EXIT_INVALID, EXIT_USAGE, exit_code
    from dduf_plus.errors import (
        DDUFError,
        DDUFFormatError,
        DDUFIntegrityError,
        DDUFIOError,
        DDUFLoadError,
        DDUFNotFoundError,
        DDUFPackError,
        DDUFReferenceError,
        DDUFUsageError,
        DDUFValidationError,
    )
    from dduf_plus.remote.hub import HubSourceNotFoundError

    usage_or_io = [DDUFUsageError("x"), DDUFIOError("x"), DDUFNotFoundError("x"), DDUFNameError("x"),
                   PackNameError("x"), ReferenceNameError("x"), LoadNameError("x"), HubSourceNotFoundError("x"),
                   OSError("disk full")]
    refused = [DDUFError("x"), DDUFFormatError("x"), DDUFIntegrityError("x"), DDUFValidationError("f", []),
               DDUFPackError("x"), DDUFReferenceError("x"), DDUFLoadError("x")]
    assert [exit_code(e) for e in usage_or_io] == [EXIT_USAGE] * len(usage_or_io)
    assert [exit_code(e) for e in refused] == [EXIT_INVALID] * len(refused)
    assert (EXIT_INVALID, EXIT_USAGE) == (1, 2)


def test_refs_does_not_promise_a_download_from_an_unreachable_hub(capsys, tmp_path, unreachable_hub) -> None:
    from dduf_plus.packing.partial import pack_partial

    archive = tmp_path / "hubref.dduf"
    pack_partial(TINY_SD, archive, exclude=["vae"], refs={"*": "org/base@v1"}, quiet=True)
    code, out, _ = run_cli(capsys, "refs", str(archive))
    assert code == 1, out  # was 0: "will be downloaded from the Hub when loaded"
    assert "UNRESOLVED" in out and "hub download: the Hub cannot be reached (connection refused" in out
