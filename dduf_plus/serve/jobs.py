"""The work behind every endpoint, free of any web framework: one report per archive (the ``dduf validate
--json`` record, plus ``dduf info --json`` for a valid archive), run on a bounded thread pool.

Concurrency: ``workers`` threads validate; at most ``workers + queue`` requests hold a slot (uploading,
waiting or validating); one more is refused at once (:class:`Busy`, HTTP 503 with Retry-After). A slot is
given back when its validation *thread* ends, not when the request gives up on it: a request over its time
limit gets 504, but the thread it started still counts until it finishes, so timeouts cannot pile up work."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ..errors import DDUFIOError
from ..format.archive import DDUFArchive
from ..format.describe import describe, describe_archive
from ..format.validate import validate
from .safety import PeerCheckedSource, auth_headers, check_url
from .settings import Settings

T = TypeVar("T")


class Busy(Exception):
    """Every slot is taken (HTTP 503)."""


class TimedOut(Exception):
    """The validation ran past the time limit (HTTP 504)."""


class Slot:
    """One admission; released once, when the request ends without work or when its work ends."""

    def __init__(self, semaphore: threading.Semaphore):
        self._semaphore, self._released, self._handed = semaphore, False, False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._semaphore.release()

    def hand_to(self, future: Future) -> None:
        self._handed = True
        future.add_done_callback(lambda _f: self.release())

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._handed:
            self.release()


class Validator:
    """The thread pool and its admission control."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._pool = ThreadPoolExecutor(max_workers=settings.workers, thread_name_prefix="dduf-serve")
        self._slots = threading.Semaphore(settings.workers + settings.queue)

    def slot(self) -> Slot:
        if not self._slots.acquire(blocking=False):
            raise Busy(f"{self.settings.workers} validations running and {self.settings.queue} waiting")
        return Slot(self._slots)

    async def run(self, slot: Slot, work: Callable[..., T], *args: Any, cleanup: Callable[[], None] | None = None) -> T:
        """``work(*args)`` on the pool; ``cleanup`` runs on the worker thread after it, whatever happens."""
        def job() -> T:
            try:
                return work(*args)
            finally:
                if cleanup is not None:
                    cleanup()

        future = self._pool.submit(job)
        slot.hand_to(future)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.settings.time_limit)
        except asyncio.TimeoutError:
            raise TimedOut(f"validation took longer than {self.settings.time_limit:g} s") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _renamed(value: Any, old: str, new: str) -> Any:
    """``value`` with every string's ``old`` (a private temporary path) replaced by ``new`` (the upload's name)."""
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, dict):
        return {_renamed(k, old, new): _renamed(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed(v, old, new) for v in value]
    return value


def check_file(path: str, name: str, verify: bool, strict: bool) -> dict[str, Any]:
    """The response for a local (uploaded) file: ``{"files": [report], "info": ...}``, named ``name``."""
    report = validate(path, verify=verify, strict=strict).as_dict()
    info = describe(path) if report["valid"] else None
    return _renamed({"files": [report], "info": info}, path, name)


def check_url_source(url: str, verify: bool, strict: bool, settings: Settings, use_token: bool) -> dict[str, Any]:
    """The response for a URL: range reads over one connection, within the time and byte limits.
    ``use_token``: the webhook's own read of the configured hub (its token sent, its endpoint allowed)."""
    check_url(url, settings, hub=use_token)
    # byte budget: the format layer's default (twice the size plus slack); the size itself is capped here
    source = PeerCheckedSource(url, settings, deadline=settings.time_limit,
                               headers=auth_headers(url, settings) if use_token else {})
    try:
        if source.size > settings.max_url_bytes:
            raise DDUFIOError(f"{url}: {source.size} bytes is over the limit of {settings.max_url_bytes} for a URL")
        report = validate(source, verify=verify, strict=strict).as_dict()
        info = None
        if report["valid"]:
            with DDUFArchive(source) as archive:
                info = describe_archive(archive)
    finally:
        source.close()
    return {"files": [report], "info": info}


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
