"""Caches and decompression against hostile input (issue 10, items 2 and 3).

- The zst cache never trusts a name: its key is the sha256 of the .zst's bytes; memos and entry records are
  signed with a per-cache secret; a hit is served only when the entry's content is vouched for (stat key, or
  rehashed). Planted entries, records, memos, links and edited entries are decompressed again.
- The tokenizer-file cache serves a folder only if it holds exactly the expected files with the expected bytes.
- Decompression has a budget (absolute cap, ratio cap above a floor, free disk space): a size the stream
  announces is checked before anything is written, a stream that announces none is cut off; `validate` reports
  Z022 and never writes the persistent cache (a private temporary file, removed whatever happens).
- The verified-hash memory writes through Confined."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import namedtuple
from pathlib import Path

import pytest
import zstandard

from conftest import ROOT
from dduf_plus.cli import main as cli_main
from dduf_plus.errors import DDUFError
from dduf_plus.format.validate import validate
from dduf_plus.storage import signed, zst, zst_budget, zst_cache
from dduf_plus.storage.zst import DecompressionBudget, DecompressionBudgetError, decompression_budget

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture(autouse=True)
def private_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A private dduf_plus cache and temporary folder per test (validation's temp files land in the latter)."""
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv(zst.CACHE_ENV, str(cache))
    monkeypatch.delenv(zst.MAX_DECOMPRESSED_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return {"cache": cache, "tmp": tmp}


@pytest.fixture
def work(tmp_path: Path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


def leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


# --- streams -------------------------------------------------------------------------------------------
def zero_frame(size: int, *, content_size: bool = True) -> bytes:
    """One zstd frame of ``size`` zero bytes (a few KB for hundreds of MiB), compressed chunk by chunk."""
    cobj = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=content_size).compressobj(
        size=size if content_size else -1)
    chunk = bytes(8 * MiB)
    parts, left = [], size
    while left:
        n = min(left, len(chunk))
        parts.append(cobj.compress(memoryview(chunk)[:n]))
        left -= n
    parts.append(cobj.flush())
    return b"".join(parts)


@pytest.fixture(scope="module")
def frame_256m() -> bytes:
    return zero_frame(256 * MiB)


def dduf_plus_stream(path: Path, frame: bytes, frame_size: int, frames: int) -> Path:
    """What `dduf compress` writes: header frame, ``frames`` copies of ``frame``, seek table."""
    header = zst.header_frame(frame_size * frames, frame_size)
    table = zst.seek_table([(len(header), 0)] + [(len(frame), frame_size)] * frames)
    path.write_bytes(header + frame * frames + table)
    return path


@pytest.fixture
def bomb(tmp_path: Path, frame_256m: bytes) -> Path:
    """The issue's case: ~65 KB of .zst that decompresses to 2 GiB of zeros (8 frames of 256 MiB)."""
    path = dduf_plus_stream(tmp_path / "small.dduf.zst", frame_256m, 256 * MiB, 8)
    assert path.stat().st_size < 100_000
    return path


def no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("decoded although the announced size is over the budget")

    monkeypatch.setattr(zst, "_decode_into", refuse)


# --- the budget ----------------------------------------------------------------------------------------
def test_budget_parsing_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    default = decompression_budget()
    assert (default.max_bytes, default.max_ratio) == (256 * GiB, 16.0)
    assert default.limit(1000) == zst.RATIO_FLOOR  # a small stream may always expand to the floor
    assert default.limit(10 * GiB) == 160 * GiB and default.limit(100 * GiB) == 256 * GiB
    assert DecompressionBudget.parse("64G") == DecompressionBudget(64 * GiB, None, "--max-decompressed=64G")
    assert DecompressionBudget.parse("500MiB").max_bytes == 500 * MiB
    assert DecompressionBudget.parse("32x").max_ratio == 32 and DecompressionBudget.parse("32x").max_bytes == 256 * GiB
    both = DecompressionBudget.parse("1T, 4x")
    assert (both.max_bytes, both.max_ratio) == (1 << 40, 4.0)
    assert DecompressionBudget.parse("unlimited").limit(1) is None
    assert decompression_budget(123).max_bytes == 123 and decompression_budget("2x").max_ratio == 2
    for junk in ("lots", "-1G", "0x", "1G,2G", "x", ""):
        with pytest.raises(DDUFError, match="expected a size"):
            DecompressionBudget.parse(junk)
    monkeypatch.setenv(zst.MAX_DECOMPRESSED_ENV, "3G")
    assert decompression_budget().max_bytes == 3 * GiB and "DDUF_PLUS_MAX_DECOMPRESSED" in str(decompression_budget())
    monkeypatch.setenv(zst.MAX_DECOMPRESSED_ENV, "plenty")
    with pytest.raises(DDUFError, match=r"\$DDUF_PLUS_MAX_DECOMPRESSED='plenty'"):
        decompression_budget()


def test_announced_bomb_is_refused_before_writing(bomb: Path, tmp_path: Path, monkeypatch, private_dirs) -> None:
    no_decoding(monkeypatch)
    out = tmp_path / "out" / "big.dduf"
    with pytest.raises(DecompressionBudgetError) as err:
        zst.decompress(bomb, out, quiet=True)
    message = str(err.value)
    assert str(bomb) in message and "2.0 GiB" in message and "budget" in message
    assert "--max-decompressed" in message and "DDUF_PLUS_MAX_DECOMPRESSED" in message and "max_decompressed=" in message
    assert leftovers(out.parent) == []
    with pytest.raises(DecompressionBudgetError):
        zst_cache.cached_decompress(bomb)
    assert [p for p in leftovers(private_dirs["cache"]) if p.endswith((".dduf", ".partial"))] == []


def test_ratio_cap_above_the_floor_and_raising_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zst_budget, "RATIO_FLOOR", MiB)  # a 16 MiB stream stands for a big one
    src = tmp_path / "zeros.bin"
    src.write_bytes(bytes(16 * MiB))
    packed = zst.compress(src, tmp_path / "zeros.bin.zst", frame_size=4 * MiB, quiet=True).path
    with pytest.raises(DecompressionBudgetError, match=r"16x the compressed size"):
        zst.decompress(packed, tmp_path / "a.bin", quiet=True)
    for budget in ("unlimited", "32M", "100000x", 16 * MiB):
        out = zst.decompress(packed, tmp_path / "b.bin", quiet=True, max_decompressed=budget)
        assert out.output_bytes == 16 * MiB
    with pytest.raises(DecompressionBudgetError, match="over the decompression budget"):
        zst.decompress(packed, tmp_path / "c.bin", quiet=True, max_decompressed="8M")
    monkeypatch.setenv(zst.MAX_DECOMPRESSED_ENV, "unlimited")
    assert zst_cache.cached_decompress(packed).stat().st_size == 16 * MiB
    assert not (tmp_path / "a.bin").exists() and not (tmp_path / "c.bin").exists()


def test_streams_without_sizes_are_cut_off(work: Path) -> None:
    """The zstd CLI reading a pipe writes no content size: the budget is enforced while decoding."""
    tmp_path = work
    stream = tmp_path / "piped.dduf.zst"
    stream.write_bytes(zero_frame(24 * MiB, content_size=False))
    out = tmp_path / "out.dduf"
    with pytest.raises(DecompressionBudgetError, match=r"without announcing its size \(stopped there\)"):
        zst.decompress(stream, out, quiet=True, max_decompressed="4M")
    assert leftovers(tmp_path) == ["piped.dduf.zst"]
    assert zst.decompress(stream, out, quiet=True).output_bytes == 24 * MiB  # within the default floor


def test_foreign_frames_that_announce_sizes_are_checked_before_writing(work: Path, monkeypatch) -> None:
    tmp_path = work
    stream = tmp_path / "cli.dduf.zst"
    stream.write_bytes(zero_frame(24 * MiB) * 3)  # like `zstd` on files: content sizes in every frame header
    no_decoding(monkeypatch)
    with pytest.raises(DecompressionBudgetError, match="announces 72.0 MiB"):
        zst.decompress(stream, tmp_path / "out.dduf", quiet=True, max_decompressed="64M")
    assert leftovers(tmp_path) == ["cli.dduf.zst"]


def test_free_disk_space_is_checked_first(bomb: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10 * GiB, 9 * GiB, 300 * MiB))
    no_decoding(monkeypatch)
    with pytest.raises(DecompressionBudgetError, match=r"needs 2.0 GiB.* 44.0 MiB free \(keeping 256.0 MiB spare\)"):
        zst.decompress(bomb, tmp_path / "x.dduf", quiet=True, max_decompressed="unlimited")
    report = validate(bomb, max_decompressed="unlimited")
    assert report.codes == ["Z022"] and "free" in report.errors[0].message


def test_a_stream_without_sizes_stops_at_the_free_space(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = work / "piped.dduf.zst"
    stream.write_bytes(zero_frame(24 * MiB, content_size=False))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10 * GiB, 9 * GiB, zst.DISK_RESERVE + 4 * MiB))
    with pytest.raises(DecompressionBudgetError, match=r"announces no size and decoded past the 4.0 MiB free"):
        zst.decompress(stream, work / "out.dduf", quiet=True)
    assert leftovers(work) == ["piped.dduf.zst"]


def test_parallel_frames_stop_together(work: Path) -> None:
    """A corrupt frame stops the others within a chunk; nothing is left behind."""
    tmp_path = work
    src = tmp_path / "r.bin"
    src.write_bytes(os.urandom(6 * MiB))
    packed = zst.compress(src, tmp_path / "r.bin.zst", frame_size=MiB, quiet=True).path
    fd = os.open(packed, os.O_RDONLY)
    frames = [f for f in zst.read_layout(fd, packed.stat().st_size).frames if f.size]
    os.close(fd)
    raw = bytearray(packed.read_bytes())
    raw[frames[0].offset + frames[0].compressed_size // 2] ^= 0xFF
    packed.write_bytes(bytes(raw))
    with pytest.raises(DDUFError):
        zst.decompress(packed, tmp_path / "out.bin", threads=4, quiet=True)
    assert sorted(leftovers(tmp_path)) == ["r.bin", "r.bin.zst"]


# --- validate: Z022, and never the persistent cache -----------------------------------------------------
def test_validate_bomb_is_z022_and_writes_nothing(bomb: Path, private_dirs, monkeypatch, capsys) -> None:
    no_decoding(monkeypatch)
    report = validate(bomb)
    assert not report.valid and report.codes == ["Z022"]
    assert str(bomb) in report.errors[0].message and "--max-decompressed" in report.errors[0].message
    rc = cli_main(["validate", str(bomb)])
    out = capsys.readouterr().out
    assert rc == 1 and "Z022" in out
    rc = cli_main(["validate", "--json", str(bomb)])
    assert rc == 1 and json.loads(capsys.readouterr().out)["files"][0]["errors"][0]["code"] == "Z022"
    assert not private_dirs["cache"].exists() and leftovers(private_dirs["tmp"]) == []


def test_validate_cli_option_raises_the_budget(tmp_path: Path, private_dirs, monkeypatch, capsys) -> None:
    monkeypatch.setattr(zst_budget, "RATIO_FLOOR", MiB)
    zeros = tmp_path / "zeros.dduf"
    zeros.write_bytes(bytes(8 * MiB))
    packed = zst.compress(zeros, tmp_path / "zeros.dduf.zst", quiet=True).path
    assert cli_main(["validate", str(packed)]) == 1
    assert "Z022" in capsys.readouterr().out
    assert cli_main(["validate", "--max-decompressed", "unlimited", str(packed)]) == 1  # now judged inside: not a ZIP
    out = capsys.readouterr().out
    assert "Z022" not in out and "Z001" in out
    monkeypatch.setenv(zst.MAX_DECOMPRESSED_ENV, "1G")
    assert validate(packed).codes[0] == "Z001"
    assert cli_main(["validate", "--max-decompressed", "bogus", str(packed)]) == 2
    assert "expected a size" in capsys.readouterr().err
    assert not private_dirs["cache"].exists() and leftovers(private_dirs["tmp"]) == []


def test_validate_genuine_zst_leaves_nothing(packed, tmp_path: Path, private_dirs) -> None:
    stream = zst.compress(packed["tiny-sd"], tmp_path / "tiny-sd.dduf.zst", frame_size=MiB, quiet=True).path
    assert validate(stream, verify=True).valid
    hostile = zst.compress(ROOT / "fixtures" / "hostile" / "duplicate-name.dduf", tmp_path / "dup.dduf.zst",
                           quiet=True).path
    assert "Z009" in validate(hostile).codes  # INVALID inside: still nothing kept
    assert not private_dirs["cache"].exists() and leftovers(private_dirs["tmp"]) == []


@pytest.mark.parametrize("where", ["decoding", "validating"])
def test_validate_interrupted_leaves_nothing(packed, tmp_path: Path, private_dirs, monkeypatch, where) -> None:
    stream = zst.compress(packed["tiny-sd"], tmp_path / "tiny-sd.dduf.zst", frame_size=MiB, quiet=True).path
    if where == "decoding":
        real = zst._decode_into

        def interrupted(*args, **kwargs):
            real(*args, **kwargs)  # some bytes are on disk already
            raise KeyboardInterrupt

        monkeypatch.setattr(zst, "_decode_into", interrupted)
    else:
        import dduf_plus.format.validate as validate_mod

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(validate_mod, "DDUFArchive", interrupted)
    with pytest.raises(KeyboardInterrupt):
        validate(stream)
    assert leftovers(private_dirs["tmp"]) == [] and not private_dirs["cache"].exists()


def test_validate_uses_a_verified_cache_entry_in_place(packed, tmp_path: Path, monkeypatch) -> None:
    stream = zst.compress(packed["tiny-sd"], tmp_path / "tiny-sd.dduf.zst", quiet=True).path
    entry = zst_cache.cached_decompress(stream)  # what load_dduf does
    monkeypatch.setattr(zst_cache, "decompress_into", lambda *a, **k: pytest.fail("decompressed again"))
    with zst_cache.validation_archive(stream) as archive:
        assert archive == entry
    assert validate(stream).valid


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_validate_subprocess_bomb_is_fast_and_small(bomb: Path, tmp_path: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path / "tmp"), **{zst.CACHE_ENV: str(tmp_path / "c")})
    # VmHWM, not ru_maxrss: the latter keeps the forking parent's (pytest with torch loaded) across exec
    code = ("import re, sys; from dduf_plus.cli import main; rc = main(['validate', sys.argv[1]]); "
            "print(rc, re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))")
    done = subprocess.run([sys.executable, "-c", code, str(bomb)], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=60)
    rc, rss_kb = done.stdout.strip().splitlines()[-1].split()
    assert rc == "1" and "Z022" in done.stdout and "Traceback" not in done.stderr
    assert int(rss_kb) < 200_000  # about 30 MB: nothing was decompressed
    assert leftovers(tmp_path / "tmp") == [] and not (tmp_path / "c").exists()


# --- the zst cache trusts content, never names ----------------------------------------------------------
@pytest.fixture
def streams(packed, tmp_path: Path) -> dict[str, Path]:
    """A genuine stream (tiny-sd) and an attacker's (tiny-dit)."""
    return {
        "genuine": zst.compress(packed["tiny-sd"], tmp_path / "genuine.dduf.zst", quiet=True).path,
        "evil": zst.compress(packed["tiny-dit"], tmp_path / "evil.dduf.zst", quiet=True).path,
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def count_decompressions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = zst_cache.decompress_into

    def counting(src, *args, **kwargs):
        calls.append(str(src))
        return real(src, *args, **kwargs)

    monkeypatch.setattr(zst_cache, "decompress_into", counting)
    return calls


def test_a_file_named_like_a_blob_does_not_poison_the_cache(streams, packed, tmp_path: Path) -> None:
    genuine_key = sha256(streams["genuine"])
    fake_blobs = tmp_path / "models--x--y" / "blobs"
    fake_blobs.mkdir(parents=True)
    (fake_blobs / genuine_key).symlink_to(streams["evil"])  # named like the genuine file's LFS oid
    assert zst_cache.content_key(fake_blobs / genuine_key) == sha256(streams["evil"])
    poisoned = zst_cache.cached_decompress(fake_blobs / genuine_key)
    assert poisoned.name == sha256(streams["evil"]) + ".dduf"
    assert zst_cache.cached_decompress(streams["genuine"]).read_bytes() == packed["tiny-sd"].read_bytes()


def test_a_planted_entry_or_record_is_not_served(streams, packed, private_dirs, monkeypatch) -> None:
    key = sha256(streams["genuine"])
    folder = private_dirs["cache"] / "zst"
    folder.mkdir(parents=True)
    shutil.copy(packed["tiny-dit"], folder / f"{key}.dduf")  # the attacker's archive under the genuine key
    st = (folder / f"{key}.dduf").stat()
    forged = {"v": 2, "zst_sha256": key, "sha256": sha256(packed["tiny-dit"]), "size": st.st_size,
              "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "dev": st.st_dev, "mac": "0" * 64}
    (folder / f"{key}.json").write_text(json.dumps(forged))
    unsigned = {k: v for k, v in forged.items() if k != "mac"}
    calls = count_decompressions(monkeypatch)
    assert zst_cache.cached_decompress(streams["genuine"]).read_bytes() == packed["tiny-sd"].read_bytes()
    assert len(calls) == 1
    (folder / f"{key}.json").write_text(json.dumps(unsigned))  # no signature at all
    shutil.copy(packed["tiny-dit"], folder / f"{key}.dduf")
    assert zst_cache.cached_decompress(streams["genuine"]).read_bytes() == packed["tiny-sd"].read_bytes()
    assert len(calls) == 2


def test_an_edited_entry_is_decompressed_again(streams, packed, monkeypatch) -> None:
    entry = zst_cache.cached_decompress(streams["genuine"])
    calls = count_decompressions(monkeypatch)
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes, new mtime
    entry.write_bytes(bytes(data))
    assert zst_cache.cached_decompress(streams["genuine"]).read_bytes() == packed["tiny-sd"].read_bytes()
    assert len(calls) == 1


def test_an_entry_with_a_changed_stat_but_the_same_bytes_is_rehashed_not_decompressed(streams, monkeypatch) -> None:
    entry = zst_cache.cached_decompress(streams["genuine"])
    shutil.copy(entry, entry.with_suffix(".tmp"))
    os.replace(entry.with_suffix(".tmp"), entry)  # a restored backup: new inode, same bytes
    calls = count_decompressions(monkeypatch)
    hashed = []
    real = zst_cache._sha256_fd
    monkeypatch.setattr(zst_cache, "_sha256_fd", lambda fd, size: hashed.append(size) or real(fd, size))
    assert zst_cache.cached_decompress(streams["genuine"]) == entry and calls == [] and hashed == [entry.stat().st_size]
    hashed.clear()
    assert zst_cache.cached_decompress(streams["genuine"]) == entry and hashed == []  # re-recorded: a stat again


def test_an_entry_replaced_by_a_link_is_not_followed(streams, packed, tmp_path: Path) -> None:
    entry = zst_cache.cached_decompress(streams["genuine"])
    evil_plain = tmp_path / "evil.dduf"
    shutil.copy(packed["tiny-dit"], evil_plain)
    entry.unlink()
    entry.symlink_to(evil_plain)
    again = zst_cache.cached_decompress(streams["genuine"])
    assert not again.is_symlink() and again.read_bytes() == packed["tiny-sd"].read_bytes()
    assert evil_plain.read_bytes() == packed["tiny-dit"].read_bytes()  # the link's target is untouched


def test_a_secret_anyone_can_read_is_not_trusted(streams, private_dirs, monkeypatch) -> None:
    zst_cache.cached_decompress(streams["genuine"])
    secret = private_dirs["cache"] / "zst" / signed.SECRET_NAME
    assert secret.stat().st_mode & 0o777 == 0o600
    os.chmod(secret, 0o644)
    calls = count_decompressions(monkeypatch)
    zst_cache.cached_decompress(streams["genuine"])
    assert len(calls) == 1  # records signed with a secret others could read are void
    assert secret.stat().st_mode & 0o777 == 0o600  # and a new one replaced it
    if os.getuid() == 0:
        os.chown(secret, 65534, 65534)  # planted by another user
        zst_cache.cached_decompress(streams["genuine"])
        assert len(calls) == 2 and secret.stat().st_uid == 0


def test_the_memo_is_signed_and_stat_keyed(streams, private_dirs, monkeypatch) -> None:
    zst_cache.cached_decompress(streams["genuine"])
    (memo,) = (private_dirs["cache"] / "zst" / "seen").iterdir()
    record = json.loads(memo.read_text())
    assert record["key"] == sha256(streams["genuine"]) and {"size", "mtime_ns", "ino", "dev", "mac"} <= set(record)
    hashed = []
    real = zst_cache.content_key
    monkeypatch.setattr(zst_cache, "content_key", lambda p: hashed.append(p) or real(p))
    zst_cache.cached_decompress(streams["genuine"])
    assert hashed == []  # the memo answered
    record["key"] = sha256(streams["evil"])  # redirected without the secret: ignored
    memo.write_text(json.dumps(record))
    zst_cache.cached_decompress(streams["evil"])  # the redirect target exists in the cache
    assert zst_cache.cached_decompress(streams["genuine"]).name == sha256(streams["genuine"]) + ".dduf"
    assert len(hashed) == 2


def test_old_unsigned_cache_entries_are_rewritten_once(streams, packed, private_dirs, monkeypatch) -> None:
    key = sha256(streams["genuine"])
    folder = private_dirs["cache"] / "zst"
    (folder / "seen").mkdir(parents=True)
    shutil.copy(packed["tiny-dit"], folder / f"{key}.dduf")  # version 1 accepted this on its size alone
    calls = count_decompressions(monkeypatch)
    assert zst_cache.cached_decompress(streams["genuine"]).read_bytes() == packed["tiny-sd"].read_bytes()
    assert zst_cache.cached_decompress(streams["genuine"]).read_bytes() == packed["tiny-sd"].read_bytes()
    assert len(calls) == 1


def test_cache_writes_stay_inside_the_cache(streams, private_dirs, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (private_dirs["cache"]).mkdir()
    (private_dirs["cache"] / "zst").symlink_to(outside)  # a planted link for the cache's folder
    with pytest.raises(DDUFError, match="outside"):
        zst_cache.cached_decompress(streams["genuine"])
    assert leftovers(outside) == []


# --- the tokenizer-file cache ---------------------------------------------------------------------------
CONTENTS = {"tokenizer_config.json": b'{"model_max_length": 77}', "vocab.json": b'{"a": 0, "b": 1}',
            "merges.txt": b"#version: 0.2\na b\n"}


def materialize(contents=CONTENTS) -> Path:
    from dduf_plus.loading.files import materialize_files

    return Path(materialize_files(contents))


def assert_exact(folder: Path, contents=CONTENTS) -> None:
    assert sorted(os.listdir(folder)) == sorted(contents)
    for name, data in contents.items():
        assert not (folder / name).is_symlink() and (folder / name).read_bytes() == data


def test_file_cache_entry_is_verified_by_content(private_dirs, tmp_path: Path) -> None:
    folder = materialize()
    assert folder.parent == private_dirs["cache"] / "files"  # $DDUF_PLUS_CACHE/files, beside zst/ and refs/
    assert_exact(folder)
    (folder / "vocab.json").write_bytes(b'{"a": 9, "b": 1}')  # same size, different bytes
    assert materialize() == folder
    assert_exact(folder)
    (folder / "added_tokens.json").write_bytes(b'{"<evil>": 5}')  # an extra file the tokenizer would read
    assert_exact(materialize())
    outside = tmp_path / "outside.json"
    outside.write_bytes(CONTENTS["merges.txt"])
    (folder / "merges.txt").unlink()
    (folder / "merges.txt").symlink_to(outside)  # the right bytes, but through a link
    assert_exact(materialize())
    assert outside.read_bytes() == CONTENTS["merges.txt"]
    (folder / "vocab.json").unlink()
    os.mkfifo(folder / "vocab.json")  # must not block the check
    assert_exact(materialize())
    assert not [p for p in private_dirs["cache"].iterdir() if p.name.startswith((".tmp", ".stale"))]


def test_file_cache_entry_that_is_a_link_is_replaced_not_followed(private_dirs, tmp_path: Path) -> None:
    folder = materialize()
    shutil.rmtree(folder)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    folder.symlink_to(victim)
    again = materialize()
    assert again == folder and not again.is_symlink()
    assert_exact(again)
    assert sorted(os.listdir(victim)) == ["keep.txt"]


def test_file_cache_falls_back_to_a_private_temp_folder(tmp_path: Path, monkeypatch, private_dirs) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache should be")
    monkeypatch.setenv("DDUF_PLUS_CACHE", str(blocked))
    folder = materialize()
    assert folder.parent.parent == private_dirs["tmp"] and folder.parent.stat().st_mode & 0o077 == 0
    assert_exact(folder)
    if os.getuid() == 0:  # a fallback folder someone else owns is not used
        shutil.rmtree(folder.parent)
        folder.parent.mkdir()
        os.chown(folder.parent, 65534, 65534)
        from dduf_plus.errors import DDUFLoadError

        with pytest.raises(DDUFLoadError, match="cannot write tokenizer"):
            materialize()


# --- the verified-hash memory ---------------------------------------------------------------------------
def test_verified_hashes_save_replaces_a_planted_link(tmp_path: Path) -> None:
    from dduf_plus.refs.cache import VerifiedHashes

    refs = tmp_path / "refs"
    refs.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("do not overwrite")
    (refs / "verified.json").symlink_to(victim)
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 100)
    hv = VerifiedHashes(refs / "verified.json")
    digest = hv.sha256(data)
    assert victim.read_text() == "do not overwrite"
    assert not (refs / "verified.json").is_symlink()
    assert VerifiedHashes(refs / "verified.json").lookup(data) == digest
    os.utime(data, ns=(1, 1))  # a changed stat key forgets the hash
    assert VerifiedHashes(refs / "verified.json").lookup(data) is None


def test_a_planted_verified_hash_is_not_believed(tmp_path: Path) -> None:
    """The verified-hash memory has the zst cache's trust model (storage/signed.py): a verified.json written by
    anyone without the cache's secret (a shared or restored cache, a planted file vouching for a swapped blob)
    is ignored and the file is hashed again; what this process signed is believed while the stat key holds."""
    import hashlib

    from dduf_plus.refs.cache import VERIFIED_VERSION, VerifiedHashes
    from dduf_plus.storage.signed import stat_key

    refs = tmp_path / "refs"
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 100)
    key = stat_key(data)
    lie = "0" * 64
    refs.mkdir()
    record = [key.size, key.mtime_ns, key.inode, key.device, lie]
    deep = "[" * 100_000 + "]" * 100_000  # parsed past the interpreter's depth: RecursionError, not ValueError
    for planted in ({"version": 2, "entries": {str(data.resolve()): record}},  # the old unsigned format
                    {"v": VERIFIED_VERSION, "entries": {str(data.resolve()): record}, "mac": "0" * 64}, deep):
        (refs / "verified.json").write_text(planted if isinstance(planted, str) else json.dumps(planted))
        hv = VerifiedHashes(refs / "verified.json")
        assert hv.lookup(data) is None
        assert hv.sha256(data) == hashlib.sha256(b"x" * 100).hexdigest()
    assert VerifiedHashes(refs / "verified.json").lookup(data) == hashlib.sha256(b"x" * 100).hexdigest()
    assert (refs / signed.SECRET_NAME).stat().st_mode & 0o077 == 0


def test_a_digest_computed_while_the_file_changed_is_never_remembered(tmp_path: Path) -> None:
    """The memo's one trust rule (VerifiedHashes.remembered): a digest is kept only when the file's stat after
    computing it is the stat from before (or from when the caller mapped it, ``since``)."""
    from dduf_plus.refs.cache import VerifiedHashes, stat_key

    refs = tmp_path / "refs"
    refs.mkdir()
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 100)
    hv = VerifiedHashes(refs / "verified.json")

    def rewritten_meanwhile() -> str:
        data.write_bytes(b"y" * 200)  # a writer while the digest is computed
        return "d" * 64

    assert hv.remembered(data, rewritten_meanwhile, "entry") == "d" * 64
    assert hv.lookup(data, "entry") is None
    mapped_at = stat_key(data)
    data.write_bytes(b"z" * 300)  # changed after the caller mapped it, before the digest of the mapping
    assert hv.remembered(data, lambda: "e" * 64, "entry", since=mapped_at) == "e" * 64
    assert hv.lookup(data, "entry") is None
    assert hv.remembered(data, lambda: "f" * 64, "entry") == "f" * 64  # unchanged throughout: kept
    assert hv.remembered(data, lambda: "never computed", "entry") == "f" * 64
    assert VerifiedHashes(refs / "verified.json").lookup(data, "entry") == "f" * 64
