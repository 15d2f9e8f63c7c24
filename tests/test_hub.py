"""The Hub, with the real huggingface_hub client against tests/hub_server.py on 127.0.0.1:
``load_dduf(repo_id, dduf_file=...)``, ``dduf pack org/repo``, their errors and offline behaviour."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
from servers import count_connects

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hub_server import HubServer, folder_files  # noqa: E402

from dduf_plus.errors import DDUFNotFoundError, DDUFPackError, DDUFUsageError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "fixtures" / "pipelines"
PROMPT = "a photo of a cat sitting on a mat"


@pytest.fixture(scope="module")
def hub_archives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from dduf_plus.format.pack import pack_folder

    out = tmp_path_factory.mktemp("hub-archives")
    return {n: pack_folder(PIPELINES / n, out / f"{n}.dduf", quiet=True).path for n in ("tiny-sd", "tiny-dit")}


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hub_archives: dict[str, Path]):
    """A Hub on 127.0.0.1 (huggingface_hub pointed at it, online) with an empty HF cache and dduf_plus cache."""
    import huggingface_hub.constants as constants

    server = HubServer()
    sd = hub_archives["tiny-sd"].read_bytes()
    server.add("dduf-org/tiny-sd-dduf", {"tiny-sd.dduf": sd, "README.md": b"# tiny sd\n"})
    server.add("dduf-org/tiny-sd-dduf", {"tiny-sd.dduf": sd, "README.md": b"# v2\n", "extra.txt": b"x"}, branch="v2")
    server.add("dduf-org/two", {"a.dduf": sd, "b.dduf": hub_archives["tiny-dit"].read_bytes()})
    server.add("dduf-org/none", {"README.md": b"nothing\n"})
    folder = folder_files(PIPELINES / "tiny-sd")
    junk = {"unet/diffusion_pytorch_model.bin": b"pickle" * 100, "sample.png": b"\x89PNG" + b"0" * 100,
            "text_encoder/flax_model.msgpack": b"f" * 100, "vae/model.onnx": b"o" * 100,
            "safety_checker/config.json": b"{}", "unet/NOTES.md": b"n", "unet/.hidden.json": b"{}"}
    server.add("diffusers-org/tiny-sd", {**folder, **junk})
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "dduf-cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with server:
        yield server


def go_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run(pipe):
    import torch

    pipe.set_progress_bar_config(disable=True)
    return pipe(PROMPT, num_inference_steps=2, output_type="np", height=32, width=32,
                generator=torch.Generator().manual_seed(0)).images


# --- hub_archive ------------------------------------------------------------------------------------------
def test_hub_archive_downloads_into_the_hf_cache(hub: HubServer, hub_archives: dict[str, Path]) -> None:
    from dduf_plus.remote.hub import hub_archive

    path = hub_archive("dduf-org/tiny-sd-dduf", "tiny-sd.dduf")
    assert path.read_bytes() == hub_archives["tiny-sd"].read_bytes()
    blob = Path(os.path.realpath(path))
    assert blob.parent.name == "blobs" and blob.name == hashlib.sha256(path.read_bytes()).hexdigest()
    assert hub.downloads() == ["tiny-sd.dduf"]


def test_one_archive_needs_no_file_name(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from dduf_plus.remote.hub import hub_archive

    online = hub_archive("dduf-org/tiny-sd-dduf")
    assert online.name == "tiny-sd.dduf"
    hub.reset()
    go_offline(monkeypatch)
    assert hub_archive("dduf-org/tiny-sd-dduf") == online  # listed from the cached snapshot
    assert hub.requests == []


@pytest.mark.parametrize("repo, file, error, words", [
    ("dduf-org/missing", "x.dduf", DDUFNotFoundError, ["no Hub repo dduf-org/missing"]),
    ("dduf-org/tiny-sd-dduf", "nope.dduf", DDUFNotFoundError, ["has no file nope.dduf"]),
    ("dduf-org/two", None, DDUFUsageError, ["2 .dduf files", "a.dduf", "b.dduf", "dduf_file="]),
    ("dduf-org/none", None, DDUFUsageError, ["no .dduf file", "README.md"]),
    ("dduf-org/tiny-sd-dduf", "notes.txt", DDUFUsageError, ["not a .dduf file name"]),
])
def test_hub_archive_errors(hub: HubServer, repo: str, file: str | None, error: type, words: list[str]) -> None:
    from dduf_plus.remote.hub import hub_archive

    with pytest.raises(error) as info:
        hub_archive(repo, file)
    for w in words:
        assert w in str(info.value)


def test_missing_revision_and_offline_uncached(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from dduf_plus.remote.hub import hub_archive

    with pytest.raises(DDUFNotFoundError, match="has no revision 'v9'"):
        hub_archive("dduf-org/tiny-sd-dduf", "tiny-sd.dduf", revision="v9")
    go_offline(monkeypatch)
    hub.reset()
    for file in ("tiny-sd.dduf", None):
        with pytest.raises(DDUFNotFoundError, match="offline|not in the Hugging Face cache"):
            hub_archive("dduf-org/tiny-sd-dduf", file)
    assert hub.requests == []


def test_unreachable_hub_is_a_clear_error(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    import huggingface_hub.constants as constants

    from dduf_plus.errors import DDUFError
    from dduf_plus.remote.hub import hub_archive

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}")
    attempts = count_connects(monkeypatch)
    with pytest.raises(DDUFError, match=r"not in the Hugging Face cache and the Hub cannot be reached \(connection refused"):
        hub_archive("dduf-org/tiny-sd-dduf")
    # with dduf_file, huggingface_hub retried for ~26 s before "cannot be reached": one connect now
    with pytest.raises(DDUFError, match=r"the Hub cannot be reached \(connection refused by 127.0.0.1"):
        hub_archive("dduf-org/tiny-sd-dduf", "tiny-sd.dduf")
    assert 1 <= len(attempts) <= 2, attempts  # one attempt per call, no retries


def test_revision_selects_the_branch(hub: HubServer) -> None:
    from dduf_plus.remote.hub import hub_archive, list_repo_files

    assert "extra.txt" in list_repo_files("dduf-org/tiny-sd-dduf", revision="v2")
    assert "extra.txt" not in list_repo_files("dduf-org/tiny-sd-dduf")
    assert hub_archive("dduf-org/tiny-sd-dduf", revision="v2").name == "tiny-sd.dduf"


# --- load_dduf(repo_id) -----------------------------------------------------------------------------------
def test_load_dduf_repo_equals_local_and_offline_makes_no_request(
        hub: HubServer, hub_archives: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from dduf_plus import load_dduf

    local = run(load_dduf(hub_archives["tiny-sd"]))
    remote = run(load_dduf("dduf-org/tiny-sd-dduf", dduf_file="tiny-sd.dduf"))
    np.testing.assert_array_equal(local, remote)
    assert hub.downloads() == ["tiny-sd.dduf"]
    go_offline(monkeypatch)
    hub.reset()
    again = run(load_dduf("dduf-org/tiny-sd-dduf", dduf_file="tiny-sd.dduf"))
    np.testing.assert_array_equal(local, again)
    assert run(load_dduf("dduf-org/tiny-sd-dduf", local_files_only=True)).shape == local.shape
    assert hub.requests == []


def test_local_path_wins_over_a_repo_id(hub: HubServer, hub_archives: dict[str, Path], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from dduf_plus import load_dduf
    from dduf_plus.loading.pipeline import _is_hub_repo

    (tmp_path / "dduf-org").mkdir()
    (tmp_path / "dduf-org" / "tiny-sd-dduf").write_bytes(hub_archives["tiny-sd"].read_bytes())
    monkeypatch.chdir(tmp_path)
    assert not _is_hub_repo("dduf-org/tiny-sd-dduf")  # the file exists here
    assert not _is_hub_repo("dduf-org/other")  # ./dduf-org exists: a missing path, not a repo
    assert not _is_hub_repo("org/x.dduf") and not _is_hub_repo("./a/b") and _is_hub_repo("org2/name")
    load_dduf("dduf-org/tiny-sd-dduf")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "x.dduf").write_bytes(hub_archives["tiny-sd"].read_bytes())
    load_dduf(tmp_path / "local", dduf_file="x.dduf")  # diffusers 0.35's folder + dduf_file
    with pytest.raises(DDUFUsageError, match="neither a local path nor a Hub repo id"):
        load_dduf("a/b/c", dduf_file="x.dduf")
    assert hub.requests == []
    with pytest.raises(DDUFNotFoundError):
        load_dduf("dduf-org/other")
    assert hub.requests == []


# --- dduf pack org/repo -----------------------------------------------------------------------------------
def test_pack_repo_downloads_only_what_it_stores(hub: HubServer, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from dduf_plus.cli import main

    out = tmp_path / "hub.dduf"
    assert main(["pack", "diffusers-org/tiny-sd", "-o", str(out), "-q"]) == 0
    fetched = set(hub.downloads())
    expected = {p for p in folder_files(PIPELINES / "tiny-sd") if "/" in p and not p.endswith("fp16.safetensors")}
    assert fetched == expected | {"model_index.json"}
    assert main(["pack", str(PIPELINES / "tiny-sd"), "-o", str(tmp_path / "local.dduf"), "-q"]) == 0
    assert out.read_bytes() == (tmp_path / "local.dduf").read_bytes()
    # offline, from the cache, no request; the same bytes
    go_offline(monkeypatch)
    hub.reset()
    assert main(["pack", "diffusers-org/tiny-sd", "-o", str(tmp_path / "offline.dduf"), "-q"]) == 0
    assert hub.requests == []
    assert (tmp_path / "offline.dduf").read_bytes() == out.read_bytes()


def test_pack_repo_variant_and_revision(hub: HubServer, tmp_path: Path) -> None:
    from dduf_plus.cli import main
    from dduf_plus.format.archive import DDUFArchive

    commit = hub.repos["diffusers-org/tiny-sd"].refs["main"]
    out = tmp_path / "fp16.dduf"
    assert main(["pack", f"diffusers-org/tiny-sd@{commit}", "-o", str(out), "--variant", "fp16", "-q"]) == 0
    assert "vae/diffusion_pytorch_model.fp16.safetensors" in hub.downloads()
    assert "vae/diffusion_pytorch_model.safetensors" not in hub.downloads()
    # no fp16 unet: its default weights, as from_pretrained(variant=) falls back
    assert "unet/diffusion_pytorch_model-00001-of-00002.safetensors" in hub.downloads()
    with DDUFArchive(out) as archive:
        assert archive.components["vae"].files == ("config.json", "diffusion_pytorch_model.fp16.safetensors")


def test_pack_repo_errors(hub: HubServer, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dduf_plus.cli import main
    from dduf_plus.remote.hub import pack_selection

    assert main(["pack", "diffusers-org/missing", "-o", str(tmp_path / "x.dduf")]) == 2
    assert "no Hub repo diffusers-org/missing" in capsys.readouterr().err
    assert main(["pack", "diffusers-org/tiny-sd@nope", "-o", str(tmp_path / "x.dduf")]) == 2
    assert "no revision 'nope'" in capsys.readouterr().err
    assert main(["pack", "diffusers-org/tiny-sd@../../x", "-o", str(tmp_path / "x.dduf")]) == 2
    assert "not a branch, tag or commit name" in capsys.readouterr().err
    assert main(["pack", "dduf-org/two", "-o", str(tmp_path / "x.dduf")]) == 2
    assert "no diffusers folder (no model_index.json); it holds a.dduf, b.dduf" in capsys.readouterr().err
    with pytest.raises(DDUFPackError, match="only pickle weights"):
        pack_selection(["unet/config.json", "unet/diffusion_pytorch_model.bin"], ["unet"], None)


# --- a reference into an archive on the Hub (hf://) ---------------------------------------------------------
def test_hf_url_reference_fetches_only_the_component(hub: HubServer, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from dduf_plus.packing import pack
    from dduf_plus.refs.resolve import locate_component

    url = "hf://dduf-org/tiny-sd-dduf/tiny-sd.dduf"
    _, partial = pack(PIPELINES / "tiny-sd-finetune", tmp_path / "ft.dduf", exclude=["vae"], refs={"vae": url},
                      quiet=True)
    ref = partial.references["vae"]
    assert ref["pretrained_model_name_or_path"] == url
    hub.reset()
    located = locate_component("vae", ref)
    assert located.verified and sorted(p.name for p in located.folder.iterdir()) == sorted(ref["files"])
    archive_size = hub.repos["dduf-org/tiny-sd-dduf"].commits[hub.repos["dduf-org/tiny-sd-dduf"].refs["main"]][
        "tiny-sd.dduf"].size
    vae = sum(r["size"] for r in ref["files"].values())
    # the component's bytes plus the opening read of the archive's end (512 KiB: end records, directory, index),
    # well short of the whole archive
    assert vae <= hub.body_bytes <= vae + 512 * 1024 + 64 * 1024 < archive_size, (hub.body_bytes, vae, archive_size)
    hub.reset()
    go_offline(monkeypatch)
    assert locate_component("vae", ref).verified  # by content from the cache
    assert hub.requests == []


def test_ref_to_a_hub_repo_pins_the_commit_and_resolves(hub: HubServer, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from dduf_plus.packing import pack
    from dduf_plus.refs.resolve import locate_component

    commit = hub.repos["diffusers-org/tiny-sd"].refs["main"]
    _, partial = pack(PIPELINES / "tiny-sd-finetune", tmp_path / "ft.dduf", exclude=["vae"],
                      refs={"vae": "diffusers-org/tiny-sd"}, quiet=True)
    ref = partial.references["vae"]
    assert ref["pretrained_model_name_or_path"] == "diffusers-org/tiny-sd" and ref["revision"] == commit
    hub.reset()
    located = locate_component("vae", ref)  # not cached: only the recorded files are downloaded
    assert located.how == "hub download" and located.verified
    assert sorted(hub.downloads()) == sorted(f"vae/{f}" for f in ref["files"])
    go_offline(monkeypatch)
    hub.reset()
    assert locate_component("vae", ref).how == "hf cache"
    assert hub.requests == []
