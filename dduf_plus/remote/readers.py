"""Concurrent range readers for one remote archive: ``http(s)://`` through dduf_plus's own range client
(one kept-alive connection per thread, one shared deadline and byte budget) and every other allowed fsspec
URL through ``fs.cat_file(path, start, end)``. Torch-free; no fsspec import for http(s)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import DDUFError, DDUFIOError, DDUFNotFoundError, DDUFUsageError
from ..storage.http_range import HTTP_BODY_CHUNK, WHOLE_FILE_BELOW, HTTPFailure, HTTPSource, short_text
from ..storage.remote_budget import DEFAULT_DEADLINE_S, RemoteBudget
from ..storage.source import ByteSource, check_length
from ..storage.urls import check_url

DEFAULT_CONCURRENCY = 16
DEFAULT_CHUNK_SIZE = 16 << 20
DEADLINE_RATE = 1e6  # the default deadline grows by one second per MB: a slow link is not a hostile one
RECEIVE_BLOCK = 1 << 20  # a streamed answer is handed on in blocks this size: they stay in the CPU's cache

Emit = Callable[[int, memoryview], None]  # (file offset, bytes) of each received block, in order


@dataclass
class RemoteOptions:
    """How ``load_dduf(URL)`` fetches an archive.

    Attributes:
        concurrency: range requests in flight at once (one connection each).
        chunk_size: bytes per range request (the last piece of a run may be shorter).
        timeout: seconds each connect and socket read may wait (default ``HF_HUB_DOWNLOAD_TIMEOUT`` or 10):
            a stalled server is cut off after this long.
        deadline: seconds for the whole fetch (default ``DDUF_REMOTE_DEADLINE``, else 300 s plus one
            second per MB of archive): a server that trickles bytes is cut off there.
        max_bytes: the most bytes received in all, headers included (default twice the archive's size plus
            16 MiB); an answer never brings more than its range plus 64 KiB.
        headers: extra HTTP headers for http(s) URLs (``{"Authorization": "Bearer ..."}``).
        storage_options: fsspec options for ``s3://``, ``gs://``, ``hf://``... (``{"anon": True}``,
            ``{"client_kwargs": {"endpoint_url": ...}}``).
        cache_dir: where fetched archives are kept (default ``cache_dir("remote")``).
        cache: False keeps nothing on disk: the archive is received into anonymous memory (a ``memfd``),
            verified there, and the pipeline's weights view that memory (as much memory as the archive's size,
            freed with the pipeline); no cache file, progress record or URL record is read or written.
        memory_max: the largest archive served from memory while it is written to a cache on a disk (not
            tmpfs) behind the load; ``0``: never. Default: half of the memory available when the fetch starts,
            for archives the page cache cannot take without making writers wait for the disk (smaller ones
            go straight to the cache file: one copy fewer). Others are received straight into the cache file.
    """

    concurrency: int = DEFAULT_CONCURRENCY
    chunk_size: int = DEFAULT_CHUNK_SIZE
    timeout: float | None = None
    deadline: float | None = None
    max_bytes: int | None = None
    headers: dict[str, str] | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str | os.PathLike | None = None
    cache: bool = True
    memory_max: int | None = None

    @classmethod
    def of(cls, value: RemoteOptions | dict[str, Any] | None) -> RemoteOptions:
        if value is None:
            return cls()
        if isinstance(value, RemoteOptions):
            options = value
        elif isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise DDUFUsageError(f"remote=: unknown options {', '.join(unknown)} "
                                     f"(known: {', '.join(cls.__dataclass_fields__)})")
            options = cls(**value)
        else:
            raise DDUFUsageError(f"remote= takes a RemoteOptions or a dict, not {type(value).__name__}")
        if not isinstance(options.concurrency, int) or not 1 <= options.concurrency <= 256:
            raise DDUFUsageError(f"remote concurrency={options.concurrency!r}: give a whole number from 1 to 256")
        if not isinstance(options.chunk_size, int) or not 64 << 10 <= options.chunk_size <= 1 << 30:
            raise DDUFUsageError(f"remote chunk_size={options.chunk_size!r}: give a byte count from 64 KiB to 1 GiB")
        if not isinstance(options.cache, bool):
            raise DDUFUsageError(f"remote cache={options.cache!r}: give True or False")
        if options.memory_max is not None and (not isinstance(options.memory_max, int) or options.memory_max < 0):
            raise DDUFUsageError(f"remote memory_max={options.memory_max!r}: give a byte count (0: never from memory)")
        return options

    def folder(self) -> Path:
        from ..storage.cache_dirs import cache_dir

        return Path(self.cache_dir) if self.cache_dir is not None else cache_dir("remote")


class RangeReader(ByteSource, Protocol):
    """The one random-access reader protocol, :class:`~dduf_plus.storage.source.ByteSource` (``name``, ``size``,
    ``read_at``, ``bytes_read``, ``close``), with what a concurrent whole-archive fetch adds: ``read_into`` (a
    range straight into the caller's buffer) and ``remaining`` (seconds left of the shared deadline)."""

    def read_into(self, offset: int, out: memoryview) -> None: ...

    def remaining(self) -> float: ...

    def close(self) -> None: ...


def _extend_deadline(budget: RemoteBudget, size: int, explicit: float | None) -> None:
    """Without an explicit deadline, allow a large archive time in proportion to its size."""
    if explicit is None and not os.environ.get("DDUF_REMOTE_DEADLINE", "").strip():
        budget.deadline_s = DEFAULT_DEADLINE_S + size / DEADLINE_RATE
        budget.ends_at = time.monotonic() + budget.deadline_s


class _IntoSource(HTTPSource):
    """An :class:`HTTPSource` whose range reads can land in the caller's buffer: the body is received with
    ``readinto`` straight into it (no bytes object per socket read, no join), either whole (:meth:`read_into`)
    or block by block into one small reused buffer, each block handed on while it is still in the CPU's cache
    (:meth:`read_each`). Every check of the range client applies unchanged: only where the body's bytes go
    differs."""

    _into: memoryview | None = None
    _emit: Emit | None = None
    _at = 0
    _filled = False

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the ``len(out)`` bytes at ``offset`` (one range request)."""
        if self.size <= WHOLE_FILE_BELOW:  # a small file is read whole by the range client: its bytes, copied
            out[:] = self.read_at(offset, len(out))
            return
        self._into, self._filled = out, False
        try:
            body = self.read_at(offset, len(out))
            if not self._filled:  # answered from bytes the client already holds (the end of the file)
                out[:] = body
        finally:
            self._into = None

    def read_each(self, offset: int, length: int, buffer: memoryview, emit: Emit) -> None:
        """The ``length`` bytes at ``offset`` (one range request), received into ``buffer`` and handed to
        ``emit(file offset, block)`` one full buffer at a time (the last block may be shorter)."""
        if self.size <= WHOLE_FILE_BELOW:
            emit(offset, memoryview(self.read_at(offset, length)))
            return
        self._into, self._emit, self._at, self._filled = buffer, emit, offset, False
        try:
            body = self.read_at(offset, length)
            if not self._filled:  # answered from bytes the client already holds (the end of the file)
                emit(offset, memoryview(body))
            else:
                self.bytes_read += length  # the streamed body was handed on, not returned
        finally:
            self._into, self._emit = None, None

    def _read_body(self, response: Any, length: int) -> Any:
        out = self._into
        if out is None or (self._emit is None and len(out) != length):
            return super()._read_body(response, length)
        got, held = 0, 0  # body bytes received; of those, held in ``out`` (streamed: not yet handed on)
        window = length if self._emit is None else len(out)
        while got < length:
            self._budget.remaining()  # the deadline, between socket reads (a trickle is cut off)
            n = response.readinto(out[held:min(window, held + HTTP_BODY_CHUNK, held + length - got)])
            if not n:
                self.close()
                if self._expired:
                    raise self._budget.expired()
                raise HTTPFailure(f"the connection closed after {got} of {length} bytes")
            got, held = got + n, held + n
            if self._emit is not None and (held == window or got == length):
                self._hand_on(got - held, out[:held])
                held = 0
        self._filled = True
        return out if self._emit is None else out[:0]

    def _hand_on(self, at: int, block: memoryview) -> None:
        """One received block to the caller; when the caller fails (a full disk, a stop), the answer is left
        unread, so its connection is closed (no next request reads the rest as a status line)."""
        assert self._emit is not None
        try:
            self._emit(self._at + at, block)
        except BaseException:
            self.close()
            raise


class HTTPRanges:
    """Range reads of one http(s) URL, each calling thread on its own kept-alive connection.

    Opening sends one request unless ``size`` is already known: a suffix range (``bytes=-N``) that gives the size
    and the end of the file, which the tail is then read from (``storage/http_range.HTTPSource``)."""

    def __init__(self, url: str, options: RemoteOptions, size: int | None = None):
        self.name = url
        self._options = options
        self._local = threading.local()
        self._all: list[_IntoSource] = []
        self._lock = threading.Lock()
        first = _IntoSource(url, deadline=options.deadline, max_bytes=options.max_bytes, headers=options.headers,
                           timeout=options.timeout, size=size)
        self._budget = first._budget
        if size is not None:
            self._budget.sized(size)
        self.size = first.size
        _extend_deadline(self._budget, self.size, options.deadline)
        self._adopt(first)

    def _adopt(self, source: _IntoSource) -> None:
        self._local.source = source
        with self._lock:
            self._all.append(source)

    def _source(self) -> _IntoSource:
        source = getattr(self._local, "source", None)
        if source is None:
            source = _IntoSource(self.name, headers=self._options.headers, timeout=self._options.timeout,
                                size=self.size, budget=self._budget)
            self._adopt(source)
        return source

    @property
    def bytes_read(self) -> int:
        with self._lock:
            return sum(source.bytes_read for source in self._all)

    def read_at(self, offset: int, length: int) -> bytes:
        return self._source().read_at(offset, length)

    def read_into(self, offset: int, out: memoryview) -> None:
        self._source().read_into(offset, out)

    def read_each(self, offset: int, length: int, buffer: memoryview, emit: Emit) -> None:
        self._source().read_each(offset, length, buffer, emit)

    def remaining(self) -> float:
        return self._budget.remaining()

    def close(self) -> None:
        with self._lock:
            sources, self._all = self._all, []
        for source in sources:
            source.close()


class FsspecRanges:
    """Range reads of an fsspec URL (``s3://``, ``gs://``, ``hf://``...) with ``fs.cat_file(path, start, end)``:
    thread-safe, so every worker reads at once. The size comes from ``fs.info``."""

    def __init__(self, url: str, options: RemoteOptions, size: int | None = None):
        import fsspec

        self.name = url
        self.bytes_read = 0
        self._budget = RemoteBudget(url, options.deadline, options.max_bytes)
        try:
            self._fs, self._path = fsspec.core.url_to_fs(url, **(options.storage_options or {}))
            info = self._fs.info(self._path)
        except FileNotFoundError:
            raise DDUFNotFoundError(f"cannot open {url}: not found", url) from None
        except DDUFError:
            raise
        except Exception as e:  # every backend's own network and protocol errors
            raise DDUFIOError(f"cannot open {url}: {type(e).__name__}: {short_text(e, 300)}") from None
        reported = info.get("size") if isinstance(info, dict) else None
        if not isinstance(reported, int) or reported < 0:
            raise DDUFIOError(f"cannot open {url}: the file system does not report its size")
        if size is not None and reported != size:
            raise DDUFIOError(f"{url}: the size is now {reported} bytes, it was {size} (the file changed)")
        self.size = reported
        self._budget.sized(self.size)
        _extend_deadline(self._budget, self.size, options.deadline)

    def read_at(self, offset: int, length: int) -> bytes:
        self._budget.remaining()
        self._budget.spend(length)
        try:
            data = self._fs.cat_file(self._path, start=offset, end=offset + length)
        except Exception as e:
            raise DDUFIOError(f"{self.name}: read of {length} bytes at {offset} failed: "
                              f"{type(e).__name__}: {short_text(e, 300)}") from None
        self._budget.settle(length, len(data))  # what the backend handed over counts, not what was asked
        check_length(self.name, offset, length, data)
        self.bytes_read += len(data)
        return data

    def read_into(self, offset: int, out: memoryview) -> None:
        out[:] = self.read_at(offset, len(out))

    def remaining(self) -> float:
        return self._budget.remaining()

    def close(self) -> None:
        pass


def open_reader(url: str, options: RemoteOptions, size: int | None = None) -> RangeReader:
    """A concurrent range reader for an allowed URL (refused schemes fail before any I/O)."""
    scheme = check_url(url)
    if scheme in ("http", "https"):
        if options.storage_options:
            raise DDUFUsageError(f"{url}: storage_options do not apply to http(s) URLs (use headers=)")
        return HTTPRanges(url, options, size)
    return FsspecRanges(url, options, size)


def read_each(reader: RangeReader, offset: int, length: int, buffer: memoryview, emit: Emit) -> None:
    """The ``length`` bytes at ``offset`` handed to ``emit(file offset, block)`` in order: an http(s) answer
    streamed through ``buffer`` (received in place, block by block); other readers' answers in one block."""
    if isinstance(reader, HTTPRanges):
        reader.read_each(offset, length, buffer, emit)
    else:
        emit(offset, memoryview(reader.read_at(offset, length)))
