"""Remote sources are untrusted: an overall deadline, a byte budget, same-origin redirects only, an allow-list of
URL schemes, and errors that say what failed. Every server here is a thread on 127.0.0.1."""

from __future__ import annotations

import http.server
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from conftest import load_make_hostile
from dduf_plus.cli import main as cli_main
from dduf_plus.errors import DDUFError, DDUFIOError, DDUFNotFoundError, DDUFUsageError
from dduf_plus.format.validate import validate
from dduf_plus.storage.source import FsspecSource, HTTPSource, open_source

mh = load_make_hostile()


class Site(http.server.ThreadingHTTPServer):
    """Behaviour by path: ``/a.dduf`` a range-capable file, ``/trickle-body``, ``/trickle-head``, ``/norange``,
    ``/missing``, ``/gzip``, ``/redirect/<where>``, ``/close/a.dduf`` (Connection: close after every answer).
    Records every request line it receives."""

    daemon_threads = True

    def __init__(self, data: bytes):
        self.data = data
        self.requests: list[str] = []
        self.redirects: dict[str, str] = {}
        self.trickle_delay = 0.25
        # a trickle ends (the connection closed) after this many bytes, ~10 s: a client with no deadline then
        # sees a short read, not a deadline error; ``trickled`` counts the bytes sent so far
        self.trickle_limit = 40
        self.trickled = 0
        super().__init__(("127.0.0.1", 0), Handler)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.server_port}{path}"


class Handler(http.server.BaseHTTPRequestHandler):
    server: Site
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args: object) -> None:
        pass

    def _range(self) -> tuple[int, int]:
        size = len(self.server.data)
        suffix = re.fullmatch(r"bytes=-(\d+)", self.headers.get("Range", ""))  # the opening: the last N bytes
        if suffix:
            return max(0, size - int(suffix[1])), size - 1
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        assert match, self.headers.get("Range")
        return int(match[1]), min(int(match[2]), size - 1)

    def _partial(self, close: bool = False) -> None:
        start, end = self._range()
        body = self.server.data[start : end + 1]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(self.server.data)}")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _trickle(self, byte: bytes) -> bool:
        """Send one byte after trickle_delay; False (the connection closed) once trickle_limit bytes were sent."""
        if self.server.trickled >= self.server.trickle_limit:
            self.close_connection = True
            return False
        self.wfile.write(byte)
        self.wfile.flush()
        self.server.trickled += 1
        time.sleep(self.server.trickle_delay)
        return True

    def do_GET(self) -> None:  # noqa: N802
        self.server.requests.append(self.path)
        path = self.path
        try:
            if path == "/a.dduf":
                self._partial()
            elif path == "/close/a.dduf":
                self._partial(close=True)
            elif path == "/trickle-body":  # a 1-byte probe (byte 0) at once, every other range (the opening's
                start, end = self._range()  # suffix too) a byte at a time
                if end == 0:
                    self._partial()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(self.server.data)}")
                self.send_header("Content-Length", str(end - start + 1))
                self.end_headers()
                for i in range(end - start + 1):
                    if not self._trickle(self.server.data[start + i : start + i + 1]):
                        return
            elif path == "/trickle-head":
                for byte in b"HTTP/1.1 206 Partial Content\r\nX-Slow: " + b"a" * 10_000:
                    if not self._trickle(bytes([byte])):
                        return
            elif path == "/norange":
                self.send_response(200)
                self.send_header("Content-Length", str(len(self.server.data)))
                self.end_headers()
                self.wfile.write(self.server.data)
            elif path == "/gzip":
                start, end = self._range()
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(self.server.data)}")
                self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(end - start + 1))
                self.end_headers()
                self.wfile.write(self.server.data[start : end + 1])
            elif path.startswith("/redirect/"):
                self.send_response(302)
                self.send_header("Location", self.server.redirects[path])
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self.send_error(404)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up: what a deadline is for
            pass


def serve(server: http.server.HTTPServer):
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    return mh.write_valid(tmp_path_factory.mktemp("remote") / "a.dduf")


@pytest.fixture
def site(archive):
    server = serve(Site(archive.read_bytes()))
    yield server
    server.shutdown()
    server.server_close()


# --- what works -------------------------------------------------------------------------------------------


def test_range_server_validates_and_reuses_one_connection(site):
    site.requests.clear()
    report = validate(site.url("/a.dduf"))
    assert report.valid, report
    # a file this small (under storage.http_range.SUFFIX_BYTES) comes whole with the opening request (a suffix
    # range), instead of one request per record and header; larger files: exact ranges (test_validate_remote.py)
    assert report.bytes_read == len(site.data) and len(site.requests) == 1, site.requests


def test_server_closing_each_connection_still_works(site):
    assert validate(site.url("/close/a.dduf")).valid


def test_same_origin_redirect_is_followed_once(site):
    site.redirects["/redirect/same"] = "/a.dduf"
    source = HTTPSource(site.url("/redirect/same"), suffix=0)  # a 1-byte opening: the read below is a request
    try:
        assert source.size == len(site.data)
        site.requests.clear()
        assert source.read_at(0, 4) == site.data[:4]
        assert site.requests == ["/a.dduf"]  # later reads go straight to the target
    finally:
        source.close()


# --- deadlines --------------------------------------------------------------------------------------------


def test_trickling_body_is_cut_off_at_the_deadline(site):
    """Each byte arrives well within the per-read timeout: only the overall deadline can stop it. Counted at
    the server: the client hung up before the trickle's end (40 bytes, ~10 s); a client without the deadline
    reads to that end and fails on the short read instead."""
    site.trickled = 0
    with pytest.raises(DDUFIOError, match="deadline of 1.5 s"):
        validate(site.url("/trickle-body"), deadline=1.5)
    assert site.trickled < site.trickle_limit


def test_trickling_headers_are_cut_off_at_the_deadline(site, capsys, monkeypatch):
    site.trickled = 0
    with pytest.raises(DDUFIOError, match="deadline"):
        validate(site.url("/trickle-head"), deadline=1.0)
    assert site.trickled < site.trickle_limit
    monkeypatch.setenv("DDUF_REMOTE_DEADLINE", "1")
    site.trickled = 0
    assert cli_main(["validate", site.url("/trickle-head")]) == 2
    assert site.trickled < site.trickle_limit
    assert "deadline of 1 s" in capsys.readouterr().err


def test_deadline_counts_from_opening_over_many_reads(site):
    source = HTTPSource(site.url("/a.dduf"), deadline=0.5, suffix=0)  # else the opening brought the whole file
    try:
        time.sleep(0.6)
        with pytest.raises(DDUFIOError, match="deadline"):
            source.read_at(0, 4)
    finally:
        source.close()


def test_fsspec_backends_are_bounded_by_the_deadline_too():
    """A backend call that blocks (here: a fake file system whose reads sleep) is given up at the deadline."""
    import fsspec
    from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

    release, returned = threading.Event(), threading.Event()

    class SlowFile(AbstractBufferedFile):
        def _fetch_range(self, start: int, end: int) -> bytes:
            release.wait(60)  # blocks until the test is done with it
            returned.set()
            return bytes(end - start)

    class SlowFS(AbstractFileSystem):
        protocol = "slowtest"

        def info(self, path: str, **kwargs: object) -> dict:
            return {"name": path, "size": 1000, "type": "file"}

        def _open(self, path: str, mode: str = "rb", **kwargs: object) -> SlowFile:
            return SlowFile(self, path, mode, size=1000, **kwargs)

    fsspec.register_implementation("slowtest", SlowFS, clobber=True)
    source = FsspecSource("slowtest://x.dduf", deadline=0.5)  # direct: open_source refuses the scheme
    try:
        with pytest.raises(DDUFIOError, match="deadline"):
            source.read_at(0, 10)
        assert not returned.is_set()  # given up while the backend call was still blocked, not after it
        with pytest.raises(DDUFIOError, match="overran the deadline"):
            source.read_at(0, 10)
    finally:
        release.set()
        source.close()


# --- byte budget ------------------------------------------------------------------------------------------


def test_byte_budget_is_refused_before_the_request(site, monkeypatch):
    source = open_source(site.url("/a.dduf"), max_bytes=1000)
    try:
        site.requests.clear()
        source.read_at(0, 50)
        # every byte received counts: the probe's and this read's headers too (~150 bytes an answer)
        assert 1 + 50 + 2 * 100 < source.bytes_received == source._budget.fetched < 1 + 50 + 2 * 300
        with pytest.raises(DDUFIOError, match="byte budget of 1000 bytes"):
            source.read_at(50, 1000 - 51 - 100)
        assert site.requests == ["/a.dduf"]  # the refused read sent nothing
    finally:
        source.close()
    monkeypatch.setenv("DDUF_REMOTE_MAX_BYTES", "200")
    with pytest.raises(DDUFError, match="byte budget"):
        validate(site.url("/a.dduf"), verify=True)


def test_default_budget_allows_verify(site):
    assert validate(site.url("/a.dduf"), verify=True).valid


# --- redirects --------------------------------------------------------------------------------------------


def test_redirect_to_another_port_or_host_is_refused(site):
    other = serve(Site(site.data))
    try:
        site.redirects["/redirect/port"] = other.url("/a.dduf")
        site.redirects["/redirect/host"] = site.url("/a.dduf", host="localhost")
        site.redirects["/redirect/scheme"] = f"https://127.0.0.1:{site.server_port}/a.dduf"
        for where in ("port", "host", "scheme"):
            with pytest.raises(DDUFIOError, match="another origin"):
                validate(site.url(f"/redirect/{where}"))
        assert other.requests == []  # nothing was sent there
    finally:
        other.shutdown()
        other.server_close()


def test_redirect_loop_is_bounded(site):
    site.redirects["/redirect/loop"] = "/redirect/loop"
    with pytest.raises(DDUFIOError, match="more than 5 redirects"):
        validate(site.url("/redirect/loop"))
    assert len(site.requests) <= 12


# --- errors that say what failed ------------------------------------------------------------------------


def test_404_says_404_and_is_a_file_not_found_error(site, capsys):
    with pytest.raises(DDUFNotFoundError, match="HTTP 404") as caught:
        validate(site.url("/missing.dduf"))
    assert isinstance(caught.value, FileNotFoundError)
    assert cli_main(["validate", site.url("/missing.dduf")]) == 2
    err = capsys.readouterr().err
    assert "HTTP 404" in err and "missing.dduf" in err


def test_server_ignoring_range_is_refused_without_downloading(site):
    with pytest.raises(DDUFIOError, match="does not support range requests"):
        validate(site.url("/norange"))


def test_encoded_range_is_refused(site):
    with pytest.raises(DDUFIOError, match="gzip-encoded"):
        open_source(site.url("/gzip"))


def test_connection_refused_and_dns_failure_are_named(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DDUFIOError, match=f"connection refused by 127.0.0.1:{port}"):
        validate(f"http://127.0.0.1:{port}/x.dduf")

    def no_dns(*args: object, **kwargs: object):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    with pytest.raises(DDUFIOError, match="cannot resolve host 'no-such-host.invalid'"):
        validate("https://no-such-host.invalid/model.dduf")


# --- schemes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", [
    "simplecache::http://127.0.0.1:{port}/a.dduf",
    "blockcache::http://127.0.0.1:{port}/a.dduf",
    "filecache::http://127.0.0.1:{port}/a.dduf",
    "http://127.0.0.1:{port}/a.dduf::zip://x",
    "local:///etc/passwd",
    "memory://a.dduf",
    "ftp://127.0.0.1:{port}/a.dduf",
    "zip://a.dduf",
    "data:text/plain,PK",
    "dduf://x.dduf",
])
def test_disallowed_schemes_are_refused_before_any_io(site, url, capsys):
    url = url.format(port=site.server_port)
    with pytest.raises(DDUFError) as caught:
        open_source(url)
    if "://" in url:
        assert isinstance(caught.value, DDUFUsageError)
        assert "not allowed" in str(caught.value)
    assert site.requests == []
    if "://" in url:
        assert cli_main(["validate", url]) == 2
        assert "not allowed" in capsys.readouterr().err
    assert site.requests == []


def test_file_url_stays_a_local_path(archive):
    assert validate(f"file://{archive}").valid


def test_http_takes_only_its_own_options(site):
    with pytest.raises(DDUFUsageError, match="client_kwargs"):
        open_source(site.url("/a.dduf"), client_kwargs={})
    source = open_source(site.url("/a.dduf"), headers={"X-Test": "1"}, timeout=5)
    assert isinstance(source, HTTPSource)
    source.close()


def test_tls_certificates_are_verified(site, tmp_path):
    """https:// goes through the same client with the system's CA store: a self-signed server is refused, and
    the error says it was the TLS handshake."""
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a self-signed certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    server = Site(site.data)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    serve(server)
    try:
        with pytest.raises(DDUFIOError, match=r"TLS handshake with 127\.0\.0\.1:\d+ failed: CERTIFICATE_VERIFY_FAILED"):
            validate(f"https://127.0.0.1:{server.server_port}/a.dduf")
        assert server.requests == []
    finally:
        server.shutdown()
        server.server_close()
