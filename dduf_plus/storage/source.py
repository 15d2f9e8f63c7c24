"""Random-access byte sources: a local file (pread), an ``http(s)://`` URL (range requests, our own client)
or another allowed fsspec URL (``hf://``, ``s3://``, ``gs://``...).

Structural parsing only ever asks a source for the few byte ranges it needs, so validating a remote
archive transfers kilobytes, not gigabytes.

A remote source is untrusted like the archive it serves, so every remote source has budgets:

- an overall **deadline** from opening to the last read (``deadline=`` seconds, else ``DDUF_REMOTE_DEADLINE``,
  default :data:`DEFAULT_DEADLINE_S`); a server that trickles a byte every few seconds is cut off there;
- a **byte budget**: at most ``max_bytes`` received in all (else ``DDUF_REMOTE_MAX_BYTES``, default twice the
  file's size plus :data:`BUDGET_SLACK_BYTES`: every byte once for ``--verify``, again for headers). For
  http(s) every byte received counts (status lines, headers, chunk framing), an answer brings at most its
  range plus 64 KiB, and bytes past the range are refused, never read (``http_range``);
- each connect and each socket read waits at most ``HF_HUB_DOWNLOAD_TIMEOUT`` seconds (default 10);
- http(s) redirects are followed only within the same origin (scheme, host, port), at most
  :data:`MAX_REDIRECTS`; a server that ignores ``Range`` is refused before its body is read;
- an http(s) source opens with one suffix range request (``bytes=-N``, ``http_range.SUFFIX_BYTES``): the size
  and the file's end (end records, directory, index) in one round trip; its ``Content-Range`` must name exactly
  the last bytes of the size it reports, else it is refused (a server without suffix ranges: ``bytes=0-0``);
- only the URL schemes in :data:`ALLOWED_URL_SCHEMES`; no fsspec chains (``simplecache::...``), no
  ``local://`` or ``memory://``. ``file://PATH`` is the local path PATH. Refusals happen before any I/O.
"""


from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ..errors import DDUFError, DDUFIOError, DDUFNotFoundError, DDUFUsageError, io_error
from .fd_io import open_regular, pread_upto
from .http_range import HTTPSource, short_text
from .remote_budget import DEFAULT_DEADLINE_S, RemoteBudget
from .urls import ALLOWED_URL_SCHEMES, check_url, is_url

__all__ = ["ALLOWED_URL_SCHEMES", "DEFAULT_DEADLINE_S", "ByteSource", "BytesSource", "FsspecSource", "HTTPSource",
           "LocalSource", "check_length", "check_url", "is_url", "open_source"]

T = TypeVar("T")



class ByteSource(Protocol):
    name: str
    size: int

    @property
    def bytes_read(self) -> int: ...  # bytes delivered so far (an attribute or a property)

    def read_at(self, offset: int, length: int) -> bytes: ...

    def close(self) -> None: ...


class LocalSource:
    """A local file read with ``os.pread`` (thread-safe, no seek state)."""

    def __init__(self, path: str | os.PathLike):
        self.name = os.fspath(path)
        self.fd = -1
        try:
            opened = open_regular(self.name)  # a FIFO: refused just below, never waited on
        except OSError as e:
            raise io_error(f"cannot open {self.name}: {e.strerror}", e, self.name) from None
        if opened is None:
            kind = (f" but a folder (a DDUF archive is one file; a diffusers pipeline folder is described by "
                    f"`dduf info {self.name}` and packed by `dduf pack {self.name} -o NAME.dduf`)"
                    if os.path.isdir(self.name) else "")
            raise DDUFIOError(f"cannot open {self.name}: not a regular file{kind}")
        self.fd, info = opened
        self.size = info.st_size
        self.bytes_read = 0

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DDUFError(f"{self.name}: read of {length} bytes at {offset} is outside the file")
        try:
            data = pread_upto(self.fd, length, offset)
        except OSError as e:
            raise DDUFIOError(f"{self.name}: read failed at {offset}: {e.strerror}") from None
        self.bytes_read += len(data)
        if len(data) != length:
            raise DDUFIOError(f"{self.name}: file shrank while reading")
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> LocalSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- other allowed schemes: fsspec, each call bounded by the deadline ---------------------------------------


class FsspecSource:
    """An allowed fsspec URL other than http(s) (``hf://``, ``s3://``...). No read-ahead cache: each
    ``read_at`` is one range request, so the bytes transferred are exactly the bytes asked for.

    ``cache_type="none"`` makes a buffered fsspec file fetch exactly ``[offset, offset + length)`` per read.
    The block size must not be 0: for hf:// that selects a *streaming* file that cannot seek. Each call
    runs in a helper thread and is waited for until the source's deadline only; a call still blocked then
    is abandoned to the backend's own socket timeouts and the source refuses every later read."""

    RANGE_BLOCK_SIZE = 1 << 20  # nominal: with cache_type "none" it never widens a request

    def __init__(self, url: str, *, deadline: float | None = None, max_bytes: int | None = None,
                 **storage_options: object):
        import fsspec  # only remote validation pays for this import

        self.name = url
        self._lock = threading.Lock()  # seek + read is one operation on a shared file object
        self._budget = RemoteBudget(url, deadline, max_bytes)
        self._broken = False
        self._file: Any = None

        def opening() -> Any:
            fs, path = fsspec.core.url_to_fs(url, **storage_options)
            return fs.open(path, "rb", block_size=self.RANGE_BLOCK_SIZE, cache_type="none")

        try:
            self._file = self._bounded(opening)
            size = getattr(self._file, "size", None)
            if size is None:
                raise DDUFIOError(f"cannot open {url}: the server does not report the file size")
            self.size = int(size)
        except DDUFError:
            self.close()
            raise
        except FileNotFoundError as e:
            self.close()
            raise DDUFNotFoundError(f"cannot open {url}: not found ({short_text(e) or 'no such file'})", url) from None
        except PermissionError as e:
            self.close()
            raise DDUFIOError(f"cannot open {url}: access denied ({short_text(e)})") from None
        except Exception as e:  # network/protocol errors of every backend
            self.close()
            raise DDUFIOError(f"cannot open {url}: {type(e).__name__}: {short_text(e, 300)}") from None
        if not (hasattr(self._file, "seek") and self._file.seekable()):
            self.close()
            raise DDUFIOError(f"cannot open {url}: the file system offers no random access (range requests)")
        self._budget.sized(self.size)
        self.bytes_read = 0

    def _bounded(self, call: Callable[[], T]) -> T:
        """``call()`` in a daemon thread, waited for until the deadline."""
        if self._broken:
            raise DDUFIOError(f"{self.name}: an earlier request overran the deadline; the source is closed")
        remaining = self._budget.remaining()
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = call()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name="dduf-remote", daemon=True).start()
        if not done.wait(remaining):
            self._broken = True
            raise self._budget.expired()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DDUFError(f"{self.name}: read of {length} bytes at {offset} is outside the file")
        if length == 0:
            return b""

        def reading() -> bytes:
            self._file.seek(offset)
            return self._file.read(length)

        with self._lock:
            self._budget.spend(length)
            try:
                data = self._bounded(reading)
            except DDUFError:
                raise
            except Exception as e:
                raise DDUFIOError(f"{self.name}: read failed at {offset}: {type(e).__name__}: {short_text(e, 300)}") from None
            self._budget.settle(length, len(data))  # what the backend handed over counts, not what was asked
        check_length(self.name, offset, length, data)
        self.bytes_read += len(data)
        return data

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None and not self._broken:
            try:
                file.close()
            except Exception:
                pass


def check_length(name: str, offset: int, length: int, data: bytes) -> None:
    """A backend's answer to a range read must be exactly the range. fsspec backends (hf://, s3://...) read
    each answer whole before returning it, so bytes past the range cannot be refused before they arrive, only
    here; http(s) never goes through them (:class:`HTTPSource` stops at the range)."""
    if len(data) < length:
        raise DDUFIOError(f"{name}: read of {length} bytes at {offset} returned {len(data)} bytes (a short read, "
                          "or the file changed)")
    if len(data) > length:
        raise DDUFIOError(f"{name}: read of {length} bytes at {offset} returned {len(data)} bytes: the server "
                          "sent more than the range it was asked for; refused")


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



def open_source(source: str | os.PathLike, *, deadline: float | None = None, max_bytes: int | None = None,
                **storage_options: Any) -> ByteSource:
    """A ByteSource for a local path, ``file://PATH``, or an allowed URL.

    ``deadline`` (seconds) and ``max_bytes`` bound a remote source (see the module docstring); local files
    ignore them. ``storage_options`` go to fsspec; an http(s) URL takes only ``headers`` and ``timeout``.

    Raises:
        DDUFUsageError: a URL scheme that is not allowed, or an fsspec chain.
        DDUFNotFoundError: the file does not exist (HTTP 404/410 for a URL).
        DDUFIOError: it cannot be opened (unreachable, refused, no range support, over a budget...).
    """
    if is_url(source):
        url = str(source)
        scheme = check_url(url)
        if scheme in ("http", "https"):
            unknown = sorted(set(storage_options) - {"headers", "timeout"})
            if unknown:
                raise DDUFUsageError(f"{url}: options {', '.join(unknown)} do not apply to http(s) URLs "
                                     "(only headers=, timeout=, deadline=, max_bytes=)")
            return HTTPSource(url, deadline=deadline, max_bytes=max_bytes, **storage_options)
        return FsspecSource(url, deadline=deadline, max_bytes=max_bytes, **storage_options)
    if isinstance(source, str) and source.startswith("file://"):
        source = source[len("file://") :]
    return LocalSource(source)
