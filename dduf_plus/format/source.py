"""Random-access byte sources: a local file (pread) or any fsspec URL (range requests).

Structural parsing only ever asks a source for the few byte ranges it needs, so validating a remote
archive transfers kilobytes, not gigabytes."""

from __future__ import annotations

import os
from typing import Protocol

from ..errors import DDUFError


class ByteSource(Protocol):
    name: str
    size: int
    bytes_read: int

    def read_at(self, offset: int, length: int) -> bytes: ...

    def close(self) -> None: ...


class LocalSource:
    """A local file read with ``os.pread`` (thread-safe, no seek state)."""

    def __init__(self, path: str | os.PathLike):
        self.name = os.fspath(path)
        try:
            self.fd = os.open(self.name, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as e:
            raise DDUFError(f"cannot open {self.name}: {e.strerror}") from None
        self.size = os.fstat(self.fd).st_size
        self.bytes_read = 0

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DDUFError(f"{self.name}: read of {length} bytes at {offset} is outside the file")
        parts = []
        while length > 0:
            chunk = os.pread(self.fd, length, offset)
            if not chunk:
                raise DDUFError(f"{self.name}: file shrank while reading")
            parts.append(chunk)
            offset += len(chunk)
            length -= len(chunk)
            self.bytes_read += len(chunk)
        return b"".join(parts) if len(parts) != 1 else parts[0]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> LocalSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FsspecSource:
    """Any fsspec URL (``https://``, ``hf://``, ``s3://``...). No read-ahead cache: each ``read_at`` is
    one range request, so the bytes transferred are exactly the bytes asked for."""

    def __init__(self, url: str, **storage_options: object):
        import fsspec  # only remote validation pays for this import

        self.name = url
        try:
            fs, path = fsspec.core.url_to_fs(url, **storage_options)
            self._file = fs.open(path, "rb", block_size=0, cache_type="none")
            self.size = int(self._file.size)
        except Exception as e:  # network/protocol errors of every backend
            raise DDUFError(f"cannot open {url}: {e}") from None
        self.bytes_read = 0

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DDUFError(f"{self.name}: read of {length} bytes at {offset} is outside the file")
        try:
            self._file.seek(offset)
            data = self._file.read(length)
        except Exception as e:
            raise DDUFError(f"{self.name}: read failed at {offset}: {e}") from None
        if len(data) != length:
            raise DDUFError(f"{self.name}: short read at {offset}")
        self.bytes_read += len(data)
        return data

    def close(self) -> None:
        try:
            self._file.close()
        except Exception:
            pass


def is_url(source: str | os.PathLike) -> bool:
    return isinstance(source, str) and "://" in source and not source.startswith("file://")


def open_source(source: str | os.PathLike, **storage_options: object) -> ByteSource:
    if is_url(source):
        return FsspecSource(str(source), **storage_options)
    if isinstance(source, str) and source.startswith("file://"):
        source = source[len("file://") :]
    return LocalSource(source)
