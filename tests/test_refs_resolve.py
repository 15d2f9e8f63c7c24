"""Resolving references on this machine: a fake Hugging Face cache (blobs named like the Hub names them,
snapshot symlinks, refs/main) built in a temp dir, offline. Every resolved file is verified by content."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest
from hfcache import TINY_SD, cached, corrupted_copy, count_hashing
from servers import count_connects

from dduf_plus.cli import main as cli_main
from dduf_plus.errors import DDUFReferenceError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.format.pack import pack_folder
from dduf_plus.loading.files import resolve_component
from dduf_plus.packing.partial import pack_partial
from dduf_plus.refs import cache as refs_cache
from dduf_plus.refs.resolve import locate_component

EXTERNAL = ["scheduler", "text_encoder", "tokenizer", "vae"]



@pytest.fixture
def partial(tmp_path: Path, hf_env: Path) -> Path:
    """tiny-sd with everything but the unet referenced to the Hub repo org/tiny-sd."""
    out = tmp_path / "partial.dduf"
    pack_partial(TINY_SD, out, exclude=EXTERNAL, refs={"*": "org/tiny-sd"}, quiet=True)
    refs_cache._VERIFIED.clear()  # a fresh process: forget the hashes packing remembered
    return out


def references(path: Path) -> dict:
    with DDUFArchive(path) as archive:
        return archive.references


def new_process() -> None:
    """What a second Python process sees: only what the verified-hash file on disk remembers."""
    refs_cache._VERIFIED.clear()


def test_found_in_cache_by_repo_and_hashed_once(partial: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snap = cached(hf_env)
    refs = references(partial)
    hashed = count_hashing(monkeypatch)
    loc = locate_component("text_encoder", refs["text_encoder"])
    assert loc.how == "hf cache" and loc.verified
    assert loc.folder == snap / "text_encoder"  # exactly the recorded files: served in place
    # blobs already named by their sha256 are still hashed, once
    assert len(hashed) == len(refs["text_encoder"]["files"])
    new_process()
    hashed.clear()
    again = locate_component("text_encoder", refs["text_encoder"])
    assert again.verified and hashed == []  # a second load rehashes nothing (stat-keyed memory)


def test_extra_files_are_hidden_behind_a_view(partial: Path, hf_env: Path) -> None:
    cached(hf_env)
    loc = locate_component("vae", references(partial)["vae"])
    # the cached vae/ also holds the fp16 variant, which the reference does not vouch for
    assert sorted(p.name for p in loc.folder.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert loc.folder.name == "vae"


def test_content_under_another_repo_name_is_found(partial: Path, hf_env: Path) -> None:
    cached(hf_env, repo="someone-else/renamed-copy")
    refs = references(partial)
    for name in EXTERNAL:
        loc = locate_component(name, refs[name])
        assert loc.how == "hf cache by content" and loc.verified
        assert sorted(p.name for p in loc.folder.iterdir()) == sorted(refs[name]["files"])
        for fname in refs[name]["files"]:
            assert "models--someone-else--renamed-copy/blobs" in str((loc.folder / fname).resolve())


def test_wrong_content_under_the_right_name_is_refused(tmp_path: Path, partial: Path, hf_env: Path, caplog) -> None:
    cached(hf_env, corrupted_copy(tmp_path, "text_encoder", "model.safetensors"))
    ref = references(partial)["text_encoder"]
    with pytest.raises(DDUFReferenceError) as err:
        locate_component("text_encoder", ref)
    message = str(err.value)
    assert "'text_encoder'" in message and "text_encoder/model.safetensors" in message
    assert "org/tiny-sd" in message and "sha256" in message and "differs" in message
    # verify=False: used, with a warning (the hash is known now, so no hashing is needed to tell)
    with caplog.at_level(logging.WARNING, logger="dduf_plus"):
        loc = locate_component("text_encoder", ref, verify=False)
    assert loc.how == "hf cache" and not loc.verified
    assert any("model.safetensors" in r.getMessage() and "verify=False" in r.getMessage() for r in caplog.records)


def test_wrong_copy_is_skipped_for_a_right_one_elsewhere(tmp_path: Path, partial: Path, hf_env: Path, caplog) -> None:
    cached(hf_env, corrupted_copy(tmp_path, "vae", "diffusion_pytorch_model.safetensors"))
    cached(hf_env, repo="mirror/tiny-sd")
    with caplog.at_level(logging.WARNING, logger="dduf_plus"):
        loc = locate_component("vae", references(partial)["vae"])
    assert loc.how == "hf cache by content" and loc.verified
    assert any("refused" in r.getMessage() for r in caplog.records)


def test_nothing_available_offline_fails_fast(partial: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("must not try the network offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)  # a back-off before giving up would be a wait
    attempts = count_connects(monkeypatch)
    with pytest.raises(DDUFReferenceError) as err:
        locate_component("text_encoder", references(partial)["text_encoder"])
    assert attempts == [] and slept == []  # fails at once: no connection tried, no retry waited for
    message = str(err.value)
    assert "'text_encoder'" in message and "org/tiny-sd" in message
    assert "HF_HUB_OFFLINE" in message and "hf download org/tiny-sd" in message and "refs=" in message


def test_local_files_only_never_downloads(partial: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("downloaded"))
    with pytest.raises(DDUFReferenceError, match="local_files_only"):
        locate_component("vae", references(partial)["vae"], local_files_only=True)


def test_download_fetches_only_the_component(partial: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setenv("DDUF_PLUS_HUB_PROBE", "0")  # huggingface_hub is mocked below: no real Hub to probe
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []

    def fake_download(repo_id, *, revision=None, allow_patterns=None, cache_dir=None, token=None, **kw):
        calls.append((repo_id, revision, sorted(allow_patterns), token))
        files = {p: TINY_SD / p for p in allow_patterns}
        return str(cached(hf_env, repo=repo_id, files=files))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    loc = locate_component("vae", references(partial)["vae"], token="hf_x")
    assert loc.how == "hub download" and loc.verified
    assert calls == [("org/tiny-sd", None, ["vae/config.json", "vae/diffusion_pytorch_model.safetensors"], "hf_x")]


def test_null_source_asks_for_the_component(tmp_path: Path, hf_env: Path) -> None:
    out = tmp_path / "p.dduf"
    pack_partial(TINY_SD, out, exclude=["vae"], quiet=True)
    with pytest.raises(DDUFReferenceError, match=r"no recorded source: pass it to load_dduf\(\.\.\., vae=\.\.\.\)"):
        locate_component("vae", references(out)["vae"])


def test_recorded_local_folder(tmp_path: Path, hf_env: Path) -> None:
    out = tmp_path / "p.dduf"
    pack_partial(TINY_SD, out, exclude=["text_encoder"], refs={"*": str(TINY_SD)}, quiet=True)
    loc = locate_component("text_encoder", references(out)["text_encoder"])
    assert loc.how == "recorded folder" and loc.folder == TINY_SD / "text_encoder" and loc.verified


def test_overrides(tmp_path: Path, partial: Path, hf_env: Path) -> None:
    ref = references(partial)["vae"]
    loc = locate_component("vae", ref, refs={"vae": str(TINY_SD)})  # a pipeline folder
    assert loc.how == "override" and loc.verified
    loc = locate_component("vae", ref, refs={"*": str(TINY_SD / "vae")})  # the component folder itself
    assert loc.how == "override" and loc.verified
    full = pack_folder(TINY_SD, tmp_path / "full.dduf", quiet=True).path
    loc = locate_component("vae", ref, refs={"vae": str(full)})  # another archive
    assert loc.archive == full and loc.member == "vae" and loc.verified
    # an override is the only source tried: a wrong one fails even though nothing else was asked
    bad = corrupted_copy(tmp_path, "vae", "diffusion_pytorch_model.safetensors")
    with pytest.raises(DDUFReferenceError, match="vae/diffusion_pytorch_model.safetensors from override"):
        locate_component("vae", ref, refs={"vae": str(bad)})
    bad_archive = pack_folder(bad, tmp_path / "bad.dduf", quiet=True).path
    with pytest.raises(DDUFReferenceError, match="entry vae/diffusion_pytorch_model.safetensors"):
        locate_component("vae", ref, refs={"vae": str(bad_archive)})


def test_small_files_known_only_by_git_id_are_verified(tmp_path: Path, hf_env: Path) -> None:
    folder = tmp_path / "no-te"
    shutil.copytree(TINY_SD, folder)
    shutil.rmtree(folder / "text_encoder")
    cached(hf_env)
    out = tmp_path / "p.dduf"
    pack_partial(folder, out, exclude=["text_encoder"], refs={"*": "org/tiny-sd"}, quiet=True)
    ref = references(out)["text_encoder"]
    assert locate_component("text_encoder", ref).verified
    ref["files"]["config.json"]["git_sha1"] = "0" * 40
    with pytest.raises(DDUFReferenceError, match="git blob sha1"):
        locate_component("text_encoder", ref)


def test_resolve_component_gives_component_files(tmp_path: Path, partial: Path, hf_env: Path) -> None:
    import dduf_plus.loading.files as files_mod
    cached(hf_env)
    refs = references(partial)
    files = resolve_component("vae", refs["vae"])
    assert isinstance(files, files_mod.FolderComponentFiles) and files.name == "vae"
    assert files.listdir() == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert files.read_json("config.json")["_class_name"] == "AutoencoderKL"
    full = pack_folder(TINY_SD, tmp_path / "full.dduf", quiet=True).path
    from_archive = resolve_component("vae", refs["vae"], refs={"*": str(full)})
    assert isinstance(from_archive, files_mod.ArchiveComponentFiles)
    assert from_archive.read_json("config.json") == files.read_json("config.json")


def test_partial_archive_loads_like_the_full_folder(partial: Path, hf_env: Path) -> None:
    """The issue's main claim: partial archive + cache -> the same images as the pipeline folder."""
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    from dduf_plus.loading.pipeline import load_dduf

    cached(hf_env)

    def run(pipe):
        return pipe("a photo of a cat", num_inference_steps=2, height=32, width=32, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    pipe = load_dduf(partial, torch_dtype=torch.float32)
    got = run(pipe)
    want = run(DiffusionPipeline.from_pretrained(TINY_SD, dtype=torch.float32))
    assert np.array_equal(got, want)


def test_cli_refs(partial: Path, hf_env: Path, capsys) -> None:
    assert cli_main(["refs", str(partial), "--json"]) == 1  # nothing cached yet, offline
    rows = json.loads(capsys.readouterr().out)["references"]
    assert {r["component"]: r["status"] for r in rows} == dict.fromkeys(EXTERNAL, "unresolved")
    cached(hf_env, repo="mirror/other-name")
    assert cli_main(["refs", str(partial), "--json", "--verify"]) == 0
    rows = json.loads(capsys.readouterr().out)["references"]
    assert all(r["status"] == "ok" and r["how"] == "hf cache by content" and r["verified"] for r in rows)
    assert cli_main(["refs", str(partial)]) == 0
    text = capsys.readouterr().out
    assert "4 references" in text and "[verified]" in text
