"""Commands print nothing from other libraries unless asked (``-v``): torchao's extension notices, torch's
pytree deprecations, diffusers' torchao and dtype notices, bitsandbytes' and sdnq's kernel lookups. And the
single-file pack report is printed once (it came out on stdout and again on stderr). Run as a user runs
them: ``python -m dduf_plus.cli`` in a subprocess, stderr captured."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import PIPELINES, ROOT
from dduf_plus.cli.quiet import OwnRecordsOnly, quiet_other_libraries

# lines other libraries printed during `dduf pack --quantize unet=torchao-int8` before
NOTICES = ("Failed to load", "_pytree.py", "Unable to import `torchao`", "Overriding `torch_dtype`", "SDNQ:",
           "bitsandbytes", "FutureWarning", "UserWarning")


def dduf(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "dduf_plus.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=600)


def test_the_root_handler_keeps_our_records_and_others_errors() -> None:
    keep = OwnRecordsOnly()

    def record(name: str, level: int) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, "m", None, None)

    assert keep.filter(record("dduf_plus.packing.partial", logging.INFO))
    assert keep.filter(record("dduf_plus", logging.WARNING))
    assert not keep.filter(record("torchao", logging.WARNING))
    assert not keep.filter(record("dduf_plus_other", logging.WARNING))  # a prefix is not our package
    assert keep.filter(record("bitsandbytes", logging.ERROR))
    assert keep.filter(record("huggingface_hub.utils._http", logging.WARNING))  # "Retrying in 1s": the user's request


def test_verbose_leaves_everything_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    handler = logging.StreamHandler()
    for name in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.delenv(name, raising=False)
    with warnings.catch_warnings():
        quiet_other_libraries(handler, verbose=1)
        assert handler.filters == [] and "DIFFUSERS_VERBOSITY" not in os.environ
        monkeypatch.setenv("DIFFUSERS_VERBOSITY", "info")  # the user's own setting wins
        quiet_other_libraries(handler, verbose=0)
        assert os.environ["DIFFUSERS_VERBOSITY"] == "info" and os.environ["TRANSFORMERS_VERBOSITY"] == "error"
        assert any(isinstance(f, OwnRecordsOnly) for f in handler.filters)


def test_quantized_pack_prints_no_library_notices_unless_verbose(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    argv = ("pack", str(PIPELINES / "tiny-sd"), "-o", str(tmp_path / "q.dduf"), "--force", "--quantize",
            "unet=torchao-int8")
    loud = dduf("-v", *argv)
    assert loud.returncode == 0, loud.stderr[-2000:]
    heard = [n for n in NOTICES if n in loud.stderr]
    if not heard:
        pytest.skip("the libraries installed here print nothing on this command, even with -v")
    quiet = dduf(*argv)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert [n for n in NOTICES if n in quiet.stderr] == [], quiet.stderr
    assert quiet.stdout.rstrip().splitlines()[-1].startswith("wrote ")


def test_single_file_report_is_printed_once(tmp_path: Path) -> None:
    from single_file_ckpt import checkpoint_from_pipeline, raw_tensors, write_raw

    ckpt = write_raw(tmp_path / "sd.safetensors",
                     raw_tensors(checkpoint_from_pipeline(PIPELINES / "tiny-sd", "v1", unet_delta=0.01)))
    run = dduf("pack", str(ckpt), "--base", str(PIPELINES / "tiny-sd"), "-o", str(tmp_path / "sf.dduf"))
    assert run.returncode == 0, run.stderr[-2000:]
    both = run.stdout + run.stderr
    for line in ("detected SD 1.x (v1)", "unet: converted", "bytes saved:"):
        assert both.count(line) == 1, both
    assert [n for n in NOTICES if n in run.stderr] == [], run.stderr
