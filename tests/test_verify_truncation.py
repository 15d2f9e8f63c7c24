"""An archive truncated while it is read (issue 18 item 9): ``validate --verify`` hashed through one mmap, so a
listed archive truncated during hashing killed the whole ``--from-file`` batch with SIGBUS (exit -7, no line,
nothing on stderr). Now hashing reads with ``preadv`` and a short read is that source's ``io_error`` line; the
batch goes on. ``load_dduf`` checks the file's size before tensors view its mapping and after each model is
built (docs/security.md, "Truncation while reading", for what cannot be caught)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, load_make_hostile
from dduf_plus.errors import DDUFError, DDUFIOError
from dduf_plus.format import validate as validate_module
from dduf_plus.format.archive import DDUFArchive

mh = load_make_hostile()

# A --from-file batch in a child process (a SIGBUS there must not take pytest down). The first listed archive is
# truncated while it is being hashed: when the first large block reaches zlib.crc32 (the old code passed it a
# view of the mapping, the new one a buffer it read), before the rest of the entry is read.
_BATCH = r"""
import os, sys, zlib
victim, keep, listing = sys.argv[1], int(sys.argv[2]), sys.argv[3]
original = zlib.crc32
done = []

def truncating(data, value=0):
    if not done and len(data) >= 1 << 20:
        done.append(True)
        os.truncate(victim, keep)
    return original(data, value)

zlib.crc32 = truncating
from dduf_plus.cli import main
sys.exit(main(["validate", "--verify", "--jobs", "1", "--json-lines", "--from-file", listing]))
"""
PAYLOAD = 20 << 20  # more than one hashing block (8 MiB): the truncation lands between two reads


def _archive(path: Path, payload: int) -> Path:
    entries = mh.base_entries() | {"tokenizer/blob.txt": os.urandom(payload)}
    return mh.write_valid(path, entries)


@pytest.mark.parametrize("keep", ["half", "at-the-entry", "one-byte-short"])
def test_a_truncated_archive_is_an_io_error_line_and_the_batch_goes_on(tmp_path: Path, keep: str) -> None:
    victim = _archive(tmp_path / "victim.dduf", PAYLOAD)
    good = [_archive(tmp_path / f"good{i}.dduf", 4096) for i in range(2)]
    size = victim.stat().st_size
    with DDUFArchive(victim) as archive:
        blob = archive.entry("tokenizer/blob.txt")
    cut = {"half": size // 2, "at-the-entry": blob.offset, "one-byte-short": blob.offset + blob.length - 1}[keep]
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join(str(p) for p in [good[0], victim, good[1]]) + "\n")
    proc = subprocess.run([sys.executable, "-c", _BATCH, str(victim), str(cut), str(listing)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])  # was -7 (SIGBUS), no line at all
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    by_path = {line["path"]: line for line in lines}
    assert set(by_path) == {str(p) for p in [good[0], victim, good[1]]}, lines
    assert by_path[str(good[0])]["valid"] and by_path[str(good[1])]["valid"]
    error = by_path[str(victim)]["io_error"]
    assert str(victim) in error and ("truncated" in error or "ended" in error), error
    assert "victim.dduf" in proc.stderr


def test_hashing_a_shorter_file_raises_instead_of_faulting(tmp_path: Path) -> None:
    path = _archive(tmp_path / "a.dduf", 1 << 20)
    with DDUFArchive(path) as archive:
        entries = [e for e in archive.entries.values() if e.length]
        blob = archive.entry("tokenizer/blob.txt")
    os.truncate(path, blob.offset + 1000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(DDUFIOError, match="blob.txt.*ended"):
            validate_module._hash_local(fd, entries, workers=2)
    finally:
        os.close(fd)


def test_validate_of_a_file_truncated_after_opening_is_an_io_error(tmp_path: Path, monkeypatch) -> None:
    path = _archive(tmp_path / "a.dduf", 1 << 20)
    original = validate_module._verify_entries

    def truncating(archive, source, *args, **kwargs):
        os.truncate(path, path.stat().st_size // 3)
        return original(archive, source, *args, **kwargs)

    monkeypatch.setattr(validate_module, "_verify_entries", truncating)
    with pytest.raises(DDUFIOError, match=r"a\.dduf.*(ended|truncated)"):
        validate_module.validate(path, verify=True)


def test_load_checks_the_archive_did_not_shrink(tmp_path: Path) -> None:
    """Before tensors view the mapping (and after each model is built) the loader compares the file's size with
    the size it opened: a truncated archive is a DDUFIOError naming it, not a SIGBUS on the first page touched."""
    from dduf_plus.loading.files import ArchiveComponentFiles

    path = _archive(tmp_path / "a.dduf", 1 << 20)
    archive = DDUFArchive(path)
    try:
        files = ArchiveComponentFiles(archive, "unet")
        assert set(files.tensors(["diffusion_pytorch_model.safetensors"])) == {"bias", "weight"}
        os.truncate(path, path.stat().st_size - 4096)
        with pytest.raises(DDUFError, match="shrank .* while unet was loading"):
            files.tensors(["diffusion_pytorch_model.safetensors"])
        with pytest.raises(DDUFIOError):
            files.check_unchanged()
    finally:
        archive.close()
