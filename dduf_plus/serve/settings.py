"""What a ``dduf serve`` deployment allows: URL prefixes, private addresses, sizes, time and concurrency.
Plain data (no web framework), so the CLI can build it before starlette is imported."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ENDPOINT = "https://huggingface.co/"


def _default_endpoint() -> str:
    endpoint = os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT  # huggingface_hub's variable
    return endpoint if endpoint.endswith("/") else endpoint + "/"


@dataclass(frozen=True)
class Settings:
    """Limits and policy of one app.

    Attributes:
        endpoint: the Hub the webhook reads from (``$HF_ENDPOINT``, else https://huggingface.co/).
        allow_url_prefixes: URLs to validate must start with one of these; empty: only ``endpoint``.
        allow_private: also fetch from loopback, private and link-local addresses (tests, an internal hub).
        max_upload: largest upload in bytes (413 past it).
        max_url_bytes: largest archive validated by URL (502 past it; reads stay within twice its size).
        workers: validations running at once (threads); queue: how many more may wait for one (503 past it).
            A validation slot is taken only once the request's body has arrived.
        time_limit: seconds one validation may take (504 past it; URL reads also stop at this deadline).
        uploads: request bodies being received at once (503 past it); uploads_per_client: of those, from one
            client address (429 past it).
        body_timeout: seconds a request body may take to arrive (408 past it).
        min_upload_rate: bytes/s a body must average once ``upload_grace`` seconds have passed (408 below it):
            a client trickling a few bytes holds its place for ``upload_grace`` seconds, not ``body_timeout``.
        max_form_fields: parts of a multipart form (400 past it; each text part at most 8 KiB).
        min_free_disk: bytes of disk to leave free in the temporary folder while spooling uploads (507).
        allowed_hosts: ``Host`` header names served besides ``localhost`` and IP literals (421 otherwise: no
            DNS rebinding against a local instance); ``"*"`` serves any.
        webhook_secret: the shared secret of ``POST /v1/webhook`` (None: the webhook is disabled, 404).
        reports_dir: where webhook reports are kept as JSON files (None: in memory only).
        temp_root: parent of the app's private temporary folder (None: the system's).
        token: a Hub token sent to ``endpoint`` only (private repos); never logged.
    """

    endpoint: str = field(default_factory=_default_endpoint)
    allow_url_prefixes: tuple[str, ...] = ()
    allow_private: bool = False
    max_upload: int = 4 << 30
    max_url_bytes: int = 64 << 30
    workers: int = 4
    queue: int = 64
    time_limit: float = 120.0
    uploads: int = 64
    uploads_per_client: int = 16
    body_timeout: float = 600.0
    min_upload_rate: int = 32 << 10
    upload_grace: float = 10.0
    max_form_fields: int = 16
    min_free_disk: int = 256 << 20
    allowed_hosts: tuple[str, ...] = ()
    webhook_secret: str | None = None
    reports_dir: Path | None = None
    temp_root: Path | None = None
    token: str | None = None

    @property
    def prefixes(self) -> tuple[str, ...]:
        """The URL prefixes in force (the hub endpoint when none were given)."""
        return self.allow_url_prefixes or (self.endpoint,)
