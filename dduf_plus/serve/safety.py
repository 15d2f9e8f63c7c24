"""No SSRF through the validator: which URLs ``dduf serve`` fetches, and from which addresses.

A URL is fetched only when it starts with an allowed prefix (same scheme, host and port as the prefix: a
prefix without its trailing slash cannot be stretched to ``huggingface.co.evil.example``) and every address
its host resolves to is public. The address actually connected to is checked again on every connection
(:class:`PeerCheckedSource`), so a DNS answer that changes between the check and the connection (rebinding)
is refused too. Redirects are followed by the format layer's client within the same origin only.

A URL that cannot be parsed (a port that is not a number from 1 to 65535, a broken IPv6 literal, a host name
that is not valid IDNA) is a :class:`BadURL` (HTTP 400), never an exception of urllib. IPv6 literal hosts
(``http://[2001:db8::1]/x.dduf``) are URLs like any other: allowed under a prefix, public addresses only.

:func:`host_allowed` is the other direction: which ``Host`` headers the service answers (DNS rebinding)."""

from __future__ import annotations

import http.client
import ipaddress
import json
import logging
import re
import socket
from typing import Any
from urllib.parse import urlsplit

from ..errors import DDUFIOError, DDUFUsageError
from ..storage.http_range import HTTPSource, get_document, proxied
from ..storage.urls import address_problem  # noqa: F401 (address_problem re-exported)
from .settings import Settings

logger = logging.getLogger(__name__)
MAX_API_JSON = 8 << 20


class URLRefused(DDUFUsageError):
    """The URL is outside the allowed prefixes or points at a non-public address (HTTP 403)."""


class BadURL(DDUFUsageError):
    """The URL cannot be parsed: its port, its IPv6 literal, its host name (HTTP 400)."""


def url_origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of ``url``; :class:`BadURL` when urllib cannot read its port or host."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:  # "Port out of range 0-65535", "Port could not be cast to integer", "Invalid IPv6 URL"
        hint = "; a port is a number from 1 to 65535" if "Port" in str(e) else ""
        raise BadURL(f"{url[:200]}: not a valid URL ({e}){hint}") from None
    if port == 0:
        raise BadURL(f"{url[:200]}: port 0 is not a port to connect to")
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), port or (443 if scheme == "https" else 80)


_PORT = re.compile(r":[0-9]{1,5}")


def host_allowed(host: str, settings: Settings) -> bool:
    """Whether the service answers a request whose ``Host`` header is ``host``: ``localhost``, an IP literal
    (a page cannot rebind a literal: its origin is the service's own), a name in ``settings.allowed_hosts``
    (the proxy's public name), or anything when that holds ``"*"``. Ports are not compared."""
    if "*" in settings.allowed_hosts:
        return True
    name = host.strip().lower()
    if name.startswith("["):
        name, closed, port = name[1:].partition("]")
        if not closed or (port and not _PORT.fullmatch(port)):
            return False
    elif name.count(":") == 1:
        name, _, port = name.partition(":")
        if not _PORT.fullmatch(":" + port):
            return False
    name = name.rstrip(".")
    if name == "localhost" or name in {h.strip().lower().rstrip(".") for h in settings.allowed_hosts}:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def check_url(url: str, settings: Settings, *, hub: bool = False) -> str:
    """``url`` if ``settings`` allow fetching it, else :class:`URLRefused` (before any request is sent).
    ``hub``: the server's own read of its configured endpoint (the webhook), allowed whatever the prefixes."""
    if not isinstance(url, str) or len(url) > 4096:
        raise URLRefused("the URL must be a string of at most 4096 characters")
    if any(ord(c) < 0x21 or c == "\x7f" for c in url):
        raise BadURL(f"{url[:200]!r}: a URL has no spaces or control characters")
    origin = url_origin(url)
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise URLRefused(f"{url}: only http(s) URLs with a host are validated here")
    if parts.username or parts.password:
        raise URLRefused(f"{url}: credentials in the URL are not accepted")
    prefixes = (*settings.prefixes, settings.endpoint) if hub else settings.prefixes
    if not any(url.startswith(p) and origin == url_origin(p) for p in prefixes):
        raise URLRefused(f"{url}: not under an allowed prefix ({', '.join(settings.prefixes)})")
    if not settings.allow_private:
        scheme, host, port = origin
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise DDUFIOError(f"{url}: cannot resolve host {host!r} (DNS: {e.strerror})") from None
        except (UnicodeError, ValueError) as e:  # a label over 63 characters, not IDNA
            raise BadURL(f"{url[:200]}: {host[:100]!r} is not a valid host name ({e})") from None
        for info in infos:
            why = address_problem(str(info[4][0]))
            if why:
                raise URLRefused(f"{url}: {host} resolves to {why}; refused (--allow-private allows it)")
    return url


def _check_peer(conn: http.client.HTTPConnection, url: str, settings: Settings) -> None:
    """Refuse a connection whose peer is no public address. Through a proxy (HTTPS_PROXY, the operator's
    egress) the peer is the proxy: the name check before connecting (:func:`check_url`) is what applies."""
    if settings.allow_private or conn.sock is None or proxied(conn):
        return
    why = address_problem(str(conn.sock.getpeername()[0]))
    if why:
        conn.close()
        raise URLRefused(f"{url}: connected to {why}; refused")


class PeerCheckedSource(HTTPSource):
    """The format layer's range client, refusing a connection whose peer is not a public address."""

    def __init__(self, url: str, settings: Settings, **options: Any):
        self._settings = settings
        super().__init__(url, **options)

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        conn, reused = super()._connection()
        if not reused:
            _check_peer(conn, self.name, self._settings)
        return conn, reused


def auth_headers(url: str, settings: Settings) -> dict[str, str]:
    """The Hub token, for URLs on the configured endpoint only (never sent to another host)."""
    if settings.token and url_origin(url) == url_origin(settings.endpoint):
        return {"Authorization": f"Bearer {settings.token}"}
    return {}


def fetch_json(url: str, settings: Settings, timeout: float = 10.0) -> Any:
    """GET a small JSON document (the Hub API) under the same policy: no redirects, at most MAX_API_JSON bytes,
    every byte received counted and the whole read within the time limit (a trickling or overrunning hub is
    cut off: :func:`~dduf_plus.storage.http_range.get_document`)."""
    check_url(url, settings, hub=True)
    status, body = get_document(url, max_bytes=MAX_API_JSON, deadline=settings.time_limit, timeout=timeout,
                                headers={"Accept": "application/json", **auth_headers(url, settings)},
                                check=lambda conn: _check_peer(conn, url, settings))
    if status != 200:
        raise DDUFIOError(f"{url}: HTTP {status}")
    try:
        return json.loads(body)
    except ValueError as e:
        raise DDUFIOError(f"{url}: not JSON ({e})") from None
