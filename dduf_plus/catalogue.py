"""Catalogue-scale validation: :func:`validate_many` checks many archives (local paths or URLs) on any
:class:`concurrent.futures.Executor`: threads (the default), processes, a Dask cluster
(``distributed.Client(...).get_executor()``) or Ray. It yields what :func:`validate` returns, a
:class:`~dduf_plus.format.validate.ValidationReport` per source, whatever happens to it; ``report.as_dict()`` is
exactly one entry of ``dduf validate --json``'s ``"files"`` list::

    {"path": "https://host/a.dduf", "valid": False, "errors": [...], "warnings": [...], "infos": [...]}

A source that cannot be read (a :class:`~dduf_plus.errors.DDUFError`), a worker that dies or a result that
cannot be sent back becomes a report with ``io_error`` set (``valid`` False, no findings); nothing a source does
stops the batch. The per-source work is :func:`validate_one`, a top-level function with picklable arguments and
result, so process pools and Dask workers can run it. Sources are submitted through a bounded window (a few per
worker), so a catalogue of millions of URLs read from a file or stdin never sits in memory as futures.

:func:`validate` (``dduf_plus.validate``) is the format floor's validator plus, when asked
(``load_check=True``), the load check of :mod:`dduf_plus.loading.load_check`, which imports torch: it lives
here, on the top floor, so that ``dduf_plus.format`` never imports it."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from .errors import bounded_repr, path_argument

log = logging.getLogger("dduf_plus.catalogue")

DEFAULT_MAX_WORKERS = 32  # catalogue checks wait on the network: threads, many more than cores
WINDOW_PER_WORKER = 4  # futures in flight per worker: enough to keep workers busy, bounded memory

if TYPE_CHECKING:  # pragma: no cover
    from .format.validate import ValidationReport
    from .storage.source import ByteSource


def validate(source: str | os.PathLike | ByteSource, verify: bool = False, strict: bool = False, *,
             load_check: bool = False, max_decompressed: Any = None, **storage_options: Any) -> ValidationReport:
    """Check an archive against every DDUF and dduf_plus rule: :func:`dduf_plus.format.validate.validate`
    (its arguments, its report, its ``Raises``), plus the load check when ``load_check`` is True.

    Args:
        load_check: also build every stored model component on the meta device and match its state-dict
            table (names, shapes, dtype kinds) to the stored tensors' headers, reading no weight: L001-L004
            errors, L005 infos (:mod:`dduf_plus.loading.load_check`). Imports torch and the components'
            libraries (seconds the first time); the rest of validation never does.

    Example:
        >>> report = validate("model.dduf", load_check=True)
        >>> report.valid, report.codes
        (True, [])
    """
    from .format.validate import ArchiveCheck
    from .format.validate import validate as validate_archive

    if not isinstance(source, (str, os.PathLike)) and not hasattr(source, "read_at"):  # a ByteSource has it
        source = path_argument(source, "validate(source=...)")

    checks: tuple[ArchiveCheck, ...] = ()
    if load_check:
        from .loading.load_check import load_check_findings

        checks = (load_check_findings,)
    return validate_archive(source, verify, strict, max_decompressed=max_decompressed, checks=checks,
                            **storage_options)


def unreadable_report(path: str, message: str) -> dict[str, Any]:
    """The ``dduf validate --json`` entry for a source that could not be read (exit status 2)."""
    from .format.validate import unreadable

    return unreadable(path, message).as_dict()


def validate_one(source: str | os.PathLike, verify: bool = False, strict: bool = False,
                 max_decompressed: Any = None, timeout: float | None = None,
                 storage_options: dict[str, Any] | None = None, load_check: bool = False) -> ValidationReport:
    """Validate one archive and return its report (see the module docstring); never raises for a source: one
    that cannot be read gives a report with ``io_error``. ``timeout`` is the deadline of a remote source in
    seconds (``deadline=`` of :func:`~dduf_plus.storage.source.open_source`); local files are bounded by the
    validator's own budgets."""
    from .errors import DDUFError
    from .format.validate import unreadable

    name = os.fspath(source)
    options = dict(storage_options or {})
    if timeout is not None and _is_url(name):
        options.setdefault("deadline", timeout)
    try:
        return validate(name, verify=verify, strict=strict, load_check=load_check,
                        max_decompressed=max_decompressed, **options)
    except DDUFError as e:
        return unreadable(name, str(e))
    except Exception as e:  # noqa: BLE001 - validate() catches its own bugs; this is a last line
        return unreadable(name, f"internal error: {type(e).__name__}: {e}")


def _is_url(name: str) -> bool:
    from .storage.urls import is_url

    return bool(is_url(name))


def validate_many(sources: Iterable[str | os.PathLike], *, executor: Executor | None = None,
                  verify: bool = False, strict: bool = False, max_workers: int | None = None,
                  timeout: float | None = None, max_decompressed: Any = None, ordered: bool = True,
                  load_check: bool = False, **storage_options: Any) -> Iterator[ValidationReport]:
    """Validate every source on ``executor`` and yield one :class:`~dduf_plus.format.validate.ValidationReport`
    per source (what :func:`validate` returns; ``io_error`` set for a source that could not be read).

    Args:
        sources: local paths and URLs (any iterable; read lazily, so a generator over stdin works).
        executor: any ``concurrent.futures.Executor`` (processes, ``distributed.Client().get_executor()``,
            Ray's); it is not shut down here. None: a thread pool of ``max_workers`` threads, closed at the end.
        verify, strict, max_decompressed, load_check: as for :func:`dduf_plus.validate`.
        max_workers: threads of the default pool (default 32) and the in-flight window with any executor.
        timeout: per-source deadline in seconds for remote sources (default ``DDUF_REMOTE_DEADLINE``).
        ordered: yield in the order of ``sources`` (default); False yields each result as it finishes.
        storage_options: passed to fsspec / the http client for URLs.

    Returns:
        An iterator of reports; ``list(validate_many(...))`` for all of them, ``[r.as_dict() for r in ...]``
        for the ``dduf validate --json`` records.

    Example:
        >>> from concurrent.futures import ProcessPoolExecutor
        >>> with ProcessPoolExecutor(2) as pool:
        ...     bad = [r.path for r in validate_many(paths, executor=pool) if not r.valid]
    """
    from .errors import DDUFUsageError

    workers = DEFAULT_MAX_WORKERS if max_workers is None else max_workers
    if workers < 1:  # checked now, not on the first next(): validate_many is not itself a generator
        raise DDUFUsageError(f"max_workers must be at least 1, not {workers}")
    if isinstance(sources, (str, bytes, os.PathLike)):  # iterating it would validate one character at a time
        raise DDUFUsageError(f"validate_many takes a list of sources, not one ({sources!r}): validate_many([...])")
    try:
        sources = iter(sources)  # still lazy: a generator over stdin is read as the batch goes
    except TypeError:
        raise DDUFUsageError(f"validate_many(sources=...): expected an iterable of paths or URLs, got "
                             f"{type(sources).__name__} {sources!r:.60}") from None
    args = (verify, strict, max_decompressed, timeout, storage_options or None, load_check)
    return _batch(executor, sources, args, workers, ordered)


def _batch(executor: Executor | None, sources: Iterable[str | os.PathLike], args: tuple[Any, ...], workers: int,
           ordered: bool) -> Iterator[ValidationReport]:
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


_END = object()


def _run(pool: Executor, sources: Iterable[str | os.PathLike], args: tuple[Any, ...], window: int,
         ordered: bool) -> Iterator[ValidationReport]:
    """Keep at most ``window`` sources in flight; yield results in order or as they finish."""
    from .format.validate import unreadable

    pending: deque[tuple[str, Any]] = deque()  # (source, its future, or its result when submit failed)
    it = iter(sources)
    exhausted = False
    try:
        while pending or not exhausted:
            while not exhausted and len(pending) < window:
                source = next(it, _END)  # not None: a None among the sources must not end the batch unseen
                if source is _END:
                    exhausted = True
                    break
                try:
                    name = os.fsdecode(source)  # type: ignore[arg-type]  # bytes as str (surrogate-escaped, like argv)
                except TypeError:  # None, a number...: this source's report, the batch goes on
                    shown = bounded_repr(source)  # a huge object by mistake: never its whole repr
                    pending.append((shown, unreadable(shown, f"not a path or URL: {type(source).__name__} {shown}")))
                    continue
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
            if hasattr(item, "cancel"):
                item.cancel()


def _done(item: Any) -> bool:
    return not hasattr(item, "done") or bool(item.done())


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


def _collect(name: str, item: Any) -> ValidationReport:
    from .format.validate import ValidationReport

    if isinstance(item, ValidationReport):  # submit failed: already a report
        return item
    try:
        result = item.result()
    except Exception as e:  # noqa: BLE001 - a worker that died, a result that could not be sent back
        return _failed(name, e)
    if not isinstance(result, ValidationReport) or result.path != name:  # an executor that mixed results up
        return _failed(name, RuntimeError(f"the executor returned {type(result).__name__} for {name}"))
    return result


def _failed(name: str, error: BaseException) -> ValidationReport:
    from .format.validate import unreadable

    message = f"executor error: {type(error).__name__}: {error}"
    log.warning("%s: %s", name, message)
    return unreadable(name, message)
