"""The settings huggingface_hub users already have in their environment, read the way huggingface_hub reads
them, in one place: offline mode, and the proxy and CA-bundle variables :mod:`.http_range`'s client honours.

Offline mode (:func:`is_offline`) is huggingface_hub's rule: ``HF_HUB_OFFLINE``, else ``TRANSFORMERS_OFFLINE``,
is one of ``1``/``ON``/``YES``/``TRUE`` (any case). huggingface_hub reads the variables once, when it is imported,
into ``constants.HF_HUB_OFFLINE``; here they are read on every call, so that setting one in a running process (a
notebook, a test) takes effect for dduf_plus, and when neither is set, huggingface_hub's constant decides (code
that turned huggingface_hub offline in-process turns dduf_plus offline too). huggingface_hub is not imported
for this (the storage floor starts fast)."""

from __future__ import annotations

import base64
import os
import sys
import urllib.request
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from ..errors import DDUFUsageError

TRUE_VALUES = frozenset({"1", "ON", "YES", "TRUE"})  # huggingface_hub.constants.ENV_VARS_TRUE_VALUES


def env_true(value: str | None) -> bool:
    """huggingface_hub's ``_is_true``: ``1``, ``on``, ``yes``, ``true`` in any case."""
    return value is not None and value.upper() in TRUE_VALUES


def is_offline(local_files_only: bool = False) -> bool:
    """Whether nothing may be fetched from the Hub or a URL: ``local_files_only``, or offline mode (module doc).

        >>> is_offline(local_files_only=True)
        True
    """
    if local_files_only:
        return True
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if value:
        return env_true(value)
    constants = sys.modules.get("huggingface_hub.constants")
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


# --- proxies and CA bundles, for dduf_plus's own HTTP client (storage/http_range.py) -------------------------
CA_BUNDLE_VARS = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE")  # first set wins, as in requests


class Proxy(NamedTuple):
    """A forward proxy: where to connect, and the ``Proxy-Authorization`` header its URL's credentials make."""

    url: str  # for messages, without the credentials
    host: str
    port: int
    headers: dict[str, str]


def proxy_for(scheme: str, host: str) -> Proxy | None:
    """The proxy a request to ``scheme://host`` goes through, as huggingface_hub's HTTP client picks it (its
    ``trust_env``): ``HTTPS_PROXY`` / ``HTTP_PROXY`` by scheme, else ``ALL_PROXY`` (lower-case names too), unless
    ``NO_PROXY`` names the host (a suffix, an address, ``*``). None for a direct connection.

    Raises:
        DDUFUsageError: the variable is no ``http://host[:port]`` URL (a TLS or SOCKS proxy is not supported).
    """
    proxies = urllib.request.getproxies_environment()
    url = proxies.get(scheme.lower()) or proxies.get("all")
    # proxy_bypass_environment: the stdlib's NO_PROXY matching (undocumented, in every Python 3; not in typeshed)
    if not url or urllib.request.proxy_bypass_environment(host, proxies):  # type: ignore[attr-defined]
        return None
    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = parts.port or 80
    except ValueError:
        port = -1
    if parts.scheme.lower() != "http" or not parts.hostname or port < 0:
        raise DDUFUsageError(f"proxy {parts.scheme}://{parts.hostname}:{parts.port if port >= 0 else '?'} (from the "
                             f"{scheme.upper()}_PROXY / ALL_PROXY environment): only http:// proxies are supported")
    headers = {}
    if parts.username is not None:
        user = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        headers["Proxy-Authorization"] = "Basic " + base64.b64encode(user.encode()).decode("ascii")
    return Proxy(f"http://{parts.hostname}:{port}", parts.hostname, port, headers)


def ca_bundle() -> tuple[str | None, str | None]:
    """(CA file, CA folder) to verify servers with: ``REQUESTS_CA_BUNDLE``, else ``CURL_CA_BUNDLE``, else
    ``SSL_CERT_FILE`` (what requests- and httpx-based huggingface_hub users set behind a TLS-inspecting proxy),
    and ``SSL_CERT_DIR``; (None, None): the system's store. An empty value is unset: verification is never
    turned off (``CURL_CA_BUNDLE=""`` disables it in requests; here it means the system's store)."""
    cafile = next((value for name in CA_BUNDLE_VARS if (value := os.environ.get(name, "").strip())), None)
    return cafile, os.environ.get("SSL_CERT_DIR", "").strip() or None
