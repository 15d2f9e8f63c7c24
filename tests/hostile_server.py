"""A hostile range server for tests and the fuzzer: the files under a folder on 127.0.0.1, answered in one of
:data:`MODES` (``HostileServer(root, mode)``; ``server.mode`` may change between requests).

Every answer is written by hand (status line, headers, body), so the server can break HTTP the way an
attacker would: send more bytes than the range (framed by Content-Length, chunked, or until it closes the
connection), trickle, stall, lie about sizes and ranges, change its bytes between requests, ignore ``Range``,
redirect forever, flood headers. It counts what it *sends* (``sent``: every byte written to a socket,
headers included), which bounds what any client can have received: tests assert on it.

Each connection's send buffer is small (:data:`SNDBUF`) and every write times out after
:data:`WRITE_TIMEOUT_S`, so a client that stops reading stops the server's thread too; the overrun modes send
at most ``extra`` bytes past each answer. Paths: ``/NAME`` serves ``root/NAME``; ``/api/...`` JSON files are
served the same way (the webhook's Hub API), in the same mode."""

from __future__ import annotations

import http.server
import os
import re
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

SNDBUF = 64 << 10
WRITE_TIMEOUT_S = 3.0
DEFAULT_EXTRA = 64 << 20  # bytes an overrunning answer sends past what was asked
_CHUNK = 64 << 10
_INVERT = bytes(range(255, -1, -1))

# mode -> what the server does (the docs of each mode; tests parametrize over the keys)
MODES: dict[str, str] = {
    "honest": "a correct 206 for every range (the control case)",
    "overrun-length": "a correct 206 framed by Content-Length, then `extra` more bytes on the connection",
    "overrun-declared": "Content-Length says `extra` more bytes than the range, and they are sent",
    "overrun-close": "a correct Content-Range, no Content-Length: the range, `extra` more bytes, then close",
    "overrun-chunked": "a correct Content-Range, chunked: the range then `extra` more bytes in chunks",
    "chunked-trailer": "the exact range chunked, then an endless trailer (header lines after the last chunk)",
    "tiny-chunks": "the exact range in 1-byte chunks, each with a 60-byte chunk extension",
    "continue-flood": "an endless series of `100 Continue` answers before the real one",
    "header-flood": "a 206 with an endless list of header lines",
    "trickle": "headers at once, then the body one byte every 50 ms",
    "trickle-headers": "the status line and headers one byte every 50 ms",
    "stall": "headers at once, then nothing (the connection held open)",
    "short": "Content-Length of the range, half of it, then close",
    "size-lie": "every answer reports a total 1000x the real size (bytes past the end are zeros)",
    "probe-size": "the first request (the probe) reports one total, the ranges another",
    "range-lie": "Content-Range names another span than the one asked for (off by one)",
    "change-bytes": "after the first 2 answers, every body has each byte inverted (the file changed)",
    "ignore-range": "200 with the whole file and `extra` more bytes (Range ignored)",
    "redirect-loop": "302 to the same path with a new query, forever",
    "redirect-offsite": "302 to another origin",
    "gzip": "a Content-Encoding: gzip range",
    "bad-status": "a garbage status line then `extra` bytes",
    # a suffix range (``bytes=-N``: the last N bytes, how opening asks for the size and the tail at once)
    "suffix-ignore": "a suffix range gets 200 with the whole file and `extra` more bytes; `bytes=a-b` is honest",
    "suffix-416": "a suffix range gets 416 (as a server that knows only `bytes=a-b`); `bytes=a-b` is honest",
    "suffix-lie": "a suffix range gets the last N bytes under a Content-Range whose total is 1 MiB more",
    "suffix-more": "a suffix range gets 206 with the whole file, Content-Range bytes 0-(size-1)/size (more than asked)",
    "suffix-overrun": "a suffix range gets the right 206 framed by Content-Length, then `extra` more bytes",
}
SUFFIX_MODES = ("suffix-ignore", "suffix-416", "suffix-lie", "suffix-more", "suffix-overrun")


class HostileServer(http.server.ThreadingHTTPServer):
    """Serves ``root`` in ``mode``; a context manager (a thread; shut down on exit).

    ``honest_first``: answer the first N requests honestly, so the mode hits later ranges (not only the
    opening probe). Counters (reset with :meth:`reset`): ``requests``, ``sent`` (bytes written, headers
    included), ``connections``."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, root: str | os.PathLike, mode: str = "honest", *, extra: int = DEFAULT_EXTRA,
                 trickle_s: float = 0.05, honest_first: int = 0):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}")
        self.root, self.mode, self.extra, self.trickle_s = Path(root), mode, extra, trickle_s
        self.honest_first = honest_first  # the first N requests are answered honestly (past the probe, the tail)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.reset()
        super().__init__(("127.0.0.1", 0), _Handler)

    def reset(self) -> None:
        with self.lock:
            self.requests = self.sent = self.connections = 0
            self.trickled = 0  # bytes sent one at a time (each after trickle_s): a count that a busy machine lowers
            self.stalls_outlasted = 0  # stalls held WRITE_TIMEOUT_S with the client still connected
            self.active = getattr(self, "active", 0)  # answers being written now (not reset: threads still run)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up or stops reading is what these tests do: no traceback for it."""
        import sys

        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def restart_count(self) -> None:
        """Number the next request 1 again (``honest_first`` and the per-request modes count from there)."""
        with self.lock:
            self.requests = 0

    def url(self, name: str = "") -> str:
        return f"http://127.0.0.1:{self.server_port}/{name}"

    def count(self, n: int) -> None:
        with self.lock:
            self.sent += n

    def __enter__(self) -> HostileServer:
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: HostileServer
    protocol_version = "HTTP/1.1"
    timeout = WRITE_TIMEOUT_S  # applied to the connection: a client that stops reading frees this thread

    def setup(self) -> None:
        self.request.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.lock:
            self.server.connections += 1
        super().setup()

    def log_message(self, *args: object) -> None:
        pass

    # -- writing, counted ------------------------------------------------------------------------------------
    def _write(self, data: bytes) -> bool:
        """Write ``data``; False once the client is gone (or stopped reading for WRITE_TIMEOUT_S)."""
        if self.server.stopping.is_set():
            return False
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:  # BrokenPipe, ConnectionReset, timeout
            self.close_connection = True
            return False
        self.server.count(len(data))
        return True

    def _head(self, status: str, headers: list[tuple[str, str]]) -> bool:
        lines = [f"HTTP/1.1 {status}"] + [f"{k}: {v}" for k, v in headers]
        return self._write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def _stream(self, produce: Any, total: int, step: int = _CHUNK) -> bool:
        """Write ``total`` bytes made by ``produce(offset, n)``, ``step`` at a time."""
        done = 0
        while done < total:
            n = min(step, total - done)
            if not self._write(produce(done, n)):
                return False
            done += n
        return True

    def _trickle(self, data: bytes) -> None:
        for i in range(len(data)):
            if not self._write(data[i : i + 1]) or self.server.stopping.wait(self.server.trickle_s):
                self.close_connection = True
                return
            with self.server.lock:
                self.server.trickled += 1

    def _stall(self) -> None:
        """Hold the connection, sending nothing, for WRITE_TIMEOUT_S; counted when the client is still there at
        the end (a client with a read timeout has hung up by then)."""
        if not self.server.stopping.wait(WRITE_TIMEOUT_S) and not self._peer_closed():
            with self.server.lock:
                self.server.stalls_outlasted += 1
        self.close_connection = True

    def _peer_closed(self) -> bool:
        try:
            readable, _, _ = select.select([self.request], [], [], 0)
            return bool(readable) and self.request.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except OSError:  # reset by the peer: gone too
            return True

    # -- the file --------------------------------------------------------------------------------------------
    def _file(self) -> Path | None:
        name = self.path.split("?", 1)[0].lstrip("/")
        path = (self.server.root / name).resolve()
        root = self.server.root.resolve()
        return path if root in path.parents and path.is_file() else None

    def _range(self, size: int) -> tuple[int, int] | None:
        asked = self.headers.get("Range", "")
        suffix = re.fullmatch(r"bytes=-(\d+)", asked)
        if suffix:  # the last N bytes (N = 0: nothing, answered 416 below)
            return max(0, size - int(suffix[1])), size - 1 if int(suffix[1]) else -1
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", asked)
        if not match:
            return None
        start = int(match[1])
        end = int(match[2]) if match[2] else size - 1
        return start, min(end, size - 1)

    def do_GET(self) -> None:  # noqa: N802
        with self.server.lock:
            self.server.requests += 1
            self.server.active += 1
            number = self.server.requests
        try:
            self._get(number)
        finally:
            with self.server.lock:
                self.server.active -= 1

    def _get(self, number: int) -> None:
        mode = self.server.mode if number > self.server.honest_first else "honest"
        path = self._file()
        if path is None:
            self._head("404 Not Found", [("Content-Length", "0")])
            return
        data = path.read_bytes()
        if path.suffix == ".json" or "/api/" in self.path:
            self._json(mode, data)
            return
        self._answer(mode, data, number)

    def _json(self, mode: str, data: bytes) -> None:
        """A whole-document GET (the Hub API): the same hostility, with no range."""
        if mode in ("trickle", "trickle-headers"):
            self._head("200 OK", [("Content-Length", str(len(data)))])
            self._trickle(data)
        elif mode == "stall":
            self._head("200 OK", [("Content-Length", str(len(data)))])
            self._stall()
        elif mode in ("overrun-close", "overrun-chunked", "overrun-length", "overrun-declared", "ignore-range"):
            # an endless document: the JSON, then spaces (still valid JSON, if it ever ended)
            self._head("200 OK", [("Connection", "close")])
            self._write(data)
            self._stream(lambda _o, n: b" " * n, self.server.extra)
            self.close_connection = True
        elif mode in ("continue-flood", "header-flood", "chunked-trailer", "tiny-chunks", "bad-status"):
            self._flood(mode)
        else:
            self._head("200 OK", [("Content-Length", str(len(data)))])
            self._write(data)

    def _flood(self, mode: str) -> None:
        if mode == "continue-flood":
            self._stream(lambda _o, n: b"HTTP/1.1 100 Continue\r\n\r\n" * (n // 25), self.server.extra, 25 * 2600)
        elif mode == "header-flood":
            self._write(b"HTTP/1.1 206 Partial Content\r\n")
            self._stream(lambda _o, n: b"X-Flood: 1234567890\r\n" * (n // 21), self.server.extra, 21 * 3100)
        elif mode == "bad-status":
            self._write(b"XTTP/9.9 206 Partial Content\r\n")
            self._stream(lambda _o, n: b"\0" * n, self.server.extra)
        else:  # chunked-trailer, tiny-chunks on a JSON document: an endless chunked body
            self._head("200 OK", [("Transfer-Encoding", "chunked")])
            self._stream(lambda _o, n: b"1;" + b"x" * 60 + b"\r\n \r\n", self.server.extra, 66)
        self.close_connection = True

    # long: one branch per hostile mode, each a few lines; splitting it hides which mode does what
    def _answer(self, mode: str, data: bytes, number: int) -> None:
        size = len(data)
        total = size * 1000 if mode == "size-lie" else size  # past the real end: zeros
        asked = self._range(total)
        if mode in SUFFIX_MODES:
            if not self.headers.get("Range", "").startswith("bytes=-"):
                mode = "honest"
            elif self._suffix(mode, data):
                return
        if mode == "ignore-range" or asked is None:
            self._head("200 OK", [("Content-Length", str(size + self.server.extra))])
            self._write(data) and self._stream(lambda _o, n: b"\0" * n, self.server.extra)
            self.close_connection = True
            return
        if mode == "redirect-loop":
            self._head("302 Found", [("Location", f"{self.path.split('?')[0]}?n={number}"), ("Content-Length", "0")])
            return
        if mode == "redirect-offsite":
            self._head("302 Found", [("Location", "http://127.0.0.2:9/elsewhere.dduf"), ("Content-Length", "0")])
            return
        if mode in ("continue-flood", "header-flood", "bad-status"):
            self._flood(mode)
            return
        start, end = asked
        if start >= total:
            self._head("416 Range Not Satisfiable", [("Content-Range", f"bytes */{size}"), ("Content-Length", "0")])
            return
        if end - start + 1 > 256 << 20:
            self._head("416 Range Not Satisfiable", [("Content-Range", f"bytes */{total}"), ("Content-Length", "0")])
            return
        body = data[start : end + 1] + bytes(max(0, end + 1 - max(start, size)))
        if mode == "probe-size" and number == self.server.honest_first + 1:
            total = size + (1 << 20)
        if mode == "change-bytes" and number > 2:
            body = body.translate(_INVERT)
        span = f"bytes {start + (mode == 'range-lie')}-{end}/{total}"
        common = [("Content-Range", span), ("Accept-Ranges", "bytes")]
        if mode == "gzip":
            common.append(("Content-Encoding", "gzip"))
        if mode == "overrun-length":
            if self._head("206 Partial Content", [*common, ("Content-Length", str(len(body)))]) and self._write(body):
                self._stream(lambda _o, n: b"\0" * n, self.server.extra)
            self.close_connection = True
        elif mode == "overrun-declared":
            if self._head("206 Partial Content", [*common, ("Content-Length", str(len(body) + self.server.extra))]):
                self._write(body) and self._stream(lambda _o, n: b"\0" * n, self.server.extra)
            self.close_connection = True
        elif mode == "overrun-close":
            if self._head("206 Partial Content", [*common, ("Connection", "close")]) and self._write(body):
                self._stream(lambda _o, n: b"\0" * n, self.server.extra)
            self.close_connection = True
        elif mode in ("overrun-chunked", "chunked-trailer", "tiny-chunks"):
            self._chunked(mode, common, body)
        elif mode in ("trickle", "stall", "trickle-headers"):
            self._slow(mode, common, body)
        elif mode == "short":
            self._head("206 Partial Content", [*common, ("Content-Length", str(len(body)))])
            self._write(body[: len(body) // 2])
            self.close_connection = True
        else:  # honest, size-lie, probe-size, range-lie, change-bytes, gzip
            self._head("206 Partial Content", [*common, ("Content-Length", str(len(body)))]) and self._write(body)

    def _suffix(self, mode: str, data: bytes) -> bool:
        """Answer a suffix range in a ``suffix-*`` mode; False: answer it as the range it names."""
        size = len(data)
        if mode == "suffix-ignore":
            self._head("200 OK", [("Content-Length", str(size + self.server.extra))])
            self._write(data) and self._stream(lambda _o, n: b"\0" * n, self.server.extra)
        elif mode == "suffix-416":
            self._head("416 Range Not Satisfiable", [("Content-Range", f"bytes */{size}"), ("Content-Length", "0")])
            return True
        elif mode == "suffix-more":
            self._head("206 Partial Content", [("Content-Range", f"bytes 0-{size - 1}/{size}"),
                                               ("Content-Length", str(size))]) and self._write(data)
        else:
            asked = self._range(size)
            if asked is None:
                return False
            start, end = asked
            total = size + (1 << 20) if mode == "suffix-lie" else size
            self._head("206 Partial Content", [("Content-Range", f"bytes {start}-{end}/{total}"),
                                               ("Content-Length", str(end + 1 - start))])
            if self._write(data[start:end + 1]) and mode == "suffix-overrun":
                self._stream(lambda _o, n: b"\0" * n, self.server.extra)
        self.close_connection = True
        return True

    def _chunked(self, mode: str, common: list[tuple[str, str]], body: bytes) -> None:
        if not self._head("206 Partial Content", [*common, ("Transfer-Encoding", "chunked")]):
            return
        if mode == "tiny-chunks":
            for i in range(len(body)):
                if not self._write(b"1;" + b"x" * 60 + b"\r\n" + body[i : i + 1] + b"\r\n"):
                    return
            self._write(b"0\r\n\r\n")
            return
        if not self._write(b"%x\r\n%s\r\n" % (len(body), body)):
            return
        if mode == "overrun-chunked":
            self._stream(lambda _o, n: b"%x\r\n%s\r\n" % (n, b"\0" * n), self.server.extra)
            self._write(b"0\r\n\r\n")
        else:  # chunked-trailer
            self._write(b"0\r\n")
            self._stream(lambda _o, n: b"X-Trailer: 1234567890\r\n" * (n // 23), self.server.extra, 23 * 2800)
        self.close_connection = True

    def _slow(self, mode: str, common: list[tuple[str, str]], body: bytes) -> None:
        head = ("HTTP/1.1 206 Partial Content\r\n" + "".join(f"{k}: {v}\r\n" for k, v in common)
                + f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1")
        if mode == "trickle-headers":
            self._trickle(head)
            return
        if not self._write(head):
            return
        if mode == "stall":
            self._stall()
            return
        self._trickle(body)


def wait_idle(server: HostileServer, timeout: float = WRITE_TIMEOUT_S + 2) -> None:
    """Wait until no answer is being written, or the bytes sent stopped moving for 0.1 s (a stalled answer
    holding its connection)."""
    deadline = time.monotonic() + timeout
    last, still = -1, 0
    while time.monotonic() < deadline:
        with server.lock:
            active, now = server.active, server.sent
        if active == 0:
            return
        still = still + 1 if now == last else 0
        if still >= 5:
            return
        last = now
        time.sleep(0.02)
