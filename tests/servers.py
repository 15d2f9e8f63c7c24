"""Local HTTP servers for tests and benchmarks (``import servers`` from tests/, or put tests/ on sys.path).

:class:`FileServer` serves the files under a folder on 127.0.0.1 with ``Range: bytes=a-b`` and suffix ranges
``bytes=-N`` (206), HEAD, and
knobs for what real links and hostile servers do: a per-request round-trip ``latency``, a shared ``bandwidth``
cap (bytes/s over all connections, like one link), a server that ignores ``Range``, one that lies about
sizes, one that stalls after some bytes. It counts requests and body bytes. Files are read with ``os.pread``
in chunks, so multi-GB archives are served without loading them whole."""

from __future__ import annotations

import http.server
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHUNK = 1 << 20


class TokenBucket:
    """A bandwidth cap shared by every connection: ``take(n)`` sleeps until n bytes may go out."""

    def __init__(self, rate: float, burst: int = 4 * CHUNK):
        self.rate, self.burst = float(rate), burst
        self._tokens, self._last = float(burst), time.perf_counter()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            now = time.perf_counter()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class FileServer(http.server.ThreadingHTTPServer):
    """Serves ``root``; use as a context manager (starts a thread, shuts down on exit).

    Args:
        latency: seconds slept before answering each request (an injected round trip); the wait ends early when
            the server stops, so a test may set a latency far past anything it waits for, and check
            ``waited_out`` (requests whose whole latency passed) to say the client gave up first.
        bandwidth: bytes/s shared by all responses (None: unlimited).
        per_connection: bytes/s for each connection on its own, within ``bandwidth`` (None: unlimited): a link
            whose single stream is slower than the whole, as object stores and CDNs serve.
        ranges: False answers every GET with the whole file (200), as a server that ignores Range.
        suffix: how a suffix range (``bytes=-N``, the last N bytes) is answered: ``"206"`` (the last N bytes),
            ``"200"`` (the whole file, as a server that knows only ``bytes=a-b``) or ``"416"``.
        lie_size: added to the Content-Length / total size a HEAD or 206 reports.
        stall_after: stop sending (and hold the connection, up to 60 s or until ``stop_stalling``) after this many
            body bytes of a response; ``stalls_outlasted`` counts the stalls that reached 60 s (a client with no
            read timeout).
        stall_after_total: stall every response once this many body bytes have been sent in all (a link
            that dies mid-download).
        close_after: close the connection after this many body bytes of a response (a short read).
        on_request: called with (method, path, headers) before each answer (for recording).
    """

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # many clients connect at once (concurrent range readers)

    def __init__(self, root: str | os.PathLike, *, latency: float = 0.0, bandwidth: float | None = None,
                 per_connection: float | None = None, ranges: bool = True, suffix: str = "206", lie_size: int = 0, stall_after: int | None = None,
                 stall_after_total: int | None = None, close_after: int | None = None,
                 on_request: Callable[[str, str, Any], None] | None = None, host: str = "127.0.0.1"):
        self.root = Path(root)
        self.latency, self.ranges_supported, self.lie_size, self.stall_after = latency, ranges, lie_size, stall_after
        self.stall_after_total, self.close_after = stall_after_total, close_after
        if suffix not in ("206", "200", "416"):
            raise ValueError(f"suffix={suffix!r}: one of '206', '200', '416'")
        self.suffix = suffix
        self.bucket = TokenBucket(bandwidth) if bandwidth else None
        self.per_connection = per_connection
        self.on_request = on_request
        self.lock = threading.Lock()
        self.stop_stalling = threading.Event()
        self.release = threading.Event()  # set on exit: any latency still being slept ends
        self.reset()
        super().__init__((host, 0), FileHandler)
        self._thread: threading.Thread | None = None

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up mid-answer (it refused a 200 to a suffix range, a deadline passed) is expected."""
        import sys

        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def reset(self) -> None:
        with self.lock:
            self.body_bytes, self.gets, self.heads = 0, 0, 0
            self.sent_bytes = 0  # body bytes actually written (body_bytes counts what was promised)
            self.in_flight, self.max_in_flight = 0, 0  # GET bodies being sent at once
            self.waited_out = 0  # requests answered after their whole latency (not cut short by the exit)
            self.stalls_outlasted = 0  # stalls held the full 60 s: the client never gave up on them
            self.ranges: list[tuple[int, int]] = []  # (start, length) of every body sent (a 200: the whole file)
            self.range_headers: list[str] = []  # the Range header of every GET ("" when none)

    def url(self, name: str = "") -> str:
        return f"http://127.0.0.1:{self.server_port}/{name}"

    def __enter__(self) -> FileServer:
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.stop_stalling.set()
        self.shutdown()
        self.server_close()


class FileHandler(http.server.BaseHTTPRequestHandler):
    server: FileServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else each small response waits ~40 ms for a delayed ACK

    def log_message(self, *args: object) -> None:
        pass

    def _path(self) -> Path | None:
        name = self.path.split("?", 1)[0].lstrip("/")
        path = (self.server.root / name).resolve()
        root = self.server.root.resolve()
        if root not in path.parents or not path.is_file():
            return None
        return path

    def _begin(self, method: str) -> Path | None:
        if self.server.on_request is not None:
            self.server.on_request(method, self.path, self.headers)
        if self.server.latency and not self.server.release.wait(self.server.latency):
            with self.server.lock:
                self.server.waited_out += 1
        path = self._path()
        if path is None:
            self.send_error(404)
        return path

    def do_HEAD(self) -> None:  # noqa: N802
        path = self._begin("HEAD")
        with self.server.lock:
            self.server.heads += 1
        if path is None:
            return
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size + self.server.lie_size))
        self.send_header("Accept-Ranges", "bytes" if self.server.ranges_supported else "none")
        self.send_header("ETag", f'"{path.stat().st_mtime_ns:x}-{path.stat().st_size:x}"')
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        path = self._begin("GET")
        if path is None:
            return
        size = path.stat().st_size
        asked = self.headers.get("Range", "")
        with self.server.lock:
            self.server.range_headers.append(asked)
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", asked)
        suffix = int(match[2]) if match is not None and not match[1] and match[2] else None
        if suffix is not None and self.server.ranges_supported and (self.server.suffix == "416" or not size * suffix):
            with self.server.lock:
                self.server.gets += 1
                self.server.ranges.append((size, 0))
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if suffix is not None and self.server.ranges_supported and self.server.suffix == "206":
            start, end = max(0, size - suffix), size - 1
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size + self.server.lie_size}")
        elif match is not None and match[1] and self.server.ranges_supported and int(match[1]) < size:
            start = int(match[1])
            end = min(int(match[2]) if match[2] else size - 1, size - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size + self.server.lie_size}")
        else:
            start, end = 0, size - 1
            self.send_response(200)
        length = end - start + 1
        with self.server.lock:  # counted before sending: the client may finish before this thread resumes
            self.server.gets += 1
            self.server.body_bytes += length
            self.server.ranges.append((start, length))
        self.send_header("Content-Length", str(length + self.server.lie_size))
        self.send_header("Accept-Ranges", "bytes" if self.server.ranges_supported else "none")
        self.end_headers()
        with self.server.lock:
            self.server.in_flight += 1
            self.server.max_in_flight = max(self.server.max_in_flight, self.server.in_flight)
        try:
            self._send(path, start, length)
        finally:
            with self.server.lock:
                self.server.in_flight -= 1

    def _limit(self, sent: int) -> int | None:
        """How many more bytes this response may send before it stalls (None: no limit)."""
        srv = self.server
        limits = []
        if srv.stall_after is not None:
            limits.append(srv.stall_after - sent)
        if srv.stall_after_total is not None:
            with srv.lock:
                limits.append(srv.stall_after_total - srv.sent_bytes)
        return min(limits) if limits else None

    def _send(self, path: Path, start: int, length: int) -> None:
        sent = 0
        fd = os.open(path, os.O_RDONLY)
        try:
            while sent < length:
                if self.server.close_after is not None and sent >= self.server.close_after:
                    self.close_connection = True
                    return
                limit = self._limit(sent)
                if limit is not None and limit <= 0:
                    if not self.server.stop_stalling.wait(60):
                        with self.server.lock:
                            self.server.stalls_outlasted += 1
                    return
                n = min(CHUNK, length - sent)
                if limit is not None:
                    n = min(n, limit)
                if self.server.close_after is not None:
                    n = min(n, self.server.close_after - sent)
                if self.server.per_connection:  # one bucket per connection (this handler), kept across requests
                    if getattr(self, "_own_bucket", None) is None:
                        self._own_bucket = TokenBucket(self.server.per_connection)
                    self._own_bucket.take(n)
                if self.server.bucket is not None:
                    self.server.bucket.take(n)
                data = os.pread(fd, n, start + sent)
                if not data:
                    return
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    return
                sent += len(data)
                with self.server.lock:
                    self.server.sent_bytes += len(data)
        finally:
            os.close(fd)


def count_connects(monkeypatch: Any) -> list[tuple[str, int]]:
    """Records every TCP connection attempt made through ``socket.create_connection`` (http.client, httpx and
    requests all open theirs there) while the test runs: retries are counted, not timed."""
    import socket

    attempts: list[tuple[str, int]] = []
    original = socket.create_connection

    def counting(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        attempts.append((address[0], int(address[1])))
        return original(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", counting)
    return attempts


def served_archive(archive: Path, tmp_path: Path, monkeypatch: Any) -> Path:
    """A folder ``www`` holding a copy of ``archive``, with a private dduf_plus cache and the Hub online (the
    remote tests' common setup)."""
    import shutil

    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    folder = tmp_path / "www"
    folder.mkdir()
    shutil.copyfile(archive, folder / archive.name)
    return folder
