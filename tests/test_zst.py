"""zstd transport: byte-exact, multi-frame, atomic, hostile streams refused, cached decompression."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import zstandard

from dduf_plus.cli import main as cli_main
from dduf_plus.errors import DDUFError, DDUFFormatError, DDUFIntegrityError
from dduf_plus.format.archive import DDUFArchive
from dduf_plus.storage import zst, zst_cache

MiB = 1 << 20


@pytest.fixture(scope="module")
def blob(tmp_path_factory) -> Path:
    """5.5 MiB mixing incompressible and compressible bytes: several 1 MiB frames, a partial last one."""
    data = random.Random(0).randbytes(3 * MiB) + bytes(2 * MiB) + b"dduf" * (MiB // 8)
    path = tmp_path_factory.mktemp("zst") / "blob.bin"
    path.write_bytes(data)
    return path


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(zst.CACHE_ENV, str(root))
    return root


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".partial"))


def test_round_trip_archive_is_byte_exact(packed, tmp_path):
    archive = packed["tiny-sd"]
    result = zst.compress(archive, tmp_path / "a.dduf.zst", quiet=True)
    assert result.input_bytes == archive.stat().st_size and result.output_bytes == result.path.stat().st_size
    back = zst.decompress(result.path, tmp_path / "a.dduf", quiet=True)
    assert back.path.read_bytes() == archive.read_bytes()
    with DDUFArchive(back.path) as a:  # and it is still a valid, aligned DDUF
        assert not [f for f in a.findings if f.severity == "error"]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("long", [False, True])
def test_multi_frame_layout_and_parallel_decode(blob, tmp_path, threads, long):
    out = zst.compress(blob, tmp_path / "b.zst", frame_size=MiB, threads=threads, long=long, quiet=True)
    assert out.frames == 6  # 5.5 MiB in 1 MiB frames
    fd = os.open(out.path, os.O_RDONLY)
    try:
        layout = zst.read_layout(fd, out.output_bytes)
    finally:
        os.close(fd)
    assert layout.total_size == blob.stat().st_size and layout.frame_size == MiB
    sizes = [f.size for f in layout.frames]
    assert sizes[0] == 0 and sizes[1:] == [MiB] * 5 + [MiB // 2]  # header frame, then data frames
    raw = out.path.read_bytes()
    for frame in layout.frames[1:]:  # independent frames, each with content size and checksum
        params = zstandard.get_frame_parameters(raw[frame.offset : frame.offset + 18])
        assert params.has_checksum and params.content_size == frame.size
    back = zst.decompress(out.path, tmp_path / "b.bin", threads=threads, quiet=True)
    assert back.path.read_bytes() == blob.read_bytes()


def test_empty_input(tmp_path):
    src = tmp_path / "empty.bin"
    src.write_bytes(b"")
    out = zst.compress(src, tmp_path / "empty.zst", quiet=True)
    assert zst.decompress(out.path, tmp_path / "back.bin", quiet=True).path.read_bytes() == b""


@pytest.mark.skipif(shutil.which("zstd") is None, reason="zstd CLI not installed")
def test_plain_zstd_cli_decodes_our_stream(blob, tmp_path):
    out = zst.compress(blob, tmp_path / "b.zst", frame_size=MiB, quiet=True)
    decoded = subprocess.run(["zstd", "-d", "-c", str(out.path)], capture_output=True, check=True).stdout
    assert decoded == blob.read_bytes()


def test_foreign_stream_without_seek_table(blob, tmp_path):
    """A stream written by plain zstd (here: two concatenated frames) decodes sequentially."""
    data = blob.read_bytes()
    frame = zstandard.ZstdCompressor(level=1).compress(data)
    (tmp_path / "f.zst").write_bytes(frame + frame)
    assert zst.decompress(tmp_path / "f.zst", tmp_path / "f.bin", quiet=True).path.read_bytes() == data + data
    (tmp_path / "t.zst").write_bytes(frame + frame[:-10])
    with pytest.raises(DDUFFormatError, match="truncated"):
        zst.decompress(tmp_path / "t.zst", tmp_path / "t.bin", quiet=True)
    assert not (tmp_path / "t.bin").exists() and not _leftovers(tmp_path)


@pytest.mark.parametrize("cut", ["mid_frame", "seek_table", "at_frame_boundary", "header_only"])
def test_truncated_stream_is_refused(blob, tmp_path, cut):
    out = zst.compress(blob, tmp_path / "b.zst", frame_size=MiB, quiet=True)
    raw = out.path.read_bytes()
    fd = os.open(out.path, os.O_RDONLY)
    layout = zst.read_layout(fd, len(raw))
    os.close(fd)
    last = layout.frames[-1]
    keep = {"mid_frame": len(raw) // 2, "seek_table": len(raw) - 3,
            "at_frame_boundary": last.offset + last.compressed_size, "header_only": zst.HEADER_FRAME_SIZE}[cut]
    bad = tmp_path / "cut.zst"
    bad.write_bytes(raw[:keep])
    with pytest.raises(DDUFFormatError, match="truncated"):
        zst.decompress(bad, tmp_path / "cut.bin", quiet=True)
    assert not (tmp_path / "cut.bin").exists() and not _leftovers(tmp_path)


def test_corrupt_frame_fails_checksum(blob, tmp_path):
    out = zst.compress(blob, tmp_path / "b.zst", frame_size=MiB, quiet=True)
    raw = bytearray(out.path.read_bytes())
    raw[len(raw) // 3] ^= 0x5A  # inside an incompressible frame: the bytes decode, the checksum fails
    bad = tmp_path / "bad.zst"
    bad.write_bytes(bytes(raw))
    with pytest.raises(DDUFError) as info:
        zst.decompress(bad, tmp_path / "bad.bin", quiet=True)
    assert isinstance(info.value, (DDUFIntegrityError, DDUFFormatError))
    assert not (tmp_path / "bad.bin").exists() and not _leftovers(tmp_path)


def test_inconsistent_seek_table_and_bad_magic(blob, tmp_path):
    out = zst.compress(blob, tmp_path / "b.zst", frame_size=MiB, quiet=True)
    raw = bytearray(out.path.read_bytes())
    # the last table entry's decompressed size (the footer is 9 bytes, entries 8)
    struct.pack_into("<I", raw, len(raw) - 9 - 4, 12345)
    (tmp_path / "t.zst").write_bytes(bytes(raw))
    with pytest.raises(DDUFFormatError, match="seek table"):
        zst.decompress(tmp_path / "t.zst", tmp_path / "t.bin", quiet=True)
    (tmp_path / "m.zst").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(DDUFFormatError, match="not a zstd stream"):
        zst.decompress(tmp_path / "m.zst", tmp_path / "m.bin", quiet=True)


def test_failed_write_leaves_existing_output_untouched(blob, tmp_path, monkeypatch):
    dst = tmp_path / "out.zst"
    dst.write_bytes(b"previous")
    calls = {"n": 0}
    real = os.preadv

    def failing(fd, buffers, offset):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(5, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(zst.os, "preadv", failing)
    with pytest.raises(OSError):
        zst.compress(blob, dst, frame_size=MiB, quiet=True)
    assert dst.read_bytes() == b"previous" and not _leftovers(tmp_path)


def test_refuses_to_overwrite_its_input(blob, tmp_path):
    copy = tmp_path / "x.zst"
    shutil.copy(blob, copy)
    with pytest.raises(DDUFError, match="overwrite the input"):
        zst.compress(copy, copy, quiet=True)


def test_cached_decompress_reuses_by_content(packed, tmp_path, cache, monkeypatch):
    src = zst.compress(packed["tiny-dit"], tmp_path / "a.dduf.zst", quiet=True).path
    first = zst_cache.cached_decompress(src)
    assert first.parent == cache / "zst"
    assert first.name == hashlib.sha256(src.read_bytes()).hexdigest() + ".dduf"  # the .zst's sha256 (LFS oid)
    assert first.read_bytes() == packed["tiny-dit"].read_bytes()

    def no_decompress(*args, **kwargs):
        raise AssertionError("decompressed again")

    monkeypatch.setattr(zst_cache, "decompress_into", no_decompress)
    assert zst_cache.cached_decompress(src) == first  # same path, unchanged: a stat and the memo
    twin = tmp_path / "copy" / "b.dduf.zst"
    twin.parent.mkdir()
    shutil.copy(src, twin)
    assert zst_cache.cached_decompress(twin) == first  # same content elsewhere: hashed, then shared
    monkeypatch.undo()
    monkeypatch.setenv(zst.CACHE_ENV, str(cache))
    other = zst.compress(packed["tiny-sd"], tmp_path / "a.dduf.zst", quiet=True).path  # replaced in place
    second = zst_cache.cached_decompress(other)
    assert second != first and second.read_bytes() == packed["tiny-sd"].read_bytes()
    with zst_cache.validation_archive(other) as archive:  # a verified entry is validated in place
        assert archive == second
    with zst_cache.validation_archive(packed["tiny-sd"]) as archive:  # a plain archive is itself
        assert archive == packed["tiny-sd"]


def test_cache_root_follows_hf_home(monkeypatch, tmp_path):
    monkeypatch.delenv(zst.CACHE_ENV, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert zst_cache.cache_root() == tmp_path / "hf" / "dduf_plus"


def test_cli_compress_decompress(packed, tmp_path, capsys):
    archive = tmp_path / "x.dduf"
    shutil.copy(packed["tiny-sd"], archive)
    assert cli_main(["compress", str(archive), "--level", "1", "--frame-size", "1M"]) == 0
    assert "ratio" in capsys.readouterr().out
    assert cli_main(["compress", str(archive), "-q"]) == 2  # exists: refuses without --force (usage, docs/cli.md)
    assert "exists" in capsys.readouterr().err
    assert cli_main(["decompress", str(archive) + ".zst", "-o", str(tmp_path / "y.dduf"), "-q"]) == 0
    assert (tmp_path / "y.dduf").read_bytes() == archive.read_bytes()
    (tmp_path / "junk.dduf.zst").write_bytes(b"junk" * 10)
    assert cli_main(["decompress", str(tmp_path / "junk.dduf.zst"), "-q"]) == 1


def test_load_dduf_reads_zst_directly(packed, tmp_path, cache):
    import dduf_plus.loading.pipeline as pipeline

    src = zst.compress(packed["tiny-sd"], tmp_path / "tiny-sd.dduf.zst", quiet=True).path
    pipe = pipeline.load_dduf(src)
    assert pipe.unet is not None
    assert list((cache / "zst").glob("*.dduf"))
