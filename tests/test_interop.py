"""Every existing reader accepts what we write: huggingface_hub, zipfile, unzip, the npm checker,
and diffusers loads what `unpack` recreates with the same outputs as the source folder."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
import safetensors.torch
import torch
from huggingface_hub import read_dduf_file as hub_read_dduf_file

from conftest import FIXTURE_NAMES, PIPELINES, npm_available, npm_check
from dduf_plus.format.unpack import unpack


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_huggingface_hub_reads_it(packed, name):
    entries = hub_read_dduf_file(packed[name])
    assert "model_index.json" in entries
    for entry_name, entry in entries.items():
        if entry_name.endswith(".safetensors"):
            with entry.as_mmap() as mm:
                got = safetensors.torch.load(mm)
            expected = safetensors.torch.load_file(PIPELINES / name / entry_name)
            assert all(torch.equal(got[k], v) for k, v in expected.items())


@pytest.mark.skipif(shutil.which("unzip") is None, reason="unzip not installed")
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_unzip_t_passes(packed, name):
    result = subprocess.run(["unzip", "-t", str(packed[name])], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No errors detected" in result.stdout


@pytest.mark.skipif(not npm_available(),
                    reason="node or @huggingface/dduf not installed (.ci/run installs it when npm exists)")
@pytest.mark.parametrize("name", ["tiny-sd", "tiny-sd-finetune"])
def test_npm_checker_accepts_it(packed, name):
    # tiny-dit ships spiece.model: the npm checker (0.0.2) rejects .model entries (see rule D009)
    result = npm_check(packed[name])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)[0] == "model_index.json"


def run_pipeline(pipe) -> np.ndarray:
    kwargs = {"num_inference_steps": 2, "output_type": "np", "height": 32, "width": 32,
              "generator": torch.Generator("cpu").manual_seed(0)}
    if "PixArt" in type(pipe).__name__:
        kwargs.update(use_resolution_binning=False, clean_caption=False)
    return pipe("a red square", **kwargs).images


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-dit"])
def test_unpacked_folder_loads_in_diffusers_like_the_source(packed, tmp_path, name):
    from diffusers import DiffusionPipeline

    unpack(packed[name], tmp_path / "out")
    original = DiffusionPipeline.from_pretrained(PIPELINES / name, dtype=torch.float32)
    restored = DiffusionPipeline.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert np.array_equal(run_pipeline(original), run_pipeline(restored))
