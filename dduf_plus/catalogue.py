"""Catalogue-scale validation: :func:`validate_many` checks many archives (local paths or URLs) on any
:class:`concurrent.futures.Executor`: threads (the default), processes, a Dask cluster
(``distributed.Client(...).get_executor()``) or Ray.

Every source gives one result dict, whatever happens to it::

    {"source": "https://host/a.dduf", "valid": False,
     "report": {...},      # exactly one entry of `dduf validate --json`'s "files" list
     "error": None}        # why the source could not be read (missing file, unreachable URL...), else None

A source that cannot be read (a :class:`~dduf_plus.errors.DDUFError`), a worker that dies or a result that
cannot be sent back becomes such a result with ``error`` set; nothing a source does stops the batch. The
per-source work is :func:`validate_one`, a top-level function with picklable arguments and result, so process
pools and Dask workers can run it. Sources are submitted through a bounded window (a few per worker), so a
catalogue of millions of URLs read from a file or stdin never sits in memory as futures."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from typing import Any

log = logging.getLogger("dduf_plus.catalogue")

DEFAULT_MAX_WORKERS = 32  # catalogue checks wait on the network: threads, many more than cores
WINDOW_PER_WORKER = 4  # futures in flight per worker: enough to keep workers busy, bounded memory

Result = dict[str, Any]


def unreadable_report(path: str, message: str) -> dict[str, Any]:
    """The ``dduf validate --json`` entry for a source that could not be read (exit status 2)."""
    return {"path": path, "valid": False, "errors": [], "warnings": [], "io_error": message}


def _result(source: str, report: dict[str, Any], error: str | None) -> Result:
    return {"source": source, "valid": bool(report["valid"]) and error is None, "report": report, "error": error}


def validate_one(source: str | os.PathLike, verify: bool = False, strict: bool = False,
                 max_decompressed: Any = None, timeout: float | None = None,
                 storage_options: dict[str, Any] | None = None) -> Result:
    """Validate one archive and return its result dict (see the module docstring); never raises for a
    source. ``timeout`` is the deadline of a remote source in seconds (``deadline=`` of
    :func:`~dduf_plus.storage.source.open_source`); local files are bounded by the validator's own budgets."""
    from .errors import DDUFError
    from .format.validate import validate

    name = os.fspath(source)
    options = dict(storage_options or {})
    if timeout is not None and _is_url(name):
        options.setdefault("deadline", timeout)
    try:
        report = validate(name, verify=verify, strict=strict, max_decompressed=max_decompressed, **options)
    except DDUFError as e:
        return _result(name, unreadable_report(name, str(e)), str(e))
    except Exception as e:  # noqa: BLE001 - validate() catches its own bugs; this is a last line
        message = f"internal error: {type(e).__name__}: {e}"
        return _result(name, unreadable_report(name, message), message)
    return _result(name, report.as_dict(), None)


def _is_url(name: str) -> bool:
    from .storage.urls import is_url

    return bool(is_url(name))


def validate_many(sources: Iterable[str | os.PathLike], *, executor: Executor | None = None,
                  verify: bool = False, strict: bool = False, max_workers: int | None = None,
                  timeout: float | None = None, max_decompressed: Any = None, ordered: bool = True,
                  **storage_options: Any) -> Iterator[Result]:
    """Validate every source on ``executor`` and yield one result dict per source.

    Args:
        sources: local paths and URLs (any iterable; read lazily, so a generator over stdin works).
        executor: any ``concurrent.futures.Executor`` (processes, ``distributed.Client().get_executor()``,
            Ray's); it is not shut down here. None: a thread pool of ``max_workers`` threads, closed at the end.
        verify, strict, max_decompressed: as for :func:`dduf_plus.validate`.
        max_workers: threads of the default pool (default 32) and the in-flight window with any executor.
        timeout: per-source deadline in seconds for remote sources (default ``DDUF_REMOTE_DEADLINE``).
        ordered: yield in the order of ``sources`` (default); False yields each result as it finishes.
        storage_options: passed to fsspec / the http client for URLs.

    Returns:
        An iterator of result dicts; ``list(validate_many(...))`` for all of them.

    Example:
        >>> from concurrent.futures import ProcessPoolExecutor
        >>> with ProcessPoolExecutor(2) as pool:
        ...     bad = [r["source"] for r in validate_many(paths, executor=pool) if not r["valid"]]
    """
    from .errors import DDUFUsageError

    workers = DEFAULT_MAX_WORKERS if max_workers is None else max_workers
    if workers < 1:  # checked now, not on the first next(): validate_many is not itself a generator
        raise DDUFUsageError(f"max_workers must be at least 1, not {workers}")
    if isinstance(sources, (str, bytes, os.PathLike)):  # iterating it would validate one character at a time
        raise DDUFUsageError(f"validate_many takes a list of sources, not one ({sources!r}): validate_many([...])")
    args = (verify, strict, max_decompressed, timeout, storage_options or None)
    return _batch(executor, sources, args, workers, ordered)


def _batch(executor: Executor | None, sources: Iterable[str | os.PathLike], args: tuple[Any, ...], workers: int,
           ordered: bool) -> Iterator[Result]:
    own = executor is None
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dduf-validate") if own else executor
    assert pool is not None
    finished = False
    try:
        yield from _run(pool, sources, args, workers * WINDOW_PER_WORKER, ordered)
        finished = True
    finally:
        if own:  # Ctrl-C or a consumer that stops early: cancel the queue, do not wait for running checks here
            pool.shutdown(wait=finished, cancel_futures=True)


def _run(pool: Executor, sources: Iterable[str | os.PathLike], args: tuple[Any, ...], window: int,
         ordered: bool) -> Iterator[Result]:
    """Keep at most ``window`` sources in flight; yield results in order or as they finish."""
    pending: deque[tuple[str, Any]] = deque()  # (source, its future, or its result when submit failed)
    it = iter(sources)
    exhausted = False
    try:
        while pending or not exhausted:
            while not exhausted and len(pending) < window:
                source = next(it, None)
                if source is None:
                    exhausted = True
                    break
                name = os.fspath(source)
                pending.append((name, _submit(pool, name, args)))
            if not pending:
                break
            if ordered:
                yield _collect(*pending.popleft())
                continue
            done = [p for p in pending if _done(p[1])]
            while not done:
                _wait_any([f for _, f in pending])
                done = [p for p in pending if _done(p[1])]
            for p in done:
                pending.remove(p)
                yield _collect(*p)
    finally:  # a consumer that stopped early: what has not started yet never will
        for _, item in pending:
            if not isinstance(item, dict):
                item.cancel()


def _done(item: Any) -> bool:
    return isinstance(item, dict) or bool(item.done())


def _wait_any(futures: list[Any]) -> None:
    """Block until one future is done: concurrent.futures' own wait where it can, else a short poll (an
    executor whose futures are not ``concurrent.futures.Future``)."""
    if all(isinstance(f, Future) for f in futures):
        wait(futures, return_when=FIRST_COMPLETED)
    else:
        time.sleep(0.005)


def _submit(pool: Executor, name: str, args: tuple[Any, ...]) -> Any:
    try:
        return pool.submit(validate_one, name, *args)
    except Exception as e:  # noqa: BLE001 - a shut-down or broken pool: a result for this source, not a crash
        return _failed(name, e)


def _collect(name: str, item: Any) -> Result:
    if isinstance(item, dict):
        return item
    try:
        result = item.result()
    except Exception as e:  # noqa: BLE001 - a worker that died, a result that could not be sent back
        return _failed(name, e)
    if not isinstance(result, dict) or result.get("source") != name:  # an executor that mixed results up
        return _failed(name, RuntimeError(f"the executor returned {type(result).__name__} for {name}"))
    return result


def _failed(name: str, error: BaseException) -> Result:
    message = f"executor error: {type(error).__name__}: {error}"
    log.warning("%s: %s", name, message)
    return _result(name, unreadable_report(name, message), message)
