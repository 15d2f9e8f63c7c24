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
        time_limit: seconds one validation may take (504 past it; URL reads also stop at this deadline).
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
    webhook_secret: str | None = None
    reports_dir: Path | None = None
    temp_root: Path | None = None
    token: str | None = None

    @property
    def prefixes(self) -> tuple[str, ...]:
        """The URL prefixes in force (the hub endpoint when none were given)."""
        return self.allow_url_prefixes or (self.endpoint,)
