"""0.10.0's new surfaces as hostile input: app model folders searched for sharded and whole-file components, the
part maps and hash memory kept in signed files, and the per-command cost of an archive with many references into
model folders. Each case ends in a ``DDUFError`` or a rejected candidate naming the file, never a hang, a raw
``OSError``, unbounded work or tensors other than the verified ones. Work is bounded by counts, never the clock."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from conftest import PIPELINES
from dduf_plus.errors import DDUFReferenceError
from dduf_plus.refs import model_dirs, part_memo, tensor_digest
from dduf_plus.refs.cache import stat_key, verified_hashes

TINY_SD = PIPELINES / "tiny-sd"
WEIGHTS = "diffusion_pytorch_model.safetensors"
POSIX = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(model_dirs.ENV, raising=False)


def _vae_reference(tmp: Path) -> tuple[dict[str, Any], Path]:
    """The tiny SD VAE's reference as ``dduf pack`` records it (a Hub source that is nowhere here), and an app
    folder holding its file as it is (``models/vae.safetensors``)."""
    folder = shutil.copytree(TINY_SD / "vae", tmp / "vae")
    files = {name: {"sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest(),
                    "size": (folder / name).stat().st_size} for name in (WEIGHTS, "config.json")}
    models = tmp / "models"
    models.mkdir()
    shutil.copy(folder / WEIGHTS, models / "vae.safetensors")
    ref = {"pretrained_model_name_or_path": "nobody/tiny-sd", "subfolder": "vae", "files": files,
           **tensor_digest.tensor_record(folder, files)}
    return ref, models


def _other_bytes(path: Path, dest: Path) -> Path:
    """A file of the same size and header as ``path`` whose last tensor byte differs."""
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x55
    dest.write_bytes(bytes(raw))
    return dest


def _in_subprocess(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """``body`` in a fresh interpreter with a generous guard: the old code blocked for ever on a FIFO (the guard
    is what fails then, not a timing assert)."""
    env = {**os.environ, "DDUF_PLUS_CACHE": str(tmp_path / "cache")}
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, env=env,
                              timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("blocked (an open or read that never returns)")


# --- signed files: the hash memory and the part maps ----------------------------------------------------------
@POSIX
def test_a_fifo_in_place_of_the_hash_memory_or_a_part_map_is_no_record(tmp_path: Path) -> None:
    """``verified.json`` or a part map replaced by a FIFO (a planted cache, a restore tool): 0.10.0's
    ``open()`` waited for a writer for ever, so every load that searched model folders hung. Now a record that
    is not a regular file is no record: nothing remembered, nothing blocks."""
    done = _in_subprocess(tmp_path, f"""
        import os
        from pathlib import Path
        from dduf_plus.refs import part_memo
        from dduf_plus.refs.cache import verified_hashes, stat_key
        weights = Path({str(tmp_path)!r}) / "w.bin"
        weights.write_bytes(b"0" * 64)
        memo = verified_hashes()
        memo.remember(weights, "a" * 64, "m")
        rec = {{"layout": "b" * 64, "count": 1, "bytes": 2, "sha256": "c" * 64}}
        key = stat_key(weights)
        from dduf_plus.format.safetensors_header import TensorInfo
        part_memo.keep(weights, key, rec, ("x", 8, {{"t": (TensorInfo("t", "float16", (1,), 0, 2), ((0, 2),), 0)}}))
        fifo = part_memo.map_path(weights, key, rec)
        assert part_memo.recall(weights, key, rec) is not None  # kept: the FIFO takes a real map's place
        fifo.unlink()
        os.mkfifo(fifo)
        print("map", part_memo.recall(weights, key, rec))
        os.replace(fifo, memo.path)
        memo._entries = None  # as a new process reads it
        print("memo", memo.lookup(weights, "m"))
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "map None" in done.stdout and "memo None" in done.stdout


@POSIX
def test_a_fifo_in_place_of_the_signing_secret_is_no_secret(tmp_path: Path) -> None:
    """The hash memory's ``.secret`` replaced by a FIFO: 0.10.0's open (no ``O_NONBLOCK``) waited for a writer for
    ever at the first lookup of every process. Now it is no secret: a fresh one takes its place, nothing blocks."""
    done = _in_subprocess(tmp_path, f"""
        import os
        from pathlib import Path
        from dduf_plus.refs.cache import verified_hashes
        from dduf_plus.storage.signed import SECRET_NAME
        weights = Path({str(tmp_path)!r}) / "w.bin"
        weights.write_bytes(b"0" * 64)
        folder = verified_hashes().path.parent
        folder.mkdir(parents=True)
        os.mkfifo(folder / SECRET_NAME)
        memo = verified_hashes()
        memo.remember(weights, "a" * 64, "m")
        print("secret", (folder / SECRET_NAME).is_file(), len(memo.signer.secret or b""))
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "secret True 32" in done.stdout  # the FIFO was replaced by a fresh secret (mode 0600)


def test_a_part_map_written_for_one_file_is_not_taken_for_another_of_the_same_size(tmp_path: Path) -> None:
    """A signed map copied to the name another file's map would have (same size, other inode or path): what it
    was written for is inside the signed record, so it is not this file's map."""
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"0" * 64)
    b.write_bytes(b"1" * 64)
    rec = {"layout": "b" * 64, "count": 1, "bytes": 2, "sha256": "c" * 64}
    info = tensor_digest.TensorInfo("t", "float16", (1,), 0, 2)
    part_memo.keep(a, stat_key(a), rec, ("x", 8, {"t": (info, ((0, 2),), 0)}))
    assert part_memo.recall(a, stat_key(a), rec) is not None
    shutil.copy(part_memo.map_path(a, stat_key(a), rec), part_memo.map_path(b, stat_key(b), rec))
    assert part_memo.recall(b, stat_key(b), rec) is None


@pytest.mark.parametrize("edit", ["truncated", "version", "huge"])
def test_an_edited_truncated_foreign_or_huge_hash_memory_is_no_record(tmp_path: Path, edit: str) -> None:
    """What another dduf_plus version wrote, a truncated write, or a file past the budget: nothing believed, and a
    huge file is read only up to its budget (+1 byte), never whole."""
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"0" * 64)
    memo = verified_hashes()
    memo.remember(weights, "a" * 64, "m")
    raw = memo.path.read_bytes()
    if edit == "truncated":
        memo.path.write_bytes(raw[:len(raw) // 2])
    elif edit == "version":
        record = json.loads(raw)
        record["v"] += 1
        memo.path.write_bytes(json.dumps(record).encode())
    else:
        with open(memo.path, "r+b") as f:
            f.truncate(8 << 30)  # sparse: 8 GiB
    memo._entries = None
    assert memo.lookup(weights, "m") is None


# --- a shard index at pack ----------------------------------------------------------------------------------
@POSIX
def test_a_fifo_shard_index_is_refused_at_pack_not_a_hang(tmp_path: Path) -> None:
    """A BASE whose shard index is a FIFO (its size is 0, under the budget): 0.10.0 passed the size check and
    ``read_bytes()`` blocked for ever. Now a shard index that is not a regular file is refused (D011)."""
    done = _in_subprocess(tmp_path, f"""
        import os, shutil
        from pathlib import Path
        from dduf_plus.errors import DDUFPackError
        from dduf_plus.refs import tensor_digest
        folder = Path({str(tmp_path)!r}) / "unet"
        shutil.copytree({str(TINY_SD / "vae")!r}, folder)
        os.replace(folder / "{WEIGHTS}", folder / "diffusion_pytorch_model-00001-of-00001.safetensors")
        os.mkfifo(folder / "diffusion_pytorch_model.safetensors.index.json")
        files = {{n: {{}} for n in os.listdir(folder) if ".fp16." not in n}}
        try:
            print(tensor_digest.tensor_record(folder, files))
        except DDUFPackError as e:
            print("refused", e.code, e)
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused D011" in done.stdout and "not a regular file" in done.stdout


# --- a whole file in diffusers' names: mapped only as verified ------------------------------------------------
def test_a_whole_file_replaced_after_locate_is_refused_at_load(tmp_path: Path) -> None:
    """A diffusers-layout file found as it is in an app folder: 0.10.0 showed it to the loader through a
    symlink to its path, mapped later by that path, so a file replaced between the search (verified) and the
    load (same size, other bytes) gave the model its bytes silently. Now it is mapped like every in-place
    part: the opened descriptor's stat must be the verified one, else a DDUFReferenceError naming the component
    and the file."""
    import torch
    from safetensors.torch import load_file

    from dduf_plus.loading.files import resolve_component

    ref, models = _vae_reference(tmp_path)
    path = models / "vae.safetensors"
    other = _other_bytes(path, tmp_path / "other.safetensors")
    files = resolve_component("vae", ref, local_files_only=True, model_dirs=[models])
    os.replace(other, path)
    with pytest.raises(DDUFReferenceError, match=r"component 'vae': .*vae\.safetensors changed since its tensors "
                                                 r"were verified"):
        files.tensors(files.weight_files())
    # unchanged: the verified tensors, from the file in place
    expected = load_file(TINY_SD / "vae" / WEIGHTS)
    shutil.copy(TINY_SD / "vae" / WEIGHTS, path)
    files = resolve_component("vae", ref, local_files_only=True, model_dirs=[models])
    got = files.tensors(files.weight_files())
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_file_replaced_after_its_hash_before_its_stat_is_not_matched(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The stat a match is trusted at was taken after the tensors were hashed (0.10.0): a file replaced in
    between was recorded at the replacement's stat, and loaded unverified. Now the stat taken before the check
    must still hold after it, else the file is a rejected candidate."""
    ref, models = _vae_reference(tmp_path)
    path = models / "vae.safetensors"
    other = _other_bytes(path, tmp_path / "other.safetensors")
    real = model_dirs.remembered_digest

    def then_replaced(p: Path, *args: Any) -> str:
        digest = real(p, *args)
        if other.exists():
            os.replace(other, p)
        return digest

    monkeypatch.setattr(model_dirs, "remembered_digest", then_replaced)
    found = model_dirs.find_component("vae", ref, [models])
    assert isinstance(found, str) and "vae.safetensors: not readable (it changed while it was searched)" in found


# --- many references: one walk, one header read per file, one budget -------------------------------------------
def _crowded(tmp_path: Path, n_other: int) -> tuple[dict[str, Any], Path]:
    import torch
    from safetensors.torch import save_file

    ref, models = _vae_reference(tmp_path)
    for i in range(n_other):
        save_file({"w": torch.zeros(i + 1)}, models / f"lora_{i:03d}.safetensors")
    return ref, models


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counts = {"headers": 0, "walks": 0}
    read, walk = model_dirs.read_file_header, model_dirs._walk

    def counted_read(*args: Any) -> Any:
        counts["headers"] += 1
        return read(*args)

    def counted_walk(dirs: Any) -> Any:
        counts["walks"] += 1
        return walk(dirs)

    monkeypatch.setattr(model_dirs, "read_file_header", counted_read)
    monkeypatch.setattr(model_dirs, "_walk", counted_walk)
    return counts


def test_many_references_walk_the_folders_once_and_read_each_header_once(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """200 references into model folders (``dduf refs`` of such an archive): 0.10.0 walked the folders and read
    every header once per reference (200 x 11 header reads). Now once per command: 1 walk, 11 header reads."""
    from dduf_plus.refs.resolve import check_references

    ref, models = _crowded(tmp_path, 10)
    counts = _count_reads(monkeypatch)
    references = {f"vae_{i:03d}": ref for i in range(200)}
    rows = check_references(references, model_dirs=[models])
    assert all(r["status"] == "ok" for r in rows) and len(rows) == 200
    assert counts == {"headers": 11, "walks": 1}


def test_the_search_of_one_command_has_a_budget_of_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """200 references each recording other tensors (every file weighed against every one): past the budget of
    candidate checks for the whole command, the rest are not searched, said in the reference's error."""
    ref, models = _crowded(tmp_path, 10)
    monkeypatch.setattr(model_dirs, "MAX_CHECKS", 100)
    counts = _count_reads(monkeypatch)
    weighed = 0
    real_check = model_dirs._check

    def counted_check(*args: Any) -> Any:
        nonlocal weighed
        weighed += 1
        return real_check(*args)

    monkeypatch.setattr(model_dirs, "_check", counted_check)
    answers = []
    with model_dirs.search_session():
        for i in range(200):
            other = {**ref, "tensors": {**ref["tensors"], "sha256": f"{i:064x}"}}  # a record no file holds
            answers.append(model_dirs.find_component(f"vae_{i}", other, [models]))
    assert all(isinstance(a, str) for a in answers)
    assert weighed <= 100 and counts == {"headers": 11, "walks": 1}
    assert "over its budget (100 candidate checks" in answers[-1]
    assert "no file in" in answers[0]


def test_a_load_searches_the_model_folders_once_for_all_its_references(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_dduf`` of a partial archive whose VAE and text encoder are found in model folders: one walk."""
    from dduf_plus import load_dduf
    from dduf_plus.packing.partial import pack_partial

    archive = tmp_path / "ft.dduf"
    base = shutil.copytree(TINY_SD, tmp_path / "base")
    ft = shutil.copytree(TINY_SD, tmp_path / "ft")
    from safetensors.torch import load_file, save_file

    unet = next((ft / "unet").glob("*.safetensors"))
    save_file({k: v + 0.01 for k, v in load_file(unet).items()}, unet)
    pack_partial(ft, archive, base=str(base), quiet=True)
    models = tmp_path / "models"
    models.mkdir()
    for name in ("vae", "text_encoder"):  # found in the app folder only (the scheduler, tokenizer: in BASE)
        weights = next((base / name).glob("*.safetensors"))
        shutil.copy(weights, models / f"{name}.safetensors")
        shutil.rmtree(base / name)
    counts = _count_reads(monkeypatch)
    pipe = load_dduf(archive, model_dirs=[models], local_files_only=True)
    assert pipe.vae is not None and counts["walks"] == 1 and counts["headers"] <= 2


# --- a part's transposed tensor: gathered in memory, so bounded --------------------------------------------------
def test_a_huge_transposed_tensor_is_refused_before_it_is_read() -> None:
    """A hostile file (sparse: 100 GB that cost nothing) whose header lets a layout reader see a [n, n]
    projection held transposed: 0.10.0 read the whole matrix into one buffer to hash it (and the loader copied
    its transpose). Now a transposed tensor over 256 MB is a rejected part, before a byte is read."""
    n = 120_000  # 120,000^2 x 2 bytes: 28.8 GB
    info = tensor_digest.TensorInfo("text_projection.weight", "float16", (n, n), 0, n * n * 2)
    part = model_dirs.Part("OpenCLIP", 8, {info.name: model_dirs.Source(info, ((0, n * n * 2),), rows=n)})
    why = model_dirs.part_problem(part, 100 << 30)
    assert why is not None and "a transposed tensor of 28800000000 bytes" in why
    small = model_dirs.Part("OpenCLIP", 8, {"p": model_dirs.Source(info._replace(shape=(1280, 1280), end=1280 * 1280 * 2),
                                                                  ((0, 1280 * 1280 * 2),), rows=1280)})
    assert model_dirs.part_problem(small, 100 << 30) is None
