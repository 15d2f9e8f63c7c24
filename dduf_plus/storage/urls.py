"""Which URLs may be read at all, and which hosts an archive may make us connect to. Refusals here happen
before any I/O."""

from __future__ import annotations

import os
import re
import socket
from urllib.parse import urlsplit

from ..errors import DDUFUsageError

ALLOWED_URL_SCHEMES = ("https", "http", "hf", "s3", "gs", "gcs", "az", "abfs", "abfss")
# the bracketed IPv6 literal host of a URL (RFC 3986 IP-literal, with an optional zone id): only at the
# start of the authority, after a plain scheme and optional user info, so a chain cannot hide in it
_IPV6_HOST = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://(?:[^/?#@\[\]]*@)?)\[[0-9A-Fa-f:.]+(?:%25[\w.~-]+)?\]")


def is_url(source: str | os.PathLike) -> bool:
    """Whether ``source`` is a URL (``file://`` is a local path). Allowed or not: see :func:`check_url`."""
    return isinstance(source, str) and "://" in source and not source.startswith("file://")


def check_url(url: str) -> str:
    """The scheme of ``url``, lower-cased, or :class:`DDUFUsageError` when it is not allowed (before any I/O).

    Refused: fsspec chains (``::``, e.g. ``simplecache::https://...``, which downloads whole files), and
    every scheme outside :data:`ALLOWED_URL_SCHEMES` (``local://`` and ``memory://`` among them). A bracketed
    IPv6 literal host (``http://[::1]:8000/x.dduf``) is not a chain: its ``::`` is ignored, nothing else's."""
    try:
        port = urlsplit(url).port  # urllib raises only when asked: a bad port must be a usage error, not a crash
    except ValueError as e:  # "Port out of range 0-65535", "Port could not be cast to integer", "Invalid IPv6 URL"
        raise DDUFUsageError(f"{url}: not a valid URL ({e})") from None
    if port == 0:
        raise DDUFUsageError(f"{url}: port 0 is not a port to connect to")
    if "::" in _IPV6_HOST.sub(r"\1[v6]", url, count=1):
        raise DDUFUsageError(f"{url}: chained fsspec URLs ('::') are not allowed; give the URL itself")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ALLOWED_URL_SCHEMES:
        raise DDUFUsageError(f"{url}: URL scheme {scheme!r} is not allowed (allowed: {', '.join(ALLOWED_URL_SCHEMES)}; "
                             "a local file is a plain path or file://PATH)")
    return scheme


def address_problem(address: str) -> str | None:
    """Why a connection to ``address`` is refused (loopback, private, link-local...), or None if public."""
    import ipaddress

    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for kind in ("loopback", "private", "link_local", "multicast", "reserved", "unspecified"):
        if getattr(ip, f"is_{kind}"):
            return f"{ip} is a {kind.replace('_', '-')} address"
    if not ip.is_global:
        return f"{ip} is not a public address"
    return None


def host_problem(url: str) -> str | None:
    """Why ``url``'s host is not a public one (it resolves to a loopback/private/link-local... address, or
    does not resolve), or None. Used where a URL comes from an archive rather than from the user."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        infos = socket.getaddrinfo(host, parts.port or (443 if parts.scheme == "https" else 80),
                                   type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return f"{host!r} does not resolve ({e})"
    for info in infos:
        why = address_problem(str(info[4][0]))
        if why:
            return f"{host} resolves to {why}"
    return None
