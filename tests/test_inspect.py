"""inspect_dtypes(): saved precision from headers only, for archives, folders and (mocked) Hub repos."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from dduf_plus.errors import DDUFError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.safetensors_header import read_safetensors_header
from dduf_plus.inspection import inspect_dtypes
from dduf_plus.storage.source import LocalSource

ROOT = Path(__file__).resolve().parent.parent


def test_folder_reports_saved_precisions(pipelines_dir):
    sd = inspect_dtypes(pipelines_dir / "tiny-sd")
    assert set(sd) == {"unet", "vae", "text_encoder"}  # tokenizer/scheduler have no weights; nulls skipped
    assert {k: v["dtype"] for k, v in sd.items()} == {"unet": "float16", "vae": "float32", "text_encoder": "float32"}
    unet = sd["unet"]
    assert unet["dtypes"] == {"float16": unet["bytes"]} and unet["parameters"] * 2 == unet["bytes"]
    assert inspect_dtypes(pipelines_dir / "tiny-sd", variant="fp16")["vae"]["dtype"] == "float16"
    assert inspect_dtypes(str(pipelines_dir / "tiny-dit"))["transformer"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-sd-finetune", "tiny-dit"])
@pytest.mark.parametrize("variant", [None, "fp16"])
def test_archive_agrees_with_folder_and_index(packed, pipelines_dir, tmp_path, name, variant):
    from dduf_plus.errors import DDUFPackError
    from dduf_plus.format.pack import pack_folder

    if (name, variant) == ("tiny-dit", "fp16"):  # no fp16 weights anywhere: refused, as the loader refuses it
        with pytest.raises(DDUFPackError, match="no component .* variant 'fp16'"):
            pack_folder(pipelines_dir / name, tmp_path / "v.dduf", variant=variant, quiet=True)
        return
    path = packed[name] if variant is None else pack_folder(pipelines_dir / name, tmp_path / "v.dduf",
                                                            variant=variant, quiet=True).path
    from_archive = inspect_dtypes(path, variant=variant)
    assert from_archive == inspect_dtypes(pipelines_dir / name, variant=variant)
    with DDUFArchive(path) as archive:
        for comp, found in from_archive.items():
            record = archive.index["components"][comp]
            summary = record.get("variants", {}).get(variant, record["summary"]) if variant else record["summary"]
            assert found == {k: summary[k] for k in ("dtype", "dtypes", "parameters", "bytes")}


def test_imports_no_torch(pipelines_dir, packed):
    code = ("import sys; from dduf_plus.inspection import inspect_dtypes; "
            f"inspect_dtypes({str(pipelines_dir / 'tiny-sd')!r}); inspect_dtypes({str(packed['tiny-sd'])!r}); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_pickle_only_components_are_left_out(pipelines_dir, tmp_path):
    folder = tmp_path / "p"
    shutil.copytree(pipelines_dir / "tiny-sd", folder)
    for f in (folder / "vae").glob("*.safetensors"):
        f.unlink()
    (folder / "vae" / "diffusion_pytorch_model.bin").write_bytes(b"pickle")
    assert set(inspect_dtypes(folder)) == {"unet", "text_encoder"}


def test_errors_are_ddu_errors(tmp_path):
    with pytest.raises(DDUFError, match="model_index.json"):
        inspect_dtypes(tmp_path)
    with pytest.raises(DDUFError):
        inspect_dtypes(tmp_path / "missing.dduf")
    with pytest.raises(DDUFError, match="not a .dduf archive"):
        inspect_dtypes("./no/such/place")
    broken = tmp_path / "b"
    shutil.copytree(ROOT / "fixtures" / "pipelines" / "tiny-dit", broken)
    (broken / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(DDUFError, match="not a valid safetensors"):
        inspect_dtypes(broken)


# --- the Hub, mocked ---------------------------------------------------------------------------------
def _fake_hub(folder: Path):
    """list_repo_files / hf_hub_download / parse_safetensors_file_metadata answered from a local folder."""
    from huggingface_hub.utils import SafetensorsFileMetadata, TensorInfo

    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    asked: list[tuple[str, str, str | None, object]] = []

    def list_repo_files(self, repo_id, *, revision=None, repo_type=None, token=None):
        asked.append(("list", repo_id, revision, token))
        return files

    def hf_hub_download(self, repo_id, filename, *, revision=None, token=None, **kwargs):
        asked.append(("download", filename, revision, token))
        return str(folder / filename)

    def parse_safetensors_file_metadata(self, repo_id, filename, *, revision=None, token=None, **kwargs):
        asked.append(("metadata", filename, revision, token))
        with LocalSource(folder / filename) as source:
            header, _ = read_safetensors_header(source.read_at, 0, source.size, filename)
        tensors = {
            n: TensorInfo(dtype={"float16": "F16", "float32": "F32", "bfloat16": "BF16"}[t.dtype],
                          shape=list(t.shape), data_offsets=(t.begin, t.end))
            for n, t in header.tensors.items()
        }
        return SafetensorsFileMetadata(metadata=header.metadata or {}, tensors=tensors)

    patches = [
        mock.patch("huggingface_hub.HfApi.list_repo_files", list_repo_files),
        mock.patch("huggingface_hub.HfApi.hf_hub_download", hf_hub_download),
        mock.patch("huggingface_hub.HfApi.parse_safetensors_file_metadata", parse_safetensors_file_metadata),
    ]
    return patches, asked


@pytest.mark.parametrize("variant", [None, "fp16"])
def test_hub_repo_reads_only_headers(pipelines_dir, variant):
    patches, asked = _fake_hub(pipelines_dir / "tiny-sd")
    with patches[0], patches[1], patches[2]:
        found = inspect_dtypes("someone/tiny-sd", variant=variant, revision="main", token="hf_x")
    assert found == inspect_dtypes(pipelines_dir / "tiny-sd", variant=variant)
    assert all(rev == "main" and token == "hf_x" for _, _, rev, token in asked)
    fetched = [name for kind, name, _, _ in asked if kind == "download"]
    assert fetched == ["model_index.json"]  # the only file downloaded; weights: headers by range request
    headers = sorted(name for kind, name, _, _ in asked if kind == "metadata")
    vae = "vae/diffusion_pytorch_model.fp16.safetensors" if variant else "vae/diffusion_pytorch_model.safetensors"
    assert headers == sorted([
        "text_encoder/model.safetensors",
        "unet/diffusion_pytorch_model-00001-of-00002.safetensors",
        "unet/diffusion_pytorch_model-00002-of-00002.safetensors",
        vae,
    ])


def test_hub_repo_holding_one_dduf_file():
    with mock.patch("huggingface_hub.HfApi.list_repo_files", return_value=["README.md", "model.dduf"]), \
            mock.patch("dduf_plus.inspection._from_archive", return_value={"unet": "x"}) as from_archive:
        assert inspect_dtypes("someone/repo", revision="v1", token="hf_y") == {"unet": "x"}
    from_archive.assert_called_once_with("hf://someone/repo@v1/model.dduf", None, token="hf_y")


def test_hub_errors_become_ddu_errors():
    from huggingface_hub.errors import RepositoryNotFoundError

    response = mock.Mock(status_code=404, headers={}, url="https://huggingface.co/api/models/x/y")
    error = RepositoryNotFoundError("404 repo not found", response=response)
    with mock.patch("huggingface_hub.HfApi.list_repo_files", side_effect=error):
        with pytest.raises(DDUFError, match="x/y"):
            inspect_dtypes("x/y")
    with mock.patch("huggingface_hub.HfApi.list_repo_files", side_effect=ConnectionError("offline")):
        with pytest.raises(DDUFError, match="cannot reach the Hub"):
            inspect_dtypes("x/y")
    with mock.patch("huggingface_hub.HfApi.list_repo_files", return_value=["a.dduf", "b.dduf"]):
        with pytest.raises(DDUFError, match="2 .dduf files"):
            inspect_dtypes("x/y")
