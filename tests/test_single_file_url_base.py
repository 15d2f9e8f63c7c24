"""A hosted ``.dduf`` (a URL) as BASE of a single-file pack: only its directory, index and JSON entries are read
(range requests on 127.0.0.1); the components the file holds are stored (comparing them would download BASE's
weights), the rest referenced to the URL, fetched by range reads when loaded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from servers import FileServer  # noqa: E402
from single_file_ckpt import checkpoint_from_pipeline  # noqa: E402

from conftest import PIPELINES  # noqa: E402
from dduf_plus.errors import DDUFPackError  # noqa: E402
from dduf_plus.packing.single_file import pack_single_file  # noqa: E402
from dduf_plus.storage.http_range import SUFFIX_BYTES  # noqa: E402

TINY_SD = PIPELINES / "tiny-sd"


def _save(state: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    save_file(state, path)
    return path


@pytest.fixture
def served(tmp_path: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch, packed: dict[str, Path]):
    """tiny-sd.dduf served on 127.0.0.1 (online for this test: HF_HUB_OFFLINE also keeps URLs from being read)."""
    import shutil

    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("DDUF_PLUS_ALLOW_PRIVATE_URLS", "1")  # the test server is on loopback
    www = tmp_path / "www"
    www.mkdir()
    shutil.copy(packed["tiny-sd"], www / "base.dduf")
    with FileServer(www) as server:
        yield server, server.url("base.dduf")


def test_single_file_against_a_hosted_base(served, tmp_path: Path) -> None:
    import diffusers

    from dduf_plus import load_dduf

    server, url = served
    ckpt = _save(checkpoint_from_pipeline(TINY_SD, "v1", unet_delta=0.01, components=("unet",)),
                 tmp_path / "unet.safetensors")
    out = tmp_path / "hosted.dduf"
    server.reset()
    _result, partial = pack_single_file(ckpt, out, base=url, quiet=True)
    refs = partial.references
    assert set(refs) == {"vae", "text_encoder", "tokenizer", "scheduler"}
    assert all(r["pretrained_model_name_or_path"] == url for r in refs.values())
    assert "unet: converted" in "\n".join(partial.report) and "not compared: BASE is hosted" in "\n".join(partial.report)
    # per open of the hosted archive (BASE's, then one per reference checked against its records) its opening
    # suffix range (directory, index; in this 1.3 MB archive part of the weights too) and the JSON entries
    opens = 1 + len(refs)
    assert server.body_bytes < opens * (SUFFIX_BYTES + (64 << 10)), (server.body_bytes, server.range_headers)
    assert 1 <= server.range_headers.count(f"bytes=-{SUFFIX_BYTES}") <= opens  # fewer when a remote open is reused
    ours = load_dduf(out)
    base = load_dduf(server.root / "base.dduf")  # a UNet-only file: diffusers needs the other models given
    theirs = diffusers.StableDiffusionPipeline.from_single_file(
        str(ckpt), config=str(TINY_SD), torch_dtype=torch.float32, local_files_only=True,
        text_encoder=base.text_encoder, vae=base.vae)
    for name in ("unet", "vae", "text_encoder"):
        mine, other = getattr(ours, name).state_dict(), getattr(theirs, name).state_dict()
        assert mine.keys() == other.keys() and all(torch.equal(mine[k], other[k]) for k in mine), name


def test_hosted_base_offline_and_of_another_family_are_refused(served, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    server, url = served
    ckpt = _save(checkpoint_from_pipeline(TINY_SD, "v1", unet_delta=0.01, components=("unet",)),
                 tmp_path / "unet.safetensors")
    server.reset()
    with pytest.raises(DDUFPackError, match="HF_HUB_OFFLINE / local_files_only forbids"):
        pack_single_file(ckpt, tmp_path / "x.dduf", base=url, quiet=True, local_files_only=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DDUFPackError, match="HF_HUB_OFFLINE / local_files_only forbids"):
        pack_single_file(ckpt, tmp_path / "x.dduf", base=url, quiet=True)
    assert server.gets == server.heads == 0
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    ckpt = _save({"model.diffusion_model.joint_blocks.37.x_block.mlp.fc1.weight": torch.zeros(2)},
                 tmp_path / "sd35.safetensors")
    with pytest.raises(DDUFPackError, match="StableDiffusionPipeline"):
        pack_single_file(ckpt, tmp_path / "x.dduf", base=url, quiet=True)
    assert not (tmp_path / "x.dduf").exists()
