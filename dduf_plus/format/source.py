"""Random-access byte sources: a local file (pread) or any fsspec URL (range requests).

Structural parsing only ever asks a source for the few byte ranges it needs, so validating a remote
archive transfers kilobytes, not gigabytes."""

from __future__ import annotations

import os
import stat
import threading
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
        self.fd = -1
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
            self.fd = os.open(self.name, os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0))
            info = os.fstat(self.fd)
        except OSError as e:
            self.close()
            raise DDUFError(f"cannot open {self.name}: {e.strerror}") from None
        if not stat.S_ISREG(info.st_mode):
            self.close()
            raise DDUFError(f"cannot open {self.name}: not a regular file")
        self.size = info.st_size
        self.bytes_read = 0

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DDUFError(f"{self.name}: read of {length} bytes at {offset} is outside the file")
        parts = []
        while length > 0:
            try:
                chunk = os.pread(self.fd, length, offset)
            except OSError as e:
                raise DDUFError(f"{self.name}: read failed at {offset}: {e.strerror}") from None
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
    one range request, so the bytes transferred are exactly the bytes asked for.

    ``cache_type="none"`` makes a buffered fsspec file fetch exactly ``[offset, offset + length)`` per read.
    The block size must not be 0: for HTTP and hf:// that selects a *streaming* file that cannot seek."""

    RANGE_BLOCK_SIZE = 1 << 20  # nominal: with cache_type "none" it never widens a request

    def __init__(self, url: str, **storage_options: object):
        import fsspec  # only remote validation pays for this import

        self.name = url
        self._lock = threading.Lock()  # seek + read is one operation on a shared file object
        if url.split("://", 1)[0] in ("http", "https") and "client_kwargs" not in storage_options:
            storage_options = {**storage_options, "client_kwargs": {"timeout": _http_timeout()}}
        try:
            fs, path = fsspec.core.url_to_fs(url, **storage_options)
            self._file = fs.open(path, "rb", block_size=self.RANGE_BLOCK_SIZE, cache_type="none")
            size = getattr(self._file, "size", None)
            if size is None:
                raise DDUFError("the server does not report the file size")
            self.size = int(size)
        except Exception as e:  # network/protocol errors of every backend
            raise DDUFError(f"cannot open {url}: {e}") from None
        if not (hasattr(self._file, "seek") and self._file.seekable()):
            raise DDUFError(f"cannot open {url}: the file system offers no random access (range requests)")
        self.bytes_read = 0

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DDUFError(f"{self.name}: read of {length} bytes at {offset} is outside the file")
        if length == 0:
            return b""
        try:
            with self._lock:
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


class BytesSource:
    """Bytes already in memory as a ``ByteSource`` (e.g. an upload being checked before it is stored):
    ``validate(BytesSource(data))``, ``DDUFArchive(BytesSource(data))``."""

    def __init__(self, data: bytes | bytearray | memoryview, name: str = "<bytes>"):
        self.data, self.name, self.size, self.bytes_read = bytes(data), name, len(data), 0

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DDUFError(f"{self.name}: read of {length} bytes at {offset} is outside the data")
        self.bytes_read += length
        return self.data[offset : offset + length]

    def close(self) -> None:
        pass


def _http_timeout() -> object:
    """A server that stops answering must not hang a validation: huggingface_hub's download timeout
    (``HF_HUB_DOWNLOAD_TIMEOUT``, 10 s by default) for connecting and for each read."""
    import aiohttp  # fsspec's HTTP backend

    try:
        seconds = float(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT", "10"))
    except ValueError:
        seconds = 10.0
    return aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds)


def is_url(source: str | os.PathLike) -> bool:
    return isinstance(source, str) and "://" in source and not source.startswith("file://")


def open_source(source: str | os.PathLike, **storage_options: object) -> ByteSource:
    if is_url(source):
        return FsspecSource(str(source), **storage_options)
    if isinstance(source, str) and source.startswith("file://"):
        source = source[len("file://") :]
    return LocalSource(source)
