"""References into hosted archives (``--ref vae=http://127.0.0.1:PORT/base.dduf``): checked at pack time against
the hosted archive's records, fetched at load time as only that component's byte ranges, verified by the
referencing archive's sha256, cached by content (a second load makes no request); tampering is refused."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from servers import FileServer  # noqa: E402

from dduf_plus.errors import DDUFIntegrityError, DDUFPackError, DDUFReferenceError  # noqa: E402
from dduf_plus.storage.http_range import SUFFIX_BYTES  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "fixtures" / "pipelines"
PROMPT = "a photo of a cat sitting on a mat"


@pytest.fixture
def hosted(tmp_path: Path, hf_env: Path, monkeypatch: pytest.MonkeyPatch):
    """base.dduf (tiny-sd) served on 127.0.0.1; the fine-tune packed with its vae referenced there."""
    import huggingface_hub.constants as constants

    from dduf_plus.format.pack import pack_folder
    from dduf_plus.packing import pack

    # online (HF_HUB_OFFLINE / local_files_only also keep hosted archives from being fetched)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # the test server is on loopback, which a URL recorded in an archive may not reach by default
    monkeypatch.setenv("DDUF_PLUS_ALLOW_PRIVATE_URLS", "1")
    www = tmp_path / "www"
    www.mkdir()
    pack_folder(PIPELINES / "tiny-sd", www / "base.dduf", quiet=True)
    with FileServer(www) as server:
        url = server.url("base.dduf")
        result, partial = pack(PIPELINES / "tiny-sd-finetune", tmp_path / "ft.dduf", exclude=["vae"],
                               refs={"vae": url}, quiet=True)
        server.reset()
        yield server, url, tmp_path / "ft.dduf", partial


def run(pipe):
    import torch

    pipe.set_progress_bar_config(disable=True)
    return pipe(PROMPT, num_inference_steps=2, output_type="np", height=32, width=32,
                generator=torch.Generator().manual_seed(0)).images


def test_pack_records_the_url_and_checks_the_hosted_records(hosted, tmp_path: Path) -> None:
    from dduf_plus.packing import pack

    server, url, archive, partial = hosted
    ref = partial.references["vae"]
    assert ref["pretrained_model_name_or_path"] == url and ref["subfolder"] == "vae"
    assert set(ref["files"]) == {"config.json", "diffusion_pytorch_model.safetensors"}
    # the fine-tune's unet is not the hosted one: a reference that could never resolve is refused
    with pytest.raises(DDUFPackError, match="unet differs from its reference"):
        pack(PIPELINES / "tiny-sd-finetune", tmp_path / "bad.dduf", exclude=["unet"], refs={"unet": url}, quiet=True)
    # two opens of the hosted archive: each its opening suffix range (the last SUFFIX_BYTES: directory, index and,
    # in this 1.26 MB archive, part of the vae) and the JSON entries, never the other weights
    assert server.body_bytes < 2 * SUFFIX_BYTES + (64 << 10) < 2 * (server.root / "base.dduf").stat().st_size


def test_load_fetches_only_the_component_and_caches_it(hosted, tmp_path: Path) -> None:
    import numpy as np

    from dduf_plus import load_dduf
    from dduf_plus.format.pack import pack_folder

    server, url, archive, _ = hosted
    full = pack_folder(PIPELINES / "tiny-sd-finetune", tmp_path / "full.dduf", quiet=True).path
    expected = run(load_dduf(full))
    got = run(load_dduf(archive))
    np.testing.assert_array_equal(expected, got)
    hosted_size = (server.root / "base.dduf").stat().st_size
    vae = sum(r["size"] for r in json.loads(_model_index(archive))["_dduf_plus_references"]["vae"]["files"].values())
    # the vae's two entries, plus what opening the hosted archive reads (the opening's suffix range: the last
    # SUFFIX_BYTES, directory and index; safetensors headers merged, storage/prefetch_source.py); never the
    # other components' weights
    assert vae <= server.body_bytes < vae + SUFFIX_BYTES + 170_000 < hosted_size, (server.body_bytes, vae, hosted_size)
    server.reset()
    again = run(load_dduf(archive))
    np.testing.assert_array_equal(expected, again)
    assert server.gets == 0 and server.heads == 0


def _model_index(archive: Path) -> bytes:
    from dduf_plus.format.archive import DDUFArchive

    with DDUFArchive(archive) as a:
        return a.read_bytes("model_index.json")


def test_tampered_hosted_entry_is_refused(hosted, tmp_path: Path) -> None:
    from dduf_plus import load_dduf
    from dduf_plus.format.archive import DDUFArchive

    server, url, archive, _ = hosted
    base = server.root / "base.dduf"
    with DDUFArchive(base) as a:
        entry = a.entry("vae/diffusion_pytorch_model.safetensors")
    data = bytearray(base.read_bytes())
    data[entry.offset + entry.length - 10] ^= 0xFF  # one weight byte; the hosted index still claims the old hash
    base.write_bytes(bytes(data))
    with pytest.raises(DDUFIntegrityError) as info:
        load_dduf(archive)
    message = str(info.value)
    assert "'vae'" in message and "diffusion_pytorch_model.safetensors" in message and "sha256" in message
    from dduf_plus.refs.hosted import cached_files

    assert cached_files({"x": {"size": entry.length, "sha256": "0" * 64}})[1] == ["x"]
    assert not any(p.name.startswith("0" * 8) for p in (tmp_path / "dduf-cache").rglob("*"))


def test_unreachable_host_names_the_component(hosted, monkeypatch: pytest.MonkeyPatch) -> None:
    from dduf_plus import load_dduf

    server, url, archive, _ = hosted
    shutil.move(server.root / "base.dduf", server.root / "moved.dduf")
    with pytest.raises(DDUFReferenceError) as info:
        load_dduf(archive)
    assert "'vae'" in str(info.value) and url in str(info.value)


def test_recorded_private_host_is_not_contacted(hosted, monkeypatch: pytest.MonkeyPatch) -> None:
    """An archive's recorded URL on loopback is refused before any request (a stranger's archive must not
    make the loader reach the intranet); the same URL passed by the caller in refs= is used."""
    from dduf_plus import load_dduf

    server, url, archive, _ = hosted
    monkeypatch.delenv("DDUF_PLUS_ALLOW_PRIVATE_URLS")
    with pytest.raises(DDUFReferenceError) as info:
        load_dduf(archive)
    assert "'vae'" in str(info.value) and "loopback" in str(info.value) and "DDUF_PLUS_ALLOW_PRIVATE_URLS" in str(info.value)
    assert server.gets == 0 and server.heads == 0
    assert load_dduf(archive, refs={"vae": url}) is not None
    assert server.gets > 0


def test_dduf_refs_shows_hosted_status(hosted, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from dduf_plus.cli import main
    from dduf_plus.refs.resolve import check_references

    server, url, archive, _ = hosted
    assert main(["refs", str(archive)]) == 0
    out = capsys.readouterr().out
    assert url in out and "fetched from the hosted archive" in out
    from dduf_plus.format.archive import DDUFArchive

    with DDUFArchive(archive) as a:
        refs = a.references
    assert check_references(refs)[0]["status"] == "download"
    assert server.gets == 0  # dduf refs fetches nothing
    from dduf_plus.refs.resolve import locate_component

    located = locate_component("vae", refs["vae"])
    assert located.how == "recorded hosted archive" and located.verified
    assert check_references(refs)[0]["status"] == "ok"
    assert main(["refs", str(archive)]) == 0
    assert "recorded hosted archive" in capsys.readouterr().out


def test_spec_grammar_for_urls() -> None:
    from dduf_plus.refs.resolve import parse_spec

    assert parse_spec("http://127.0.0.1:8080/base.dduf") == ("url", "http://127.0.0.1:8080/base.dduf", None, None)
    assert parse_spec("https://h/x/base.dduf:text_encoder_2").subfolder == "text_encoder_2"
    assert parse_spec("hf://org/repo/base.dduf").kind == "url"
    for bad in ("https://h/folder", "ftp://h/x.dduf", "simplecache::https://h/x.dduf"):
        with pytest.raises(DDUFReferenceError):
            parse_spec(bad)


VAE_WEIGHTS = "vae/diffusion_pytorch_model.safetensors"


def test_hosted_index_lying_about_a_safetensors_header_is_refused(hosted, tmp_path: Path) -> None:
    """The hosted archive is opened from its tail (one request: its index is believed for where the entries
    lie); the vae's safetensors header, which arrives with the entry, must be the one that index records. An
    index that swaps a tensor's shape (same size, the entry's bytes and sha256 unchanged) is refused by rule
    I002 before the entry is cached or a model built (before: by the full open, which read every header)."""
    from test_remote_cache_identity import rewrite_index

    from dduf_plus import load_dduf
    from dduf_plus.refs.hosted import cached_files
    from dduf_plus.remote.indexed import IndexedArchive, open_indexed

    server, url, archive, partial = hosted
    base = server.root / "base.dduf"
    lied: list[str] = []

    def lie(index: dict) -> None:
        name, record = next((n, t) for n, t in index["files"][VAE_WEIGHTS]["tensors"].items()
                            if t["shape"] != t["shape"][::-1])
        record["shape"] = record["shape"][::-1]
        lied.append(name)

    base.write_bytes(rewrite_index(base.read_bytes(), lie))
    server.reset()
    with open_indexed(url) as opened:  # the tail alone cannot show the lie: believed until the header arrives
        assert isinstance(opened, IndexedArchive) and server.gets == 1
        assert tuple(opened.headers[VAE_WEIGHTS].tensors[lied[0]].shape) != ()
    with pytest.raises(DDUFIntegrityError, match="I002") as info:
        load_dduf(archive)
    assert VAE_WEIGHTS in str(info.value) and url in str(info.value)
    recorded = partial.references["vae"]["files"]
    assert cached_files({"w": recorded["diffusion_pytorch_model.safetensors"]})[1] == ["w"]  # nothing kept
