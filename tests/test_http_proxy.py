"""dduf_plus's own HTTP client honours what huggingface_hub users set: ``HTTPS_PROXY`` / ``HTTP_PROXY`` /
``ALL_PROXY`` and ``NO_PROXY``, and the CA bundle variables (``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE``,
``SSL_CERT_FILE``). Checked against a local proxy stub (CONNECT tunnels and absolute-form GETs, recording
what it was asked) in front of the tests' range server, over http and over https with a self-signed CA."""

from __future__ import annotations

import http.client
import http.server
import select
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from servers import FileServer

from dduf_plus.errors import DDUFError, DDUFUsageError
from dduf_plus.storage import http_conn
from dduf_plus.storage.http_range import HTTPSource
from dduf_plus.storage.hub_env import ca_bundle, proxy_for

PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY",
              "no_proxy", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR")
DATA = bytes(range(256)) * 4096  # 1 MiB: larger than one suffix read, so later reads are range requests


class ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ProxyStub

    def log_message(self, *args: Any) -> None:
        pass

    def do_CONNECT(self) -> None:  # noqa: N802 - http.server's naming
        self.server.seen.append(("CONNECT", self.path, self.headers.get("Proxy-Authorization")))
        host, _, port = self.path.rpartition(":")
        upstream = socket.create_connection((host, int(port)))
        self.send_response(200, "Connection established")
        self.end_headers()
        self.close_connection = True
        sockets = [self.connection, upstream]
        while True:
            ready, _, _ = select.select(sockets, [], [], 5)
            if not ready:
                break
            for sock in ready:
                data = sock.recv(1 << 16)
                if not data:
                    upstream.close()
                    return
                (upstream if sock is self.connection else self.connection).sendall(data)
        upstream.close()

    def do_GET(self) -> None:  # noqa: N802
        self.server.seen.append(("GET", self.path, self.headers.get("Proxy-Authorization")))
        parts = urlsplit(self.path)
        if not parts.hostname:  # origin-form: a client that thinks it talks to the server itself
            self.send_error(400)
            return
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80)
        conn.request("GET", parts.path, headers={k: v for k, v in self.headers.items()
                                                 if k.lower() not in ("proxy-authorization", "connection")})
        answer = conn.getresponse()
        body = answer.read()
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "server", "date"):
                self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)
        conn.close()


class ProxyStub(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), ProxyHandler)
        self.seen: list[tuple[str, str, str | None]] = []

    def __enter__(self) -> ProxyStub:
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    http_conn._TLS.clear()
    return monkeypatch


@pytest.fixture
def served(tmp_path: Path) -> Any:
    (tmp_path / "a.bin").write_bytes(DATA)
    with FileServer(tmp_path) as server:
        yield server


def test_http_goes_through_the_proxy_unless_no_proxy_names_the_host(clean_env, served) -> None:
    with ProxyStub() as proxy:
        clean_env.setenv("HTTP_PROXY", f"http://user:secret@127.0.0.1:{proxy.server_port}")
        source = HTTPSource(served.url("a.bin"))
        assert source.read_at(300_000, 1000) == DATA[300_000:301_000]
        source.close()
        assert proxy.seen and all(m == "GET" and p == served.url("a.bin") for m, p, _ in proxy.seen)
        assert {auth for *_, auth in proxy.seen} == {"Basic dXNlcjpzZWNyZXQ="}  # user:secret
        asked = len(proxy.seen)
        clean_env.setenv("NO_PROXY", "localhost,127.0.0.1")
        assert HTTPSource(served.url("a.bin")).read_at(0, 10) == DATA[:10]
        assert len(proxy.seen) == asked  # straight to the server


def test_a_proxy_dduf_plus_cannot_use_is_a_usage_error(clean_env, served) -> None:
    clean_env.setenv("HTTP_PROXY", "socks5://127.0.0.1:1080")
    with pytest.raises(DDUFUsageError, match="only http:// proxies"):
        HTTPSource(served.url("a.bin"))
    clean_env.setenv("ALL_PROXY", "http://127.0.0.1:9")
    clean_env.delenv("HTTP_PROXY")
    assert proxy_for("http", "example.org") is not None and proxy_for("https", "example.org") is not None


def _tls_files(folder: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


@pytest.mark.parametrize("variable", ["REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE"])
def test_https_tunnels_through_the_proxy_and_trusts_the_ca_bundle_set(clean_env, served, tmp_path, variable) -> None:
    cert, key = _tls_files(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    served.socket = context.wrap_socket(served.socket, server_side=True)
    url = served.url("a.bin").replace("http://", "https://")
    with ProxyStub() as proxy:
        clean_env.setenv("HTTPS_PROXY", f"127.0.0.1:{proxy.server_port}")  # no scheme: http, as requests reads it
        with pytest.raises(DDUFError, match="CERTIFICATE_VERIFY_FAILED"):  # the system's store: not trusted
            HTTPSource(url)
        clean_env.setenv(variable, str(cert))
        assert ca_bundle()[0] == str(cert)
        source = HTTPSource(url)
        assert source.read_at(500_000, 4096) == DATA[500_000:504_096]
        source.close()
        assert ("CONNECT", f"127.0.0.1:{served.server_port}", None) in proxy.seen
        assert all(m == "CONNECT" for m, *_ in proxy.seen)  # the requests themselves stay inside TLS


def test_an_empty_ca_variable_never_turns_verification_off(clean_env) -> None:
    """``CURL_CA_BUNDLE=""`` is how requests users switch verification off; here it is simply unset."""
    clean_env.setenv("CURL_CA_BUNDLE", "")
    assert ca_bundle() == (None, None)
    assert http_conn.tls_context().verify_mode == ssl.CERT_REQUIRED
