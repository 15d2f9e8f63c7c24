"""Our own http(s) range client (:class:`HTTPSource`, :func:`get_document`): deadlines, byte accounting,
redirects and range support are ours to decide, not a library's. Every byte an answer brings is counted
against the source's :class:`~.remote_budget.RemoteBudget`; connections (TLS, proxies) come from
:mod:`.http_conn`."""

from __future__ import annotations

import functools
import http.client
import io
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urljoin, urlsplit

from ..errors import DDUFError, DDUFIOError, DDUFNotFoundError, DDUFUsageError
from .http_conn import (  # noqa: F401 (open_connection, proxied: re-exported, the server's checks name them here)
    open_connection,
    origin,
    proxied,
    shut_down,
)
from .hub_env import proxy_for
from .remote_budget import RemoteBudget, read_timeout

logger = logging.getLogger(__name__)

MAX_REDIRECTS = 5
HTTP_BODY_CHUNK = 1 << 20
# What one answer may bring besides the bytes asked for: the status line and headers (of a redirect, a 1xx or
# the 206), and chunked framing. Every byte received from the socket counts; past this the answer is refused.
HEADER_ALLOWANCE = 64 << 10
FRAMING_ALLOWANCE = 64  # chunked framing: one byte per 64 of the range (real chunks are KBs: < 0.2 %)


# --- http(s): our own range client, so deadlines, redirects and range support are ours to decide -------------


class HTTPFailure(Exception):
    """One request failed; ``why`` says how (the caller adds which URL and which read)."""

    def __init__(self, why: str, not_found: bool = False):
        super().__init__(why)
        self.why, self.not_found = why, not_found


class _NoSuffix(HTTPFailure):
    """The server does not answer suffix ranges (``bytes=-N``: HTTP 200 or 416): open with ``bytes=0-0``."""


class _Overrun(Exception):
    """An answer brought more bytes than it may (raised from under http.client, caught by the exchange)."""


class _Tally:
    """Bytes received from the socket by one answer, and the most it may bring (``cap``)."""

    def __init__(self, cap: int):
        self.cap, self.received = cap, 0


class _Meter(io.RawIOBase):
    """The raw socket stream under one response: every byte http.client reads (status line, headers, 1xx
    answers, chunk framing, trailers, body) passes here and is counted; no read asks the socket for more
    than the answer's cap, and a read past the cap raises :class:`_Overrun`. ``no_wait`` answers "nothing
    available" instead of reading (to see what is already buffered without blocking)."""

    def __init__(self, raw: Any, tally: _Tally):
        super().__init__()
        self.raw, self.tally, self.no_wait = raw, tally, False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        if self.no_wait:
            return None
        left = self.tally.cap - self.tally.received
        if left <= 0:
            raise _Overrun(f"the answer went past {self.tally.cap} bytes")
        got = self.raw.readinto(memoryview(buffer)[:left])
        if got:
            self.tally.received += got
        return got

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()


class _MeteredResponse(http.client.HTTPResponse):
    """http.client's response reading through a :class:`_Meter`. ``leftover``: bytes already received past
    the end of the answer when it closed (a server that sent more than it framed)."""

    def __init__(self, sock: Any, *args: Any, tally: _Tally, **kwargs: Any):
        super().__init__(sock, *args, **kwargs)
        self.meter = _Meter(self.fp.detach(), tally)
        self.fp = io.BufferedReader(self.meter)
        self.leftover = 0

    def _close_conn(self) -> None:
        fp, self.fp = self.fp, None  # type: ignore[assignment]  # may run in two threads at once (a close while a worker reads)
        if fp is None:
            return
        self.meter.no_wait = True
        try:
            self.leftover = len(fp.peek())
        except (OSError, ValueError):
            pass
        fp.close()


# Files up to this size are read whole by the first read (one request instead of one per header: validating
# a 16 KB archive took ~30 round trips); larger ones by exact ranges.
WHOLE_FILE_BELOW = 512 << 10
# What opening asks for: the file's last bytes (``Range: bytes=-N``), which give its size and hold the end
# records, the central directory and the dduf_plus index of typical archives (SD-1.5-shaped: 139 KB), or
# the whole of a file up to this size: opening and the tail are one round trip, not two.
SUFFIX_BYTES = 512 << 10


class HTTPSource:
    """An ``http://`` or ``https://`` URL read by range requests over one kept-alive connection.

    Opening sends one suffix range request, ``Range: bytes=-N`` (``suffix``, default :data:`SUFFIX_BYTES`):
    the ``206`` answer gives the size, proves range support and brings the file's last N bytes (the whole
    file when it is shorter), kept in memory: reads inside them send nothing. Its ``Content-Range`` must be
    exactly the last ``min(N, size)`` bytes of the size it reports, else the server is refused. A server
    that answers the suffix with ``200`` (its body is not read) or ``416`` is asked ``bytes=0-0`` instead,
    as is every source under a fixed byte budget too small for the suffix (``suffix=0``: always); a
    ``200`` to that (the server ignores ``Range``) is refused without reading its body. Each later
    ``read_at`` is exactly one range request, except in a file of at most :data:`WHOLE_FILE_BELOW` bytes, which
    the first read fetches whole. Redirects are followed within the same origin only.

    ``size`` (already known, e.g. from another connection) skips the opening request; ``budget`` shares
    one deadline and byte budget between several connections to the same URL (``remote.fetch``). Every
    answer's total size must equal ``size``: a file that changed, or a server that lies, is refused."""

    def __init__(self, url: str, *, deadline: float | None = None, max_bytes: int | None = None,
                 headers: dict[str, str] | None = None, timeout: float | None = None,
                 size: int | None = None, budget: RemoteBudget | None = None, suffix: int | None = None):
        self.name = url
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise DDUFUsageError(f"{url}: not an http(s) URL with a host")
        if parts.username or parts.password:
            raise DDUFUsageError(f"{url}: credentials in the URL are not supported; pass headers= instead")
        self._origin = origin(parts)
        self._url = url
        self._headers = {"User-Agent": "dduf_plus", "Accept-Encoding": "identity", **(headers or {})}
        self._timeout = float(timeout) if timeout else read_timeout()
        self._budget = budget if budget is not None else RemoteBudget(url, deadline, max_bytes)
        self._lock = threading.Lock()  # one connection: one request at a time
        self._conn: http.client.HTTPConnection | None = None
        self._expired = False
        self._whole: bytes | None = None  # the whole file, once read (files up to WHOLE_FILE_BELOW only)
        self._kept: tuple[int, bytes] | None = None  # (offset, bytes): the file's end, brought by the opening
        self.bytes_read = 0  # body bytes delivered
        self.bytes_received = 0  # every byte received from the server (headers, framing, refused answers)
        self.size = 0
        if size is not None:
            self.size = int(size)
            return
        try:
            self.size = self._open(SUFFIX_BYTES if suffix is None else max(0, int(suffix)))
        except HTTPFailure as e:
            self.close()
            message = f"cannot open {url}: {e.why}"
            raise (DDUFNotFoundError(message, url) if e.not_found else DDUFIOError(message)) from None
        except DDUFError:
            self.close()
            raise
        self._budget.sized(self.size)

    # -- public ----------------------------------------------------------------------------------------------
    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DDUFError(f"{self.name}: read of {length} bytes at {offset} is outside the file")
        if length == 0:
            return b""
        kept = self._kept
        if kept is not None and kept[0] <= offset:  # the end of the file, brought by the opening request
            return kept[1][offset - kept[0] : offset - kept[0] + length]
        if self._whole is not None or (self.size <= WHOLE_FILE_BELOW and self._budget.affords(self.size)):
            return self._whole_file()[offset : offset + length]  # a small file: one request, then memory
        with self._lock:
            self._budget.spend(length)
            try:
                _, _, body = self._request(offset, offset + length - 1, expect=length)
            except HTTPFailure as e:
                raise DDUFIOError(f"{self.name}: read of {length} bytes at {offset} failed: {e.why}") from None
        self.bytes_read += len(body)
        return body

    def kept_tail(self) -> tuple[int, bytes] | None:
        """``(offset, bytes)``: the end of the file that the opening request brought (kept), or None."""
        return self._kept

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _whole_file(self) -> bytes:
        with self._lock:
            if self._whole is None:
                self._budget.spend(self.size)
                try:
                    _, _, body = self._request(0, self.size - 1, expect=self.size)
                except HTTPFailure as e:
                    raise DDUFIOError(f"{self.name}: read of the whole {self.size}-byte file failed: {e.why}") from None
                self._whole = body
                self.bytes_read += len(body)
            return self._whole

    # -- requests --------------------------------------------------------------------------------------------
    def _open(self, suffix: int) -> int:
        """The file's size: from a suffix range (its bytes kept), else from ``bytes=0-0``."""
        fixed = self._budget.fixed_max_bytes
        if suffix and (fixed is None or 4 * (suffix + HEADER_ALLOWANCE) <= fixed):  # a tight budget: 1 byte
            try:
                return self._suffix(suffix)
            except _NoSuffix as e:
                logger.info("%s: %s; asking for bytes=0-0 instead", self.name, e.why)
        return self._probe()

    def _suffix(self, suffix: int) -> int:
        self._budget.spend(suffix)
        status, total, body = self._request(0, suffix - 1, expect=None, suffix=True)
        if status == 416 or total is None:  # an empty file (416 "bytes */0": nothing to keep)
            return 0
        self.bytes_read += len(body)
        self._kept = (total - len(body), body)
        if total == len(body):
            self._whole = body  # a file this short came whole
        return total

    def _probe(self) -> int:
        self._budget.spend(1)
        status, total, body = self._request(0, 0, expect=None)
        if status == 416:  # "bytes */0": an empty file has no byte 0
            if total == 0:
                return 0
            raise HTTPFailure("HTTP 416 Range Not Satisfiable for the first byte of the file")
        if total is None:
            raise HTTPFailure("the server does not report the file size (no total in Content-Range)")
        self.bytes_read += len(body)
        return total

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        if self._conn is not None and self._conn.sock is not None:
            if self._waiting():  # an idle kept-alive connection has nothing to say: these are bytes past an answer
                self.close()
                raise HTTPFailure("the server sent bytes after its previous answer (past the length it declared); "
                                   "connection closed")
            return self._conn, True
        self.close()
        scheme, host, port = self._origin
        timeout = min(self._timeout, self._budget.remaining())
        conn = open_connection(scheme, host, port, timeout)
        via = f" through the proxy {proxy.url}" if (proxy := proxy_for(scheme, host)) else ""
        try:
            conn.connect()
        except socket.gaierror as e:
            raise HTTPFailure(f"cannot resolve host {host!r}{via} (DNS: {e.strerror})") from None
        except ConnectionRefusedError:
            raise HTTPFailure(f"connection refused by {host}:{port}{via} (nothing listens there)") from None
        except TimeoutError:
            raise HTTPFailure(f"no connection to {host}:{port}{via} within {timeout:.3g} s") from None
        except ssl.SSLError as e:
            raise HTTPFailure(f"TLS handshake with {host}:{port}{via} failed: {e.reason or e}") from None
        except OSError as e:
            raise HTTPFailure(f"cannot connect to {host}:{port}{via}: {e.strerror or e}") from None
        if conn.sock is not None:
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small range requests, no Nagle delay
        self._conn = conn
        return conn, False

    def _request(self, start: int, end: int, expect: int | None,
                 suffix: bool = False) -> tuple[int, int | None, bytes]:
        """GET bytes ``start..end`` (inclusive): (status, total size from Content-Range, body); ``suffix``: the
        last ``end + 1`` bytes instead (``bytes=-N``). The budget reserved the range's length; it is settled
        with what every exchange (hops, a retry) received."""
        received = [0]
        try:
            return self._request_hops(start, end, expect, received, suffix)
        finally:
            self.bytes_received += received[0]
            self._budget.settle(end - start + 1, received[0])

    def _request_hops(self, start: int, end: int, expect: int | None,
                      received: list[int], suffix: bool = False) -> tuple[int, int | None, bytes]:
        for _attempt in range(2):  # one retry when a kept-alive connection was closed by the server
            reused = False
            try:
                url = self._url
                for _hop in range(MAX_REDIRECTS + 1):
                    conn, reused = self._connection()
                    result = self._exchange(conn, url, start, end, expect, received, suffix)
                    if isinstance(result, str):  # a same-origin redirect
                        url = result
                        continue
                    self._url = url  # later reads go straight to where the redirects led
                    return result
                raise HTTPFailure(f"more than {MAX_REDIRECTS} redirects")
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                self.close()
                if self._expired:
                    raise self._budget.expired() from None
                if not reused:
                    raise HTTPFailure(f"the server closed the connection ({type(e).__name__})") from None
        raise HTTPFailure("the server closed the connection twice")

    def _exchange(self, conn: http.client.HTTPConnection, url: str, start: int, end: int,
                  expect: int | None, received: list[int], suffix: bool = False) -> tuple[int, int | None, bytes] | str:
        parts = urlsplit(url)
        length = end - start + 1
        tally = _Tally(HEADER_ALLOWANCE + length + length // FRAMING_ALLOWANCE)
        conn.response_class = functools.partial(_MeteredResponse, tally=tally)  # type: ignore[assignment]
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        remaining = self._budget.remaining()
        if conn.sock is not None:
            conn.sock.settimeout(min(self._timeout, remaining))
        # The overall deadline: when it passes, the socket is shut down under whatever read is blocked.
        watchdog = threading.Timer(remaining, self._expire, args=(conn,))
        watchdog.daemon = True
        watchdog.start()
        try:
            asked = f"bytes=-{length}" if suffix else f"bytes={start}-{end}"
            conn.request("GET", target, headers={**self._headers, "Range": asked})
            response = conn.getresponse()
            if suffix:
                return self._suffix_answer(response, url, length)
            return self._answer(response, url, start, end, expect)
        except _Overrun:
            self.close()
            raise HTTPFailure(f"the server sent more than {tally.cap} bytes for a range of {length} bytes "
                               "(headers, framing or data past the range); connection closed") from None
        except TimeoutError:
            self.close()
            # near the deadline the socket's timeout (the time left) and the watchdog race: either way, the deadline
            if self._expired or time.monotonic() >= self._budget.ends_at - 0.05:
                raise self._budget.expired() from None
            raise HTTPFailure(f"the server sent nothing for {self._timeout:g} s (HF_HUB_DOWNLOAD_TIMEOUT)") from None
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            if tally.received:  # the server said something, then hung up: not a stale kept-alive connection
                self.close()
                raise HTTPFailure("the server closed the connection in the middle of its answer") from None
            raise
        except (http.client.BadStatusLine, http.client.LineTooLong) as e:
            self.close()
            if self._expired:  # the watchdog cut a trickled status line short
                raise self._budget.expired() from None
            raise HTTPFailure(f"the server sent bytes after its previous answer (past the length it declared) or "
                               f"garbage where a status line belongs ({type(e).__name__}: {short_text(e, 80)}); "
                               "connection closed") from None
        except (http.client.HTTPException, OSError) as e:
            self.close()
            if self._expired:
                raise self._budget.expired() from None
            raise HTTPFailure(f"the connection failed ({type(e).__name__}: {e})") from None
        finally:
            watchdog.cancel()
            received[0] += tally.received

    def _answer(self, response: http.client.HTTPResponse, url: str, start: int, end: int,
                expect: int | None) -> tuple[int, int | None, bytes] | str:
        status = response.status
        if status in (301, 302, 303, 307, 308):
            location = response.getheader("Location")
            self.close()  # the redirect's body is not read
            if not location:
                raise HTTPFailure(f"HTTP {status} redirect without a Location")
            target = urljoin(url, location.strip())
            if origin(urlsplit(target)) != self._origin:
                raise HTTPFailure(f"HTTP {status} redirects to another origin ({short_text(target)}); only "
                                   "same-origin redirects are followed")
            return target
        if status == 200:
            self.close()
            raise HTTPFailure("the server does not support range requests (it answered a Range request with "
                               "HTTP 200 and the whole file); refusing to download it")
        if status == 416:
            total = _content_range_total(response.getheader("Content-Range"))
            self.close()
            if expect is None:
                return status, total, b""
            raise HTTPFailure("HTTP 416 Range Not Satisfiable (the file changed size?)")
        if status != 206:
            self.close()
            raise HTTPFailure(f"HTTP {status} {short_text(response.reason)}".rstrip(), not_found=status in (404, 410))
        encoding = (response.getheader("Content-Encoding") or "identity").strip().lower()
        if encoding != "identity":
            self.close()
            raise HTTPFailure(f"the server sent a {short_text(encoding)}-encoded range")
        span = _content_range(response.getheader("Content-Range"))
        if span is None or span[0] != start or span[1] != end:
            self.close()
            raise HTTPFailure(f"the server answered with another range ({short_text(response.getheader('Content-Range'))}"
                               f" for bytes={start}-{end})")
        length = end - start + 1
        if expect is not None and span[2] is not None and span[2] != self.size:
            self.close()
            raise HTTPFailure(f"the server now reports a size of {span[2]} bytes, not {self.size} (the file "
                               "changed, or the server misreports sizes)")
        declared = response.getheader("Content-Length")
        if declared is not None and declared.strip() != str(length):
            self.close()
            raise HTTPFailure(f"Content-Length {short_text(declared)} for a range of {length} bytes")
        body = self._read_body(response, length)
        self._check_end(response, start, end)
        return status, span[2], body

    def _suffix_answer(self, response: http.client.HTTPResponse, url: str,
                       length: int) -> tuple[int, int | None, bytes] | str:
        """The answer to ``bytes=-length``. Its ``Content-Range`` is believed only when it names exactly the last
        ``min(length, size)`` bytes of the size it reports; then the range is read as any other."""
        status = response.status
        if status in (200, 416):
            total = _content_range_total(response.getheader("Content-Range")) if status == 416 else None
            self.close()  # a 200's body (the whole file, perhaps) is not read
            if total == 0:
                return status, 0, b""  # "bytes */0": an empty file has no last bytes
            raise _NoSuffix(f"the server answered the suffix range bytes=-{length} with HTTP {status}")
        if status != 206:
            return self._answer(response, url, 0, length - 1, None)  # a redirect or an error: as for any range
        value = response.getheader("Content-Range")
        span = _content_range(value)
        total = span[2] if span is not None else None
        if span is None or total is None or span[1] != total - 1 or span[0] != max(0, total - length):
            self.close()
            raise HTTPFailure(f"the server answered the suffix range bytes=-{length} with Content-Range "
                               f"{short_text(value)!r}; the rule: a suffix range is answered with the file's last "
                               f"{length} bytes (all of a shorter file) and the file's size; refused")
        return self._answer(response, url, span[0], span[1], None)

    def _check_end(self, response: http.client.HTTPResponse, start: int, end: int) -> None:
        """The answer must end where the range does: a body framed by Content-Length was read exactly, and
        nothing may follow it; a chunked or close-delimited one must end now. Bytes past the range are a
        protocol error: the connection is closed, never drained."""
        if not response.chunked and response.length == 0:
            response.close()  # framed and read to its end: done (the connection stays open for the next range)
        elif not response.isclosed():  # chunked or close-delimited: one more byte must be the end
            if response.read1(1):
                self.close()
                raise HTTPFailure(f"the server sent more than bytes={start}-{end} (data past the range); "
                                   "connection closed")
        leftover = getattr(response, "leftover", 0) or self._waiting()
        if leftover:
            self.close()
            raise HTTPFailure(f"the server sent bytes after its answer to bytes={start}-{end} (past the "
                               "length it declared); connection closed")

    def _waiting(self) -> bool:
        """Whether the server already sent more on this kept-alive connection (nothing was asked)."""
        sock = self._conn.sock if self._conn is not None else None
        if sock is None or isinstance(sock, ssl.SSLSocket):
            return False  # closed; or TLS, whose socket cannot be peeked (the next answer's parse fails)
        try:
            poller = select.poll()  # a timeout socket's recv would wait for data first: ask the kernel instead
            poller.register(sock, select.POLLIN)
            if not poller.poll(0):
                return False
            return bool(sock.recv(1, socket.MSG_PEEK))  # readable: data, or b"" for a closed connection
        except (OSError, ValueError):
            return False

    def _read_body(self, response: http.client.HTTPResponse, length: int) -> bytes:
        parts, got = [], 0
        while got < length:
            self._budget.remaining()
            chunk = response.read1(min(HTTP_BODY_CHUNK, length - got))
            if not chunk:
                self.close()
                if self._expired:
                    raise self._budget.expired()
                raise HTTPFailure(f"the connection closed after {got} of {length} bytes")
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def _expire(self, conn: http.client.HTTPConnection) -> None:
        self._expired = True
        shut_down(conn)


def get_document(url: str, *, max_bytes: int, deadline: float, timeout: float | None = None,
                 headers: dict[str, str] | None = None,
                 check: Callable[[http.client.HTTPConnection], None] | None = None) -> tuple[int, bytes]:
    """GET a whole small document (a JSON API answer): (status, body), under the accounting of a range read.

    At most ``max_bytes`` of body, and every byte received capped as for a range (headers, 1xx answers, chunk
    framing and trailers included); the whole exchange ends by ``deadline`` seconds (the socket is shut
    down under a trickling server), each read waits at most ``timeout``. No redirects. ``check(conn)`` runs
    once connected (a peer-address policy). Every failure is a :class:`DDUFIOError` naming the URL."""
    parts = urlsplit(url)
    scheme, host, port = origin(parts)
    wait = min(float(timeout) if timeout else read_timeout(), deadline)
    conn = open_connection(scheme, host, port, wait)
    tally = _Tally(HEADER_ALLOWANCE + max_bytes + max_bytes // FRAMING_ALLOWANCE)
    conn.response_class = functools.partial(_MeteredResponse, tally=tally)  # type: ignore[assignment]
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        shut_down(conn)

    watchdog = threading.Timer(deadline, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.connect()
        if check is not None:
            check(conn)
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     headers={"User-Agent": "dduf_plus", "Accept-Encoding": "identity", **(headers or {})})
        response = conn.getresponse()
        body = bytearray()
        while chunk := response.read1(min(HTTP_BODY_CHUNK, max_bytes + 1 - len(body))):
            body += chunk
            if len(body) > max_bytes:
                raise DDUFIOError(f"{url}: more than {max_bytes} bytes (the most this document may have)")
        return response.status, bytes(body)
    except _Overrun:
        raise DDUFIOError(f"{url}: the server sent more than {tally.cap} bytes (headers, framing or a body over "
                          f"{max_bytes} bytes); connection closed") from None
    except (OSError, http.client.HTTPException) as e:
        if expired.is_set():
            raise DDUFIOError(f"{url}: took longer than its deadline of {deadline:g} s") from None
        raise DDUFIOError(f"{url}: the connection failed ({type(e).__name__}: {short_text(e)})") from None
    finally:
        watchdog.cancel()
        conn.close()


def short_text(text: object, limit: int = 120) -> str:
    text = str(text or "")
    return text if len(text) <= limit else text[:limit] + "..."


def _content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``bytes a-b/total`` (total may be ``*``) -> (a, b, total)."""
    if not value:
        return None
    unit, _, rest = value.strip().partition(" ")
    span, _, total = rest.partition("/")
    first, _, last = span.partition("-")
    try:
        if unit.lower() != "bytes":
            return None
        return int(first), int(last), (None if total.strip() == "*" else int(total))
    except ValueError:
        return None


def _content_range_total(value: str | None) -> int | None:
    """The size in ``bytes */size`` (a 416 answer)."""
    if not value or "/" not in value:
        return None
    try:
        return int(value.rsplit("/", 1)[1])
    except ValueError:
        return None
