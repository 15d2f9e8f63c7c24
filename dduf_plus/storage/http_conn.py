"""Connections for our own http(s) client (:mod:`.http_range`): TLS with the CA bundle huggingface_hub users
set (else the system's store; certificates always verified), through the proxy the environment names
(``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY``: :mod:`.hub_env`), and shut down under a read
that outlives its deadline."""

from __future__ import annotations

import http.client
import socket
import ssl
import weakref
from urllib.parse import SplitResult

from ..errors import DDUFUsageError
from .hub_env import Proxy, ca_bundle, proxy_for


def origin(parts: SplitResult) -> tuple[str, str, int]:
    """(scheme, host, port) of a split URL: redirects stay within it."""
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or (443 if scheme == "https" else 80)


def shut_down(conn: http.client.HTTPConnection) -> None:
    """Shut the connection's socket down under whatever read is blocked on it (a deadline passed)."""
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


_TLS: dict[tuple[str | None, str | None], ssl.SSLContext] = {}
_PROXIED: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()


def tls_context() -> ssl.SSLContext:
    """The CA bundle huggingface_hub users set (``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE``, ``SSL_CERT_FILE``,
    ``SSL_CERT_DIR``: :func:`~.hub_env.ca_bundle`), else the system's store, built once per setting; certificates
    are always verified."""
    where = ca_bundle()
    if where not in _TLS:
        try:
            _TLS[where] = ssl.create_default_context(cafile=where[0], capath=where[1])
        except (OSError, ssl.SSLError) as e:
            raise DDUFUsageError(f"cannot read the CA bundle {where[0] or where[1]} (REQUESTS_CA_BUNDLE, "
                                 f"CURL_CA_BUNDLE, SSL_CERT_FILE or SSL_CERT_DIR): {e}") from None
    return _TLS[where]


class _ViaProxy(http.client.HTTPConnection):
    """Plain http through a forward proxy: absolute-form request targets, the proxy's credentials on each."""

    def __init__(self, proxy: Proxy, origin: str, timeout: float):
        super().__init__(proxy.host, proxy.port, timeout=timeout)
        self.origin, self.proxy_headers = origin, proxy.headers

    def putrequest(self, method: str, url: str, skip_host: bool = False, skip_accept_encoding: bool = False) -> None:
        super().putrequest(method, self.origin + url if url.startswith("/") else url, skip_host, skip_accept_encoding)
        for name, value in self.proxy_headers.items():
            self.putheader(name, value)


def open_connection(scheme: str, host: str, port: int, timeout: float) -> http.client.HTTPConnection:
    """A connection to ``scheme://host:port`` (not yet connected), through the proxy the environment names
    (:func:`~.hub_env.proxy_for`: ``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY``): https by a
    ``CONNECT`` tunnel (TLS and its certificate check stay end to end), http by absolute-form requests."""
    proxy = proxy_for(scheme, host)
    if proxy is None:
        if scheme == "https":
            return http.client.HTTPSConnection(host, port, timeout=timeout, context=tls_context())
        return http.client.HTTPConnection(host, port, timeout=timeout)
    conn: http.client.HTTPConnection
    if scheme == "https":
        conn = http.client.HTTPSConnection(proxy.host, proxy.port, timeout=timeout, context=tls_context())
        conn.set_tunnel(host, port, headers=proxy.headers)
    else:
        conn = _ViaProxy(proxy, f"http://{host}:{port}", timeout)
    _PROXIED.add(conn)
    return conn


def proxied(conn: http.client.HTTPConnection) -> bool:
    """Whether ``conn`` goes through a proxy (then its peer address is the proxy's, not the server's)."""
    return conn in _PROXIED
