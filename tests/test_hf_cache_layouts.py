"""The Hugging Face cache as it really is, in both layouts: snapshot symlinks into ``blobs/`` (POSIX), and real
files in ``snapshots/`` with no blobs (huggingface_hub on machines without symlinks: Windows without developer
mode, some containers). ``dduf pack --exclude ... --ref org/repo`` and loading the partial archive work in both;
real files are hashed once (remembered by stat key); a blob name is trusted only inside the repo's own blobs/."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from hfcache import LAYOUTS, REPO, ROOT, TINY_SD, cached, corrupted_copy, count_hashing

from dduf_plus.cli import main as cli_main
from dduf_plus.errors import DDUFPackError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.packing.partial import pack_partial
from dduf_plus.refs import cache as refs_cache
from dduf_plus.refs.cache import add_to_hf_cache, blob_name_of, git_blob_sha1_file
from dduf_plus.refs.resolve import locate_component


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request) -> str:
    return request.param


def test_cache_names_and_hashes_are_huggingface_hubs() -> None:
    """refs.cache names repo folders as huggingface_hub does (kept local: its module costs ~1 s to import) and
    hashes small files with huggingface_hub's own git_hash."""
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils.sha import git_hash

    for repo_id, kind in (("org/tiny-sd", "model"), ("single", "model"), ("a-b/c.d_e", "dataset")):
        assert refs_cache.repo_folder_name(repo_id, kind) == repo_folder_name(repo_id=repo_id, repo_type=kind)
    for data in (b"", b"Hello, World!", bytes(range(256)) * 9):
        assert refs_cache.git_blob_sha1(data) == git_hash(data)
    assert refs_cache.git_blob_sha1(b"Hello, World!") == "b45ef6fec89518d314f546fd6c3025367b721684"  # git hash-object


# --- the fake caches are what huggingface_hub writes and reads --------------------------------------------
def test_layouts_are_what_huggingface_hub_reads(tmp_path: Path, hf_env: Path, layout: str) -> None:
    from huggingface_hub import snapshot_download

    snap = cached(hf_env, layout=layout)
    assert Path(snapshot_download(REPO, cache_dir=hf_env, local_files_only=True)) == snap
    assert Path(snapshot_download(REPO, cache_dir=hf_env, local_files_only=True, allow_patterns=["vae/*"])) == snap
    st = snap / "text_encoder" / "model.safetensors"
    assert st.read_bytes() == (TINY_SD / "text_encoder" / "model.safetensors").read_bytes()
    blobs = snap.parent.parent / "blobs"
    if layout == "symlinks":
        assert st.is_symlink() and blob_name_of(st, snap.parent.parent) == sha256(st)
        config = snap / "text_encoder" / "config.json"
        assert blob_name_of(config, snap.parent.parent) == git_blob_sha1_file(config)
    else:
        files = [p for p in snap.rglob("*") if p.is_file()]
        assert files and not any(p.is_symlink() for p in snap.rglob("*"))
        assert not blobs.exists() or not any(blobs.iterdir())
        assert blob_name_of(st, snap.parent.parent) is None


def test_add_to_hf_cache_writes_only_inside_the_cache(tmp_path: Path, hf_env: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    with pytest.raises(Exception, match="path component|outside"):
        add_to_hf_cache(TINY_SD, REPO, cache_dir=hf_env, files={"../../outside/x.json": TINY_SD / "model_index.json"})
    with pytest.raises(Exception, match="path component|outside"):
        add_to_hf_cache(TINY_SD, REPO, cache_dir=hf_env, ref="../../../outside/ref", files={})
    assert list(outside.iterdir()) == []
    with pytest.raises(ValueError, match="link="):
        add_to_hf_cache(TINY_SD, REPO, cache_dir=hf_env, link="symlink-please")


def test_blob_names_are_trusted_only_in_the_repos_own_blobs(tmp_path: Path, hf_env: Path) -> None:
    """A snapshot entry linking into some other folder named ``blobs`` (or another repo's) is not named by
    its hash there: it is hashed like a real file."""
    snap = cached(hf_env, layout="symlinks")
    elsewhere = tmp_path / "elsewhere" / "blobs"
    elsewhere.mkdir(parents=True)
    liar = elsewhere / ("0" * 64)
    liar.write_bytes(b"not what the name says")
    link = snap / "text_encoder" / "extra.json"
    link.symlink_to(liar)
    assert blob_name_of(link, snap.parent.parent) is None
    assert blob_name_of(link) == "0" * 64  # without the repo: the old, looser rule (folder named blobs)
    not_a_hash = snap.parent.parent / "blobs" / "notahash"
    not_a_hash.write_bytes(b"x")
    link2 = snap / "text_encoder" / "extra2.json"
    link2.symlink_to(not_a_hash)
    assert blob_name_of(link2, snap.parent.parent) is None


# --- dduf pack --exclude X --ref org/repo -----------------------------------------------------------------
def test_pack_ref_compares_with_the_cache_in_both_layouts(tmp_path: Path, hf_env: Path, layout: str, capsys) -> None:
    """The issue's command: the local copy is compared with the cached repo (real files: hashed)."""
    cached(hf_env, layout=layout)
    out = tmp_path / "partial.dduf"
    rc = cli_main(["pack", str(TINY_SD), "-o", str(out), "--exclude", "text_encoder", "--ref", REPO, "-q"])
    assert rc == 0, capsys.readouterr().err
    with DDUFArchive(out) as archive:
        ref = archive.references["text_encoder"]
        assert not any(n.startswith("text_encoder/") for n in archive.entries)
    assert ref["pretrained_model_name_or_path"] == REPO
    assert ref["files"]["model.safetensors"]["sha256"] == sha256(TINY_SD / "text_encoder" / "model.safetensors")


def test_pack_ref_without_a_local_copy_takes_hashes_from_real_files(tmp_path: Path, hf_env: Path, layout: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "no-te"
    shutil.copytree(TINY_SD, folder)
    shutil.rmtree(folder / "text_encoder")
    snap = cached(hf_env, layout=layout)
    hashed = count_hashing(monkeypatch)
    out = tmp_path / "partial.dduf"
    pack_partial(folder, out, exclude=["text_encoder"], refs={"*": REPO}, quiet=True)
    with DDUFArchive(out) as archive:
        ref = archive.references["text_encoder"]
    assert ref["revision"] == snap.name
    want = {p.name: sha256(p) for p in (TINY_SD / "text_encoder").iterdir()}
    got = {n: r.get("sha256") for n, r in ref["files"].items()}
    if layout == "symlinks":  # the Hub's names: sha256 for LFS files, git blob id for the small ones
        assert got["model.safetensors"] == want["model.safetensors"] and got["config.json"] is None
        assert hashed == []
    else:  # real files: every file hashed here, so every record has its sha256
        assert got == want
        assert sorted(Path(p).name for p in hashed) == sorted(want)
        # hashed once: a second pack on this machine (another process) rehashes nothing
        refs_cache._VERIFIED.clear()
        hashed.clear()
        pack_partial(folder, tmp_path / "again.dduf", exclude=["text_encoder"], refs={"*": REPO}, quiet=True)
        assert [p for p in hashed if str(snap) in p] == []


def test_pack_ref_refuses_a_cached_copy_that_differs(tmp_path: Path, hf_env: Path, layout: str) -> None:
    cached(hf_env, corrupted_copy(tmp_path, "text_encoder", "model.safetensors"), layout=layout)
    # compared by content (the cached bytes are on this machine): the first tensor that differs is named
    with pytest.raises(DDUFPackError, match=r"text_encoder differs from its reference org/tiny-sd: tensor \S+ differs "
                                            r"\(max abs difference") as err:
        pack_partial(TINY_SD, tmp_path / "x.dduf", exclude=["text_encoder"], refs={"*": REPO}, quiet=True)
    assert "no hash known" not in str(err.value)


def test_pack_base_hub_in_both_layouts(tmp_path: Path, hf_env: Path, layout: str) -> None:
    snap = cached(hf_env, layout=layout)
    out = tmp_path / "ft.dduf"
    finetune = ROOT / "fixtures" / "pipelines" / "tiny-sd-finetune"
    pack_partial(finetune, out, base=REPO, quiet=True)
    with DDUFArchive(out) as archive:
        assert set(archive.references) == {"scheduler", "text_encoder", "tokenizer", "vae"}
        assert {r["revision"] for r in archive.references.values()} == {snap.name}


# --- loading the partial archive from either cache --------------------------------------------------------
@pytest.fixture
def partial(tmp_path: Path, hf_env: Path) -> Path:
    out = tmp_path / "partial.dduf"
    pack_partial(TINY_SD, out, exclude=["text_encoder", "vae"], refs={"*": REPO}, quiet=True)
    refs_cache._VERIFIED.clear()  # a fresh process: forget the hashes packing remembered
    return out


def test_references_resolve_from_either_cache(partial: Path, hf_env: Path, layout: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    snap = cached(hf_env, layout=layout)
    with DDUFArchive(partial) as archive:
        refs = archive.references
    hashed = count_hashing(monkeypatch)
    loc = locate_component("text_encoder", refs["text_encoder"])
    assert loc.how == "hf cache" and loc.verified and loc.folder == snap / "text_encoder"
    assert len(hashed) == len(refs["text_encoder"]["files"])
    vae = locate_component("vae", refs["vae"])  # the cache's vae/ also has an fp16 variant: a view hides it
    assert vae.verified and sorted(p.name for p in vae.folder.iterdir()) == sorted(refs["vae"]["files"])
    refs_cache._VERIFIED.clear()
    hashed.clear()
    assert locate_component("text_encoder", refs["text_encoder"]).verified and hashed == []


def test_edited_real_file_in_the_cache_is_refused(partial: Path, hf_env: Path) -> None:
    from dduf_plus.errors import DDUFReferenceError

    snap = cached(hf_env, layout="real-files")
    target = snap / "text_encoder" / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    with DDUFArchive(partial) as archive:
        ref = archive.references["text_encoder"]
    with pytest.raises(DDUFReferenceError, match="differs"):
        locate_component("text_encoder", ref)


def test_load_dduf_of_the_partial_archive_in_both_layouts(partial: Path, hf_env: Path, layout: str) -> None:
    import torch
    from diffusers import DiffusionPipeline

    from dduf_plus.loading.pipeline import load_dduf

    cached(hf_env, layout=layout)
    pipe = load_dduf(partial, torch_dtype=torch.float32)
    want = DiffusionPipeline.from_pretrained(TINY_SD, dtype=torch.float32)
    for name in ("text_encoder", "vae"):
        got_state, want_state = getattr(pipe, name).state_dict(), getattr(want, name).state_dict()
        assert got_state.keys() == want_state.keys()
        assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)


def test_cli_refs_reports_the_real_file_cache(partial: Path, hf_env: Path, capsys) -> None:
    cached(hf_env, layout="real-files")
    assert cli_main(["refs", str(partial), "--json", "--verify"]) == 0
    rows = json.loads(capsys.readouterr().out)["references"]
    assert {r["component"]: (r["status"], r["how"], r["verified"]) for r in rows} == {
        "text_encoder": ("ok", "hf cache", True), "vae": ("ok", "hf cache", True)}
    assert not any(p.is_symlink() for p in (hf_env / "models--org--tiny-sd").rglob("*"))
    assert os.path.isdir(hf_env / "models--org--tiny-sd" / "snapshots")
