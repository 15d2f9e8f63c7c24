"""The budgets every remote source answers to (:mod:`.http_range`, :mod:`.source`'s fsspec sources, the
remote fetch): an overall deadline (``deadline=``, ``DDUF_REMOTE_DEADLINE``), a byte budget (``max_bytes=``,
``DDUF_REMOTE_MAX_BYTES``, default twice the file plus slack) and the per-read timeout huggingface_hub users
set (``HF_HUB_DOWNLOAD_TIMEOUT``)."""

from __future__ import annotations

import os
import threading
import time

from ..errors import DDUFIOError, DDUFUsageError

DEFAULT_DEADLINE_S = 300.0
BUDGET_SLACK_BYTES = 16 << 20
DEFAULT_READ_TIMEOUT_S = 10.0


def env_number(name: str, default: float | None) -> float | None:
    """A positive number from the environment variable ``name`` (``default`` when unset)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise DDUFUsageError(f"{name}={text!r} is not a number") from None
    if value <= 0:
        raise DDUFUsageError(f"{name}={text!r} must be positive")
    return value


def read_timeout() -> float:
    """huggingface_hub's download timeout (``HF_HUB_DOWNLOAD_TIMEOUT``) for connecting and for each read."""
    try:
        value = float(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT", DEFAULT_READ_TIMEOUT_S))
    except ValueError:
        return DEFAULT_READ_TIMEOUT_S
    return value if value > 0 else DEFAULT_READ_TIMEOUT_S


class RemoteBudget:
    """The deadline and byte budget of one remote source; every request asks it first."""

    def __init__(self, name: str, deadline: float | None, max_bytes: int | None):
        self.name = name
        self.deadline_s = float(deadline) if deadline is not None else env_number("DDUF_REMOTE_DEADLINE",
                                                                                   DEFAULT_DEADLINE_S)
        env_bytes = env_number("DDUF_REMOTE_MAX_BYTES", None)
        self.fixed_max_bytes = int(max_bytes) if max_bytes is not None else (int(env_bytes) if env_bytes else None)
        if self.deadline_s is None or self.deadline_s <= 0:
            raise DDUFUsageError(f"{name}: the deadline must be a positive number of seconds")
        if self.fixed_max_bytes is not None and self.fixed_max_bytes <= 0:
            raise DDUFUsageError(f"{name}: the byte budget must be positive")
        self.ends_at = time.monotonic() + self.deadline_s
        self.max_bytes = self.fixed_max_bytes  # None until the size is known
        self.fetched = 0
        self._lock = threading.Lock()  # several connections may share one budget (remote.fetch)

    def sized(self, size: int) -> None:
        if self.fixed_max_bytes is None:
            self.max_bytes = 2 * size + BUDGET_SLACK_BYTES

    def affords(self, length: int) -> bool:
        """Whether ``length`` more bytes fit the byte budget."""
        with self._lock:
            return self.max_bytes is None or self.fetched + length <= self.max_bytes

    def remaining(self) -> float:
        left = self.ends_at - time.monotonic()
        if left <= 0:
            raise self.expired()
        return left

    def expired(self) -> DDUFIOError:
        return DDUFIOError(f"{self.name}: took longer than its deadline of {self.deadline_s:g} s "
                           "(deadline=, DDUF_REMOTE_DEADLINE)")

    def settle(self, reserved: int, received: int) -> None:
        """A request that reserved ``reserved`` bytes (:meth:`spend`) received ``received`` from the socket
        (headers included): the budget counts what was received."""
        with self._lock:
            self.fetched += received - reserved

    def spend(self, length: int) -> None:
        """Refuse, before it is requested, a read that would go over the byte budget."""
        with self._lock:
            if self.max_bytes is not None and self.fetched + length > self.max_bytes:
                raise DDUFIOError(f"{self.name}: reading {length} more bytes would exceed the byte budget of "
                                  f"{self.max_bytes} bytes ({self.fetched} fetched; max_bytes=, "
                                  "DDUF_REMOTE_MAX_BYTES)")
            self.fetched += length
