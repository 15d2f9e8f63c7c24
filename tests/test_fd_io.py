"""storage.fd_io: the one loop each for whole writes and kernel copies (``write`` and ``copy_file_range`` may
move fewer bytes than asked, or none where the file systems cannot)."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dduf_plus.storage.fd_io import copy_range, kernel_copy, write_all

DATA = bytes(range(256)) * 4096  # 1 MiB


@pytest.fixture
def fds(tmp_path: Path) -> Iterator[tuple[int, int]]:
    (tmp_path / "src").write_bytes(DATA)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT, 0o600)
    yield src, dst
    os.close(src), os.close(dst)


def _content(fd: int) -> bytes:
    return os.pread(fd, os.fstat(fd).st_size + 1, 0)


def test_kernel_copy_at_offsets_and_at_the_position(fds: tuple[int, int]) -> None:
    src, dst = fds
    assert kernel_copy(src, dst, 1000, 5000, 100) == 1000
    assert _content(dst)[100:] == DATA[5000:6000] and os.lseek(dst, 0, os.SEEK_CUR) == 0
    os.lseek(dst, 1100, os.SEEK_SET)
    assert kernel_copy(src, dst, 10, 0) == 10  # no offset: at dst's position, which moves on
    assert os.lseek(dst, 0, os.SEEK_CUR) == 1110 and _content(dst)[1100:] == DATA[:10]


def test_kernel_copy_says_where_it_stopped(fds: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = fds
    assert kernel_copy(src, dst, 100, len(DATA) - 40, 0) == 40  # the source ends first
    real, calls = os.copy_file_range, []

    def first_then_exdev(*args: int | None) -> int:
        calls.append(args)
        if len(calls) > 1:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        return real(args[0], args[1], 7, *args[3:])  # type: ignore[arg-type]

    monkeypatch.setattr(os, "copy_file_range", first_then_exdev)
    assert kernel_copy(src, dst, 100, 0, 0) == 7 and len(calls) == 2
    monkeypatch.delattr(os, "copy_file_range")
    assert kernel_copy(src, dst, 100, 0, 0) == 0


def test_copy_range_finishes_through_a_buffer(fds: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = fds
    monkeypatch.delattr(os, "copy_file_range")
    copy_range(src, dst, 1000, len(DATA))
    assert _content(dst)[1000:] == DATA[1000:]


def test_write_all_continues_short_writes(fds: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    _, dst = fds
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, bytes(data)[:1000]))
    write_all(dst, memoryview(DATA[:10_000]))
    assert _content(dst) == DATA[:10_000]
    monkeypatch.setattr(os, "write", lambda fd, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(OSError, match="full"):
        write_all(dst, b"x")


def test_write_all_that_makes_no_progress_is_an_error(fds: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A write returning 0 without an error (some FUSE file systems): an error, never a loop for ever."""
    from dduf_plus.errors import DDUFIOError

    _, dst = fds
    monkeypatch.setattr(os, "write", lambda fd, data: 0)
    with pytest.raises(DDUFIOError, match="wrote nothing"):
        write_all(dst, b"abc")
