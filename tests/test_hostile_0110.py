"""0.11.0's new surfaces as hostile input: folders of shards found in app model folders, ``use_mmap=False`` reads
from checked descriptors, ``dduf unpack``'s writes into an output folder holding links, and the stat key every
"unchanged since verified" decision rests on. Each case ends in a ``DDUFError`` (or a rejected candidate) naming
the file, never a hang, a raw ``OSError``, a write outside the output or tensors other than the verified ones.
Work is bounded by counts, never the clock (the one sleep here waits out the kernel's coarse timestamp tick)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from dduf_plus.errors import DDUFError, DDUFReferenceError
from dduf_plus.loading.files import FolderComponentFiles
from dduf_plus.storage.signed import StatKey, stat_key

POSIX = pytest.mark.skipif(not hasattr(os, "mkfifo") or not hasattr(signal, "SIGALRM"), reason="POSIX FIFOs")
WEIGHTS = "model.safetensors"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dduf_plus.refs import model_dirs

    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(model_dirs.ENV, raising=False)


@contextmanager
def no_hang(seconds: int = 10) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the block blocks: a FIFO opened without O_NONBLOCK waits for ever."""
    def expired(*_: Any) -> None:
        raise TimeoutError("blocked")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _component(folder: Path, value: float = 1.0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"_class_name": "X"}))
    save_file({"w": torch.full((64,), value), "b": torch.full((16,), value)}, folder / WEIGHTS)
    return folder


def _swap_in_place(path: Path, edit: Callable[[bytes], bytes]) -> None:
    """Rewrite ``path`` in place (same inode, same size) and put its mtime back, as ``touch -r`` would: size,
    mtime, inode and device all as before. Waits past the kernel's coarse timestamp tick first (a real swap comes
    long after the file was verified)."""
    before = os.stat(path)
    time.sleep(0.05)
    data = edit(path.read_bytes())
    assert len(data) == before.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino, after.st_dev) == \
        (before.st_size, before.st_mtime_ns, before.st_ino, before.st_dev)


def _last_float_to(value: float) -> Callable[[bytes], bytes]:
    return lambda data: data[:-4] + torch.tensor([value]).numpy().tobytes()


# --- the stat key: a content swap with the mtime put back ------------------------------------------------------
def test_a_hash_memo_entry_is_not_believed_after_an_mtime_restoring_swap(tmp_path: Path) -> None:
    """FOUND A BUG: the hash memory keyed a file by size, mtime, inode and device; rewritten in place with its
    mtime put back (``os.utime``), the old sha256 was believed."""
    import hashlib

    from dduf_plus.refs.cache import verified_hashes

    data = tmp_path / "data.bin"
    data.write_bytes(b"a" * 4096)
    memo = verified_hashes()
    assert memo.sha256(data) == hashlib.sha256(b"a" * 4096).hexdigest()
    assert memo.lookup(data) is not None
    _swap_in_place(data, lambda b: b"b" * len(b))
    assert memo.lookup(data) is None
    assert memo.sha256(data) == hashlib.sha256(b"b" * 4096).hexdigest()


def test_a_hash_memo_record_without_ctime_is_a_miss(tmp_path: Path) -> None:
    """A record 0.11.0 wrote (size, mtime, inode, device, sha256: signed with the same secret) is no record: the
    file is hashed again, and remembered in the new form."""
    import hashlib

    from dduf_plus.refs.cache import VerifiedHashes

    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 100)
    memo = VerifiedHashes(tmp_path / "refs" / "verified.json")
    key, lie = stat_key(data), "0" * 64
    memo.entries[os.path.realpath(data)] = [key.size, key.mtime_ns, key.inode, key.device, lie]
    assert memo.lookup(data) is None
    assert memo.sha256(data) == hashlib.sha256(b"x" * 100).hexdigest()
    assert memo.lookup(data) == hashlib.sha256(b"x" * 100).hexdigest()


def test_a_verified_folder_file_swapped_in_place_is_refused(tmp_path: Path) -> None:
    """FOUND A BUG: a file of a folder of shards verified at one stat, rewritten in place with its size and
    mtime kept: the loader's descriptor check (``FolderComponentFiles(verified=...)``) passed and the
    replacement's tensors were loaded as verified."""
    folder = _component(tmp_path / "c")
    keys = {WEIGHTS: stat_key(folder / WEIGHTS), "config.json": stat_key(folder / "config.json")}
    _swap_in_place(folder / WEIGHTS, _last_float_to(7.0))
    for use_mmap in (True, False):
        files = FolderComponentFiles(folder, "transformer", use_mmap=use_mmap, verified=keys)
        with pytest.raises(DDUFReferenceError, match="changed since its tensors were verified"):
            files.tensors([WEIGHTS])
    assert FolderComponentFiles(folder, "transformer", verified=keys).read_json("config.json") == {"_class_name": "X"}


def test_a_part_map_is_not_recalled_after_an_mtime_restoring_swap(tmp_path: Path) -> None:
    """FOUND A BUG: the part map of a file read in place was kept under its stat key; the same swap recalled it."""
    from dduf_plus.refs import part_memo, tensor_digest

    a = tmp_path / "a.bin"
    a.write_bytes(b"0" * 64)
    rec = {"layout": "b" * 64, "count": 1, "bytes": 2, "sha256": "c" * 64}
    info = tensor_digest.TensorInfo("t", "float16", (1,), 0, 2)
    part_memo.keep(a, stat_key(a), rec, ("x", 8, {"t": (info, ((0, 2),), 0)}))
    assert part_memo.recall(a, stat_key(a), rec) is not None
    _swap_in_place(a, lambda b: b"1" * len(b))
    assert part_memo.recall(a, stat_key(a), rec) is None


def test_the_stat_key_holds_the_change_time() -> None:
    st = os.stat(__file__)
    assert StatKey.of(st).ctime_ns == st.st_ctime_ns and len(StatKey._fields) == 5


def test_a_zst_cache_entry_swapped_in_place_is_not_served(packed: dict[str, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """FOUND A BUG: the decompressed copy of a ``.dduf.zst`` in the cache, rewritten in place with its mtime put
    back, was served as the verified archive. Now it is rehashed and replaced. An untouched entry is still taken
    at its stat, nothing hashed (the record is written after the rename, which moves the change time)."""
    from dduf_plus.storage import zst, zst_cache

    monkeypatch.setenv(zst.CACHE_ENV, str(tmp_path / "zcache"))
    stream = zst.compress(packed["tiny-sd"], tmp_path / "a.dduf.zst", quiet=True).path
    entry = zst_cache.cached_decompress(stream)
    hashed: list[int] = []
    real = zst_cache._sha256_fd
    monkeypatch.setattr(zst_cache, "_sha256_fd", lambda fd, size: (hashed.append(size), real(fd, size))[1])
    assert zst_cache.cached_decompress(stream) == entry and hashed == []
    _swap_in_place(entry, lambda b: b[:-64] + bytes(64))
    assert zst_cache.cached_decompress(stream).read_bytes() == packed["tiny-sd"].read_bytes()
    assert hashed  # the entry's stat key no longer held: rehashed, found altered, decompressed again


@POSIX
def test_a_fifo_put_in_a_listed_folder_file_s_place_is_refused_without_blocking(tmp_path: Path) -> None:
    """FOUND A BUG: ``FolderComponentFiles`` opened a listed file with a plain ``open()``: a FIFO put in its place
    between the listing and the read blocked the load for ever (a config, a shard index, a weights file)."""
    folder = _component(tmp_path / "c")
    files = FolderComponentFiles(folder, "unet", use_mmap=False)
    assert files.listdir() == ["config.json", WEIGHTS]
    for name in ("config.json", WEIGHTS):
        (folder / name).unlink()
        os.mkfifo(folder / name)
    files.listdir = lambda: ["config.json", WEIGHTS]  # type: ignore[method-assign]  # listed before the swap
    with no_hang():
        with pytest.raises(DDUFError, match="not a regular file"):
            files.read_bytes("config.json")
        with pytest.raises(DDUFError, match="not a regular file"):
            files.tensors([WEIGHTS])


# --- a folder of shards in a model folder ----------------------------------------------------------------------
SHARD = "diffusion_pytorch_model-0000{}-of-00002.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"
TENSORS = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}


def _shards(folder: Path) -> dict[str, Any]:
    """``folder`` holding 4 tensors cut into 2 shards and their index, as diffusers saves them; the record a
    reference to them carries (their tensors' digest, layout, count, bytes)."""
    from dduf_plus.format.safetensors_header import read_file_header
    from dduf_plus.refs import tensor_digest

    folder.mkdir(parents=True, exist_ok=True)
    cut = {SHARD.format(1): ["a", "b"], SHARD.format(2): ["c", "d"]}
    for shard, names in cut.items():
        save_file({n: torch.full((8,), TENSORS[n]) for n in names}, folder / shard)
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {n: s for s, ns in cut.items() for n in ns}}))
    headers = [(folder / s, read_file_header(folder / s, s)) for s in sorted(cut)]
    record = tensor_digest.make_record(tensor_digest.tensors_digest(headers), [h for _p, h in headers], "{}")
    return dict(record[tensor_digest.RECORD_KEY])


def _edit_index(folder: Path, edit: Callable[[dict[str, str]], dict[str, str]]) -> None:
    index = json.loads((folder / INDEX).read_text())
    (folder / INDEX).write_text(json.dumps({"weight_map": edit(index["weight_map"])}))


def _outside(folder: Path) -> None:
    shutil.move(folder / SHARD.format(2), folder.parent / "elsewhere.safetensors")
    _edit_index(folder, lambda m: {**m, "c": "../elsewhere.safetensors", "d": "../elsewhere.safetensors"})


def _absolute(folder: Path) -> None:
    _edit_index(folder, lambda m: {**m, "c": str(folder / SHARD.format(2)), "d": str(folder / SHARD.format(2))})


def _not_weights(folder: Path) -> None:  # the recorded tensors, in a file no reader takes for weights
    os.replace(folder / SHARD.format(2), folder / "x.bin")
    _edit_index(folder, lambda m: {**m, "c": "x.bin", "d": "x.bin"})


def _other_stem(folder: Path) -> None:  # a .safetensors name outside the set's naming (another variant's, here)
    os.replace(folder / SHARD.format(2), folder / "diffusion_pytorch_model.fp16.safetensors")
    _edit_index(folder, lambda m: {**m, "c": "diffusion_pytorch_model.fp16.safetensors",
                                   "d": "diffusion_pytorch_model.fp16.safetensors"})


def _an_index(folder: Path) -> None:
    os.replace(folder / SHARD.format(2), folder / "x.safetensors.index.json")
    _edit_index(folder, lambda m: {**m, "c": "x.safetensors.index.json", "d": "x.safetensors.index.json"})


def _named_twice(folder: Path) -> None:  # both shards' tensors in one name: the other shard is left out
    _edit_index(folder, lambda m: dict.fromkeys(m, SHARD.format(1)))


def _duplicate_tensors(folder: Path) -> None:  # the second shard holds the first's tensors: same count and bytes
    (folder / SHARD.format(2)).unlink()
    os.link(folder / SHARD.format(1), folder / SHARD.format(2))


def _fifo_shard(folder: Path) -> None:
    (folder / SHARD.format(2)).unlink()
    os.mkfifo(folder / SHARD.format(2))


def _fifo_link(folder: Path) -> None:
    os.mkfifo(folder.parent / "fifo")
    (folder / SHARD.format(2)).unlink()
    (folder / SHARD.format(2)).symlink_to(folder.parent / "fifo")


def _device_link(folder: Path) -> None:
    (folder / SHARD.format(2)).unlink()
    (folder / SHARD.format(2)).symlink_to("/dev/zero")


def _directory(folder: Path) -> None:
    (folder / SHARD.format(2)).unlink()
    (folder / SHARD.format(2)).mkdir()


def _dangling(folder: Path) -> None:
    (folder / SHARD.format(2)).unlink()
    (folder / SHARD.format(2)).symlink_to(folder / "gone")


def _loop(folder: Path) -> None:
    (folder / SHARD.format(2)).unlink()
    (folder / SHARD.format(2)).symlink_to(SHARD.format(2))


def _huge_index(folder: Path) -> None:  # the recorded entry count, 60 MB of names: over the index's budget
    (folder / INDEX).write_text(json.dumps({"weight_map": {f"t{i}" + "x" * 60_000_000: SHARD.format(1)
                                                           for i in range(1)}}))


@POSIX
@pytest.mark.parametrize("hostile", [_outside, _absolute, _not_weights, _other_stem, _an_index, _named_twice, _duplicate_tensors, _fifo_shard,
                                     _fifo_link, _device_link, _directory, _dangling, _loop, _huge_index],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_hostile_folder_of_shards_is_a_candidate_less(tmp_path: Path, hostile: Callable[[Path], None]) -> None:
    """An index naming a shard outside the folder (``../``, absolute), a file beside it that is not a weights
    file of the set (FOUND A BUG: ``x.bin``, a ``.index.json`` name or another variant's file holding the
    recorded tensors was taken as a shard: a name no DDUF archive may store, or one loaders select as another
    variant), one shard for all tensors, a shard hard-linked to another (duplicate tensor names at
    the recorded count and bytes), a shard that is a FIFO, a link to a FIFO or a device, a folder, a dangling or
    looping link, an index past its budget: a candidate less (a reason, or "" for another model), never an
    exception, a hang, or a set of files that is not the verified one."""
    from dduf_plus.refs.shard_dirs import ShardSet, check_shard_folder

    folder = tmp_path / "models" / "diffusers" / "x" / "transformer"
    rec = _shards(folder)
    assert isinstance(check_shard_folder(folder, rec), ShardSet)
    hostile(folder)
    with no_hang():
        why = check_shard_folder(folder, rec)
    assert isinstance(why, str), why


def test_a_shard_linked_from_elsewhere_is_taken_for_its_verified_content(tmp_path: Path) -> None:
    """A decision pinned: a shard that is a link to a file elsewhere (an app folder linking a Hugging Face cache
    blob, as snapshots themselves do) is used when its tensors are the recorded ones; the view the loader reads
    and the stat it checks are the target's."""
    from dduf_plus.refs.shard_dirs import ShardSet, check_shard_folder

    folder = tmp_path / "models" / "x"
    rec = _shards(folder)
    blob = tmp_path / "blobs" / "abc"
    blob.parent.mkdir()
    shutil.move(folder / SHARD.format(2), blob)
    (folder / SHARD.format(2)).symlink_to(blob)
    found = check_shard_folder(folder, rec)
    assert isinstance(found, ShardSet) and found.keys[SHARD.format(2)] == stat_key(blob)
    save_file({"c": torch.full((8,), 3.0), "d": torch.full((8,), 5.0)}, blob)  # the target's tensors change
    assert check_shard_folder(folder, rec) == "its shards' header fits but their tensors' bytes differ (skipped)"


def test_a_shard_set_swapped_in_place_after_its_digest_was_remembered_is_hashed_again(tmp_path: Path) -> None:
    """FOUND A BUG (the stat key): the shards' digest is remembered by every shard's stat; one shard rewritten
    in place with size and mtime kept was taken as the verified set, its new tensors unhashed."""
    from dduf_plus.refs.shard_dirs import ShardSet, check_shard_folder

    folder = tmp_path / "models" / "x"
    rec = _shards(folder)
    assert isinstance(check_shard_folder(folder, rec), ShardSet)  # hashed, remembered
    _swap_in_place(folder / SHARD.format(2), _last_float_to(9.0))
    assert check_shard_folder(folder, rec) == "its shards' header fits but their tensors' bytes differ (skipped)"


# --- use_mmap=False: reads from the checked descriptor -------------------------------------------------------
def test_a_folder_file_truncated_after_its_header_was_checked_is_an_error(tmp_path: Path) -> None:
    """Regression pin: the header read from the descriptor, then the file cut to its header: every tensor read
    is a ``DDUFError`` naming the file and the tensor, never garbage or zeros."""
    folder = _component(tmp_path / "c")
    files = FolderComponentFiles(folder, "unet", use_mmap=False)
    tensors = files.tensors([WEIGHTS])
    data_start = files.safetensors_header(WEIGHTS).data_start
    os.truncate(folder / WEIGHTS, data_start + 8)
    for name in ("b", "w"):
        with pytest.raises(DDUFError, match=f"file ended while reading tensor {name}"):
            tensors[name]


def test_an_archive_truncated_under_a_load_without_mmap_is_an_error(packed: dict[str, Path], tmp_path: Path) -> None:
    """Regression pin: ``LazyTensors`` over the archive's own descriptor: the archive cut after it was opened and
    checked is a ``DDUFError`` at the first tensor past the new end."""
    from dduf_plus.format.archive import DDUFArchive
    from dduf_plus.loading.files import ArchiveComponentFiles

    archive = Path(shutil.copy(packed["tiny-sd"], tmp_path / "a.dduf"))
    files = ArchiveComponentFiles(DDUFArchive(archive), "unet", use_mmap=False)
    tensors = files.tensors(files.weight_files())
    start, _length = files.byte_ranges(files.weight_files())[0]
    os.truncate(archive, start)
    with pytest.raises(DDUFError, match="file ended while reading tensor"):
        tensors[next(iter(tensors))]


def _eio(*_: Any) -> Any:
    raise OSError(5, "Input/output error")


def test_a_read_error_without_mmap_is_a_dduf_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FOUND A BUG: ``use_mmap=False`` is for network file systems, where a read fails (EIO, ESTALE): the tensor
    reads let the raw ``OSError`` out. Now a ``DDUFIOError`` naming the file and the tensor."""
    from dduf_plus.errors import DDUFIOError
    from dduf_plus.format.safetensors_header import TensorInfo
    from dduf_plus.loading.in_place import _PartReads
    from dduf_plus.refs.model_dirs import Source

    folder = _component(tmp_path / "c")
    tensors = FolderComponentFiles(folder, "unet", use_mmap=False).tensors([WEIGHTS])
    fd = os.open(folder / WEIGHTS, os.O_RDONLY)
    try:
        part = _PartReads(fd, 0, {"t": Source(TensorInfo("t", "float32", (2,), 0, 8), ((0, 8),))}, str(folder / WEIGHTS))
        monkeypatch.setattr(os, "preadv", _eio)
        monkeypatch.setattr(os, "pread", _eio)
        with pytest.raises(DDUFIOError, match=f"{WEIGHTS}.*tensor w.*Input/output error"):
            tensors["w"]
        with pytest.raises(DDUFIOError, match=f"{WEIGHTS}.*tensor t.*Input/output error"):
            part["t"]
    finally:
        os.close(fd)


def test_a_part_range_past_the_end_is_an_error(tmp_path: Path) -> None:
    """A part's range past the end of the file (a file cut after it was verified: a regression pin) or at an
    offset no ``pread`` takes (defensive: ranges are checked against the file when found; it raised a raw
    ``OverflowError``): a ``DDUFIOError``, never a short tensor."""
    from dduf_plus.errors import DDUFIOError
    from dduf_plus.format.safetensors_header import TensorInfo
    from dduf_plus.loading.in_place import _PartReads
    from dduf_plus.refs.model_dirs import Source

    folder = _component(tmp_path / "c")
    size = (folder / WEIGHTS).stat().st_size
    fd = os.open(folder / WEIGHTS, os.O_RDONLY)
    try:
        for start in (size - 4, 1 << 64):
            part = _PartReads(fd, start, {"t": Source(TensorInfo("t", "float32", (2,), 0, 8), ((0, 8),))}, "f")
            with pytest.raises(DDUFIOError, match="tensor t"):
                part["t"]
    finally:
        os.close(fd)


# --- dduf unpack: links in the output folder --------------------------------------------------------------------
def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def test_unpack_replaces_file_links_and_never_writes_through_them(packed: dict[str, Path], tmp_path: Path) -> None:
    """Regression pins: a file link (to a file outside, dangling) at an entry's place: refused as existing without
    --force; replaced with --force, the link's target untouched (never created, never written)."""
    from dduf_plus.errors import DDUFUsageError
    from dduf_plus.format.unpack import unpack

    out, outside = tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.json").write_text("keep")
    (out / "unet").mkdir(parents=True)
    (out / "unet" / "config.json").symlink_to(outside / "victim.json")
    (out / "model_index.json").symlink_to(outside / "dangling.json")
    with pytest.raises(DDUFUsageError, match="exists"):
        unpack(packed["tiny-sd"], out)
    unpack(packed["tiny-sd"], out, force=True)
    assert not (out / "unet" / "config.json").is_symlink() and not (out / "model_index.json").is_symlink()
    assert _tree(outside) == ["victim.json"] and (outside / "victim.json").read_text() == "keep"


def test_unpack_refuses_a_folder_link_leading_out(packed: dict[str, Path], tmp_path: Path) -> None:
    """Regression pins: a component folder in the output that links outside it: refused naming it, nothing
    written (not even the entries before it); one linking inside the output is followed (the user's layout)."""
    from dduf_plus.errors import DDUFUsageError
    from dduf_plus.format.unpack import unpack

    out, outside = tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    out.mkdir()
    (out / "vae").symlink_to(outside, target_is_directory=True)
    with pytest.raises(DDUFUsageError, match="vae is a link"):
        unpack(packed["tiny-sd"], out, force=True)
    assert _tree(outside) == [] and _tree(out) == ["vae"]
    (out / "vae").unlink()
    (out / "inside").mkdir()
    (out / "vae").symlink_to(out / "inside", target_is_directory=True)
    unpack(packed["tiny-sd"], out, force=True)
    assert (out / "inside" / "config.json").is_file()


def test_unpack_refuses_a_folder_link_planted_while_it_writes(packed: dict[str, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression pin (TOCTOU): every name was checked, then, while the first entries are written, a component's
    folder is planted as a link leading out: its entries are refused (``DDUFPathError``), nothing lands outside."""
    from dduf_plus.errors import DDUFPathError
    from dduf_plus.format import unpack as unpack_mod

    out, outside = tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    real = unpack_mod._copy_entry

    def plant(archive: Any, name: str, dst: int) -> None:
        if not (out / "vae").is_symlink():
            (out / "vae").symlink_to(outside, target_is_directory=True)
        real(archive, name, dst)

    monkeypatch.setattr(unpack_mod, "_copy_entry", plant)
    with pytest.raises(DDUFPathError, match="outside"):
        unpack_mod.unpack(packed["tiny-sd"], out)
    assert _tree(outside) == []


def test_unpack_of_an_archive_cut_while_it_is_copied_keeps_no_file(packed: dict[str, Path], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression pin: the archive truncated after it was opened and checked (``copy_file_range`` meets its end):
    a ``DDUFIOError``; no weights file, no temporary file left in the output."""
    from dduf_plus.errors import DDUFIOError
    from dduf_plus.format import unpack as unpack_mod

    archive = Path(shutil.copy(packed["tiny-sd"], tmp_path / "a.dduf"))
    out = tmp_path / "out"
    real = unpack_mod._copy_entry

    def cut(opened: Any, name: str, dst: int) -> None:
        if name == "vae/diffusion_pytorch_model.safetensors":
            os.truncate(archive, opened.entry(name).offset + 100)
        real(opened, name, dst)

    monkeypatch.setattr(unpack_mod, "_copy_entry", cut)
    with pytest.raises(DDUFIOError, match="shrank"):
        unpack_mod.unpack(archive, out)
    assert not (out / "vae" / "diffusion_pytorch_model.safetensors").exists()
    assert not [p for p in _tree(out) if "partial" in p]


def test_complete_refuses_shards_written_while_they_were_copied(tmp_path: Path) -> None:
    """FOUND A BUG: ``dduf complete`` checked a folder of shards again after copying it by its remembered digest
    (check_shard_folder): a shard rewritten while it was copied, then put back (bytes and mtime), was hashed again,
    matched, and the archive kept the bytes copied in between. Now every file must still be at the stat it was
    verified at: any write moves the change time."""
    from dduf_plus.packing.complete import MODEL_FOLDER, _by_content
    from dduf_plus.refs import tensor_digest
    from dduf_plus.refs.resolve import Located
    from dduf_plus.refs.shard_dirs import ShardSet, check_shard_folder

    folder = tmp_path / "models" / "x"
    rec = _shards(folder)
    found = check_shard_folder(folder, rec)
    assert isinstance(found, ShardSet)
    loc = Located("transformer", MODEL_FOLDER, f"{folder} (shards)", folder, None, None, dict(found.files), True,
                  None, found.keys)
    reference = {tensor_digest.RECORD_KEY: rec, "files": dict.fromkeys(found.files, {})}
    assert _by_content("transformer", SHARD.format(2), loc, reference, "0" * 64) is None
    shard = folder / SHARD.format(2)
    original = shard.read_bytes()
    _swap_in_place(shard, _last_float_to(9.0))  # what the copy read
    _swap_in_place(shard, lambda _b: original)  # put back after the copy, bytes and mtime
    assert _by_content("transformer", SHARD.format(2), loc, reference, "0" * 64) == \
        "changed after its tensors were verified"


def test_one_command_reads_each_shard_index_and_header_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FOUND A BUG (cost): each sharded reference checked every folder of shards from scratch: an archive with
    200 references re-parsed every index (up to 16 MB of JSON each) and re-read every shard header 200 times, past
    the search's "each header read once" rule. Now one command's search parses each index and reads each header
    once, however many references (here 50, each another record of the same tensor count)."""
    from dduf_plus.refs import model_dirs, shard_dirs

    folder = tmp_path / "models" / "x"
    rec = _shards(folder)
    parsed: list[str] = []
    headers: list[str] = []
    real_json, real_header = shard_dirs._json, model_dirs.read_file_header
    monkeypatch.setattr(shard_dirs, "_json", lambda raw, index: (parsed.append(index), real_json(raw, index))[1])
    monkeypatch.setattr(model_dirs, "read_file_header", lambda p, *a: (headers.append(p.name), real_header(p, *a))[1])
    search = model_dirs.Search()
    for i in range(50):
        other = {**rec, "layout": f"{i:064x}"}  # another model of the same count and bytes
        assert shard_dirs.check_shard_folder(folder, other, search.shards) != ""
    assert isinstance(shard_dirs.check_shard_folder(folder, rec, search.shards), shard_dirs.ShardSet)
    assert parsed == [INDEX] and sorted(headers) == [SHARD.format(1), SHARD.format(2)]


def test_a_write_that_makes_no_progress_is_an_error_not_a_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FOUND A BUG (defensive): ``pwrite_all`` (``dduf unpack``'s buffered copy, the zstd transport, the remote
    fetch) looped for ever when ``pwrite`` returned 0 without an error, as some FUSE file systems do. Now a
    ``DDUFIOError`` naming the byte."""
    from dduf_plus.errors import DDUFIOError
    from dduf_plus.storage.fd_io import pwrite_all

    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    try:
        pwrite_all(fd, b"abc", 0)
        monkeypatch.setattr(os, "pwrite", lambda *_: 0)
        with no_hang(), pytest.raises(DDUFIOError, match="at byte 3"):
            pwrite_all(fd, b"def", 3)
    finally:
        os.close(fd)
    assert (tmp_path / "out").read_bytes() == b"abc"
