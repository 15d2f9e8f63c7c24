"""App model folders as hostile input (``load_dduf(model_dirs=...)``, ``DDUF_PLUS_MODEL_DIRS``, ``--model-dir``):
folders full of downloaded files the user did not write, which may change, vanish or be swapped while they are
searched, hashed and mapped. Every case ends in a rejected candidate or a ``DDUFError`` naming the file, never a
raw ``OSError``, a hang, a SIGBUS or tensors other than the verified ones."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import PIPELINES
from dduf_plus.errors import DDUFIOError, DDUFReferenceError
from dduf_plus.format.safetensors_header import TensorInfo
from dduf_plus.refs import model_dirs, tensor_digest

TINY_SD = PIPELINES / "tiny-sd"
WEIGHTS = "diffusion_pytorch_model.safetensors"

# Builds the tiny SD VAE's reference (as ``dduf pack`` records it) and a ComfyUI-like folder holding its file;
# shared by the tests that run in a subprocess (a SIGBUS or a blocked open must not take pytest down).
_SETUP = """
import hashlib, os, shutil, sys
from pathlib import Path
from dduf_plus.refs import model_dirs, tensor_digest

WEIGHTS = "diffusion_pytorch_model.safetensors"

def vae_reference(tmp, tiny):
    folder = Path(tmp) / "vae"
    shutil.copytree(Path(tiny) / "vae", folder)
    files = {name: {"sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest(),
                    "size": (folder / name).stat().st_size} for name in (WEIGHTS, "config.json")}
    models = Path(tmp) / "models"
    models.mkdir()
    shutil.copy(folder / WEIGHTS, models / "vae.safetensors")
    return {"files": files, **tensor_digest.tensor_record(folder, files)}, models
"""


def _vae_reference(tmp: Path) -> tuple[dict[str, Any], Path]:
    scope: dict[str, Any] = {}
    exec(_SETUP, scope)
    return scope["vae_reference"](tmp, TINY_SD)  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(model_dirs.ENV, raising=False)


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """``body`` after :data:`_SETUP` in a fresh interpreter (``ref``, ``models`` set), with a generous guard:
    the old code blocked for ever on a FIFO (the guard is what fails then, not a timing assert)."""
    script = _SETUP + f"ref, models = vae_reference({str(tmp_path)!r}, {str(TINY_SD)!r})\n" + textwrap.dedent(body)
    env = {**os.environ, "DDUF_PLUS_CACHE": str(tmp_path / "cache")}
    try:
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the search blocked (an open that never returns)")


def test_the_reference_is_found_as_it_is(tmp_path: Path) -> None:
    ref, models = _vae_reference(tmp_path)
    found = model_dirs.find_component("vae", ref, [models])
    assert isinstance(found, model_dirs.Match) and found.files[WEIGHTS] == models / "vae.safetensors"


def test_a_file_gone_between_its_header_and_its_hash_is_a_rejected_candidate(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An app deleting or moving a file while a load searches: 0.9.0 raised a raw FileNotFoundError out of
    ``load_dduf``; now the file is one rejected candidate, said, and the search goes on."""
    ref, models = _vae_reference(tmp_path)
    real = model_dirs.read_file_header

    def then_gone(path: Any, *args: Any) -> Any:
        header = real(path, *args)
        Path(path).unlink()
        return header

    monkeypatch.setattr(model_dirs, "read_file_header", then_gone)
    found = model_dirs.find_component("vae", ref, [models])
    assert isinstance(found, str) and "vae.safetensors: not readable" in found and "No such file" in found


def test_a_file_truncated_while_it_is_hashed_is_rejected_not_a_sigbus(tmp_path: Path) -> None:
    """A download manager rewriting a file (truncate, then write) while it is hashed: 0.9.0 hashed from a map,
    whose pages past the new end killed the process with SIGBUS (exit -7). Now the bytes are read, and a short
    read rejects the file, naming it."""
    done = _run(tmp_path, """
        import types
        class Truncating:  # the file is truncated right after the first tensor's bytes are hashed
            def __init__(self, *data):
                self.h, self.armed = hashlib.sha256(*data), not data
            def update(self, data):
                if self.armed:
                    os.truncate(models / "vae.safetensors", 0)
                    self.armed = False
                self.h.update(data)
            def digest(self):
                return self.h.digest()
            def hexdigest(self):
                return self.h.hexdigest()
        tensor_digest.hashlib = types.SimpleNamespace(sha256=Truncating)
        print(model_dirs.find_component("vae", ref, [models]))
    """)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "vae.safetensors: not readable" in done.stdout and "changed while it was read" in done.stdout


def test_a_fifo_put_in_a_files_place_is_refused_without_blocking(tmp_path: Path) -> None:
    """A file replaced by a FIFO between the listing (a regular file then) and the header read: 0.9.0's open
    blocked for ever (no writer). Now every open of a model-folder file is non-blocking and takes regular
    files only."""
    done = _run(tmp_path, """
        real = model_dirs._walk
        def swapped(dirs):
            for path in real(dirs):
                path.unlink()
                os.mkfifo(path)
                yield path
        model_dirs._walk = swapped
        print(model_dirs.find_component("vae", ref, [models]))
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "vae.safetensors: not a readable safetensors file" in done.stdout and "not a regular file" in done.stdout


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX file kinds")
def test_fifos_devices_loops_and_unreadable_folders_are_skipped(tmp_path: Path) -> None:
    ref, models = _vae_reference(tmp_path)
    (models / "vae.safetensors").unlink()
    os.mkfifo(models / "a_fifo.safetensors")
    os.symlink("/dev/zero", models / "b_zero.safetensors")
    os.symlink(models, models / "c_loop")  # a symlinked folder: not followed
    os.symlink(models / "d_self.safetensors", models / "d_self.safetensors")  # a link to itself
    locked = models / "e_locked"
    locked.mkdir()
    (locked / "vae.safetensors").write_bytes(b"not a safetensors file")
    locked.chmod(0)
    try:
        found = model_dirs.find_component("vae", ref, [models])
    finally:
        locked.chmod(0o700)
    assert isinstance(found, str) and found.startswith("no file in")
    if os.geteuid() != 0:  # root reads the locked folder anyway
        assert "rejected" not in found  # nothing was opened: not a FIFO, a device, a loop or a locked file


def test_a_huge_folder_is_read_only_up_to_the_entry_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """0.9.0 read and sorted a whole directory before counting its entries against the budget (a folder of
    millions was read whole); now no more entries are taken from the directory than the budget has left."""
    ref, models = _vae_reference(tmp_path)
    crowd = models / "crowd"
    crowd.mkdir()
    for i in range(400):
        (crowd / f"{i:04d}.txt").touch()
    taken = []
    real = os.scandir

    class Counted:
        def __init__(self, path: Any):
            self.it = real(path)

        def __enter__(self) -> Counted:
            return self

        def __exit__(self, *exc: Any) -> None:
            self.it.close()

        def __iter__(self) -> Iterator[os.DirEntry[str]]:
            for e in self.it:
                taken.append(e.name)
                yield e

    monkeypatch.setattr(model_dirs, "MAX_FILES", 50)
    monkeypatch.setattr(model_dirs.os, "scandir", Counted)
    model_dirs.find_component("vae", ref, [crowd])
    assert 0 < len(taken) <= 51


def _ldm_vae_match(tmp_path: Path) -> tuple[model_dirs.Match, Path, Path]:
    """The tiny VAE in the LDM layout in a model folder (found and used in place), and a file of the same size
    with other bytes."""
    import torch
    from safetensors.torch import save_file
    from single_file_ckpt import _config, _state, vae_to_ldm

    ref, models = _vae_reference(tmp_path)
    (models / "vae.safetensors").unlink()
    ldm = {k.removeprefix("first_stage_model."): v
           for k, v in vae_to_ldm(_state(TINY_SD, "vae"), _config(TINY_SD, "vae")).items()}
    path = models / "vae-ldm.safetensors"
    save_file(ldm, path)
    other = tmp_path / "other.safetensors"
    save_file({k: v + torch.ones_like(v) for k, v in ldm.items()}, other)
    assert other.stat().st_size == path.stat().st_size
    found = model_dirs.find_component("vae", ref, [models])
    assert isinstance(found, model_dirs.Match) and found.in_place is not None
    return found, path, other


def _mapped_files(found: model_dirs.Match) -> Any:
    from dduf_plus.loading.files import FolderComponentFiles
    from dduf_plus.loading.in_place import MappedPartFiles

    assert found.in_place is not None
    return MappedPartFiles(FolderComponentFiles(found.files["config.json"].parent, "vae"), "vae", found.in_place)


def test_in_place_maps_only_the_file_that_was_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """0.9.0 checked the file's stat by path, then opened the path: a file replaced in between (same size) was
    mapped unverified, and the model got its bytes silently. Now the opened descriptor's stat is the one
    compared: the verified tensors, or a refusal."""
    import torch
    from single_file_ckpt import _state

    found, path, other = _ldm_vae_match(tmp_path)
    expected = _state(TINY_SD, "vae")
    real = model_dirs.stat_key

    def then_replaced(p: Any) -> Any:  # the race: right after a check by path
        key = real(p)
        if Path(p) == path and other.exists():
            os.replace(other, path)
        return key

    monkeypatch.setattr(model_dirs, "stat_key", then_replaced)
    files = _mapped_files(found)
    try:
        tensors = files.tensors(files.weight_files())
    except DDUFReferenceError as e:
        assert "changed since its tensors were verified" in str(e)
    else:
        assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    if other.exists():  # not raced above: replace it plainly, before the map
        os.replace(other, path)
    with pytest.raises(DDUFReferenceError, match="changed since its tensors were verified"):
        fresh = _mapped_files(found)
        fresh.tensors(fresh.weight_files())


def test_in_place_on_a_file_system_that_cannot_map_is_a_dduf_error(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """0.9.0 raised the raw OSError (ENODEV: some FUSE and network file systems cannot map files)."""
    found, _path, _other = _ldm_vae_match(tmp_path)

    def no_map(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(mmap, "mmap", no_map)
    files = _mapped_files(found)
    with pytest.raises(DDUFIOError, match=r"'vae': .*vae-ldm\.safetensors cannot be mapped: .*No such device"):
        files.tensors(files.weight_files())


def test_hashing_by_reads_gives_the_digest_archives_record(tmp_path: Path) -> None:
    """The digest by positioned reads is the one archives packed before (by maps) recorded: computed here
    independently from the file's bytes."""
    ref, models = _vae_reference(tmp_path)
    path = models / "vae.safetensors"
    header = model_dirs.read_file_header(path, path.name)
    raw = path.read_bytes()
    h = hashlib.sha256(b"dduf-tensors-v1\n")
    for name in sorted(header.tensors):
        t = header.tensors[name]
        data = raw[header.data_start + t.begin:header.data_start + t.end]
        h.update(f"{name}\0{t.dtype}\0{','.join(map(str, t.shape))}\0".encode() + hashlib.sha256(data).digest())
    assert tensor_digest.tensors_digest([(path, header)]) == h.hexdigest() == ref[tensor_digest.RECORD_KEY]["sha256"]


@pytest.mark.parametrize("rows, cols", [(3, 1000), (1000, 3), (7, 7), (1, 1)])
def test_a_transposed_tensor_is_gathered_in_blocks_not_one_column_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int, cols: int) -> None:
    """A tensor a file holds transposed (OpenCLIP's projection) is hashed and copied from its [rows, cols]
    matrix: 0.9.0 made one slice per column (a [1, 10**8] matrix declared by a hostile header: 10**8 Python
    steps); now a slice is a block of columns, at most min(rows, cols) steps each. Bytes equal torch's
    transpose, across block edges too."""
    import torch

    matrix = torch.arange(rows * cols, dtype=torch.float16).reshape(rows, cols)
    path = tmp_path / "m.bin"
    path.write_bytes(b"\0" * 8 + bytes(matrix.view(torch.uint8).flatten().tolist()))
    info = TensorInfo("w", "float16", (cols, rows), 0, rows * cols * 2)
    src = model_dirs.Source(info, ((0, rows * cols * 2),), rows=rows)
    want = bytes(matrix.t().contiguous().view(torch.uint8).flatten().tolist())
    for slice_bytes in (4 << 20, 6):  # one block; blocks of a few columns (edges inside the matrix)
        monkeypatch.setattr(model_dirs, "SLICE", slice_bytes)
        with tensor_digest.open_reads(path) as reads:
            chunks = [bytes(c) for c in model_dirs._source_chunks(reads, 8, src)]
        assert b"".join(chunks) == want
        if slice_bytes > rows * cols * 2:
            assert len(chunks) == min(cols, 1 if rows <= cols else cols)


def test_read_file_header_takes_regular_files_only(tmp_path: Path) -> None:
    """A folder named like a weights file (an app's half-extracted download): 0.9.0 raised IsADirectoryError (an
    OSError, not a DDUFError) from every caller; now the one DDUFError, naming the path."""
    from dduf_plus.errors import DDUFFormatError, DDUFPackError

    folder = tmp_path / "model.safetensors"
    folder.mkdir()
    with pytest.raises(DDUFFormatError, match=r"not a regular file .*model\.safetensors"):
        model_dirs.read_file_header(folder, folder.name)
    with pytest.raises(DDUFPackError, match="not a regular file"):
        model_dirs.read_file_header(folder, folder.name, DDUFPackError)
