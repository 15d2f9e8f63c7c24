"""The front door of remote archives (``https://``, ``s3://``, ``gs://``, ``hf://``...): :func:`open_remote`
gives the complete cached file, the offline answer from the cache, or a started :class:`RemoteFetch`
(:mod:`.transfer`) filling the local file with concurrent range reads, verifying every entry as its bytes
arrive (:mod:`.entries`); :func:`fetch_archive` waits for it; :class:`CacheSource` reads a fetch in progress.

Steps (the modules doing each):

1. the **tail** (end records, central directory, dduf_plus index) in one or two range requests, checked
   by the validator's ZIP rules and proven to account for the whole file (:mod:`.tail`) before anything is
   written; its bytes, the size and (unless the index pins every entry by sha256) the URL give the key;
2. ``cache_dir("remote")/<key>.dduf`` already complete: done, the archive is local (see *second load*);
3. else ``<key>.dduf.partial`` is sized (when it fits the free disk, :mod:`.partials`) and ``concurrency``
   threads read ``chunk_size`` ranges (the last ones cut smaller), each answer streamed from its socket
   through a small buffer the thread reuses and written block by block with ``pwrite`` while the block is
   cache-hot, one writer at a time: first the small *metadata* (local headers, configs, tokenizer files,
   safetensors headers: what opening the archive reads), then the rest in the loader's build order. The
   bytes land in the partial file (cache on tmpfs, or an archive over ``memory_max``), else in an in-memory
   file that the loader maps and a writer thread copies into the partial file behind the load (a disk
   slower than the link does not hold the load up); ``cache=False``: in memory only, nothing on disk
   (:mod:`.transfer`, :mod:`.sink`, :mod:`.cache_writes`);
4. every entry (the central directory lists them all) is placed by its local header and hashed once as its
   bytes arrive, in order, in place through a read-only mapping of the file (:class:`FetchStats` counts
   it): checked against the index's sha256, else against its CRC-32 (damage only: a CRC-32 is forged
   with 4 bytes, which is why such an archive's key is bound to its URL), and its sha256 is recorded
   either way; a component is built only once all of its entries have arrived and matched (:mod:`.entries`);
5. a progress record ``<key>.progress.json`` (completed byte ranges, written atomically, at most every
   half second) lets an interrupted fetch resume: the ranges it lists are re-hashed locally, never
   re-fetched, unless their entry does not match; a refused archive leaves no partial, a kept one holds
   only the bytes that arrived and counts against ``$DDUF_PLUS_REMOTE_PARTIALS_MAX`` (:mod:`.partials`);
6. once everything has arrived and matched, ``<key>.sha256.json`` (the URL when the key is bound to it,
   every entry's sha256) is written and the partial file is renamed to ``<key>.dduf`` (atomic,
   :mod:`.cache_records`).

Second load: a small record per URL (``urls/<sha256 of the URL>.json``: size, where the tail starts, the
key) lets it read exactly the tail in **one** request with no size probe; equal key: no other request.
With ``local_files_only`` (or ``HF_HUB_OFFLINE``) the record finds the file, whose own tail must give the
recorded key again for this URL: no request at all.

Every failure is a :class:`~dduf_plus.errors.DDUFError` naming the URL and the range: a server that
ignores ``Range``, reports another size, stalls (``timeout``), trickles (``deadline``) or sends other bytes
(sha256 or CRC-32 mismatch). All writes go through :class:`~dduf_plus.storage.confined.Confined`."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ..errors import DDUFError, DDUFNotFoundError, DDUFUsageError
from ..storage.confined import Confined
from ..storage.hub_env import is_offline

# cached_sha256, manifest_path, url_record, wait_cache_writes, FetchStats: re-exported (callers name them here)
from .cache_records import (  # noqa: F401
    LocalRanges,
    cached_sha256,
    manifest_path,
    read_record,
    url_record,
    write_record,
)
from .cache_writes import wait_cache_writes
from .readers import RangeReader, RemoteOptions, open_reader
from .sink import choose_sink
from .tail import Tail, read_tail
from .transfer import FetchStats, RemoteFetch

logger = logging.getLogger("dduf_plus.remote.fetch")


def _offline_hit(cache: Confined, url: str, record: dict[str, Any]) -> Path | None:
    """The cached file the URL's record names, if its own tail gives the recorded key again for this URL: a
    record written by an older dduf_plus (whose keys did not cover the URL) or pointing at another archive
    finds nothing."""
    key = record.get("key")
    if not (isinstance(key, str) and len(key) == 64 and all(c in "0123456789abcdef" for c in key)):
        return None
    known = cache.path(f"{key}.dduf")
    wait_cache_writes(known)
    try:
        if not known.is_file() or known.stat().st_size != record.get("size"):
            return None
        tail = read_tail(LocalRanges(url, known), record.get("tail_start"))
    except (DDUFError, OSError):
        return None
    return known if tail.key == key else None


def open_remote(url: str, options: RemoteOptions | dict[str, Any] | None = None, *,
                local_files_only: bool = False, in_memory: bool = True) -> RemoteFetch | Path:
    """The local file of ``url``'s archive (a :class:`Path` when it is complete in the cache) or a
    started :class:`RemoteFetch` filling it (``in_memory``: it may be received into memory and written to
    the cache behind; ``cache=False`` in the options: into memory only).

    Raises:
        DDUFUsageError: a URL scheme that is not allowed; bad options.
        DDUFNotFoundError: not found (or, offline, not in the cache).
        DDUFValidationError: the archive's tail breaks a ZIP or DDUF rule (nothing is written).
        DDUFIOError, DDUFIntegrityError: the server misbehaves (see the module docstring); the archive does
            not fit the free disk space.
    """
    options = RemoteOptions.of(options)
    if not options.cache:  # keep nothing: no cache folder is read or written
        if is_offline(local_files_only):
            raise DDUFNotFoundError(f"{url}: remote cache=False fetches the archive, which local_files_only/"
                                    "HF_HUB_OFFLINE forbids", url)
        reader, tail = _read_with_hint(url, options, {})
        return _started(RemoteFetch(url, options, None, tail, reader, "memory"), reader)
    cache = Confined(options.folder())
    record = read_record(cache, url)
    if is_offline(local_files_only):
        known = _offline_hit(cache, url, record)
        if known is not None:
            return known
        raise DDUFNotFoundError(f"{url}: not in the remote cache ({cache.root}) and local_files_only/HF_HUB_OFFLINE "
                                "forbids fetching it", url)
    reader, tail = _read_with_hint(url, options, record)
    try:
        final = cache.path(f"{tail.key}.dduf")
        wait_cache_writes(final)
        if final.is_file() and final.stat().st_size == reader.size:
            reader.close()
            write_record(cache, url, reader.size, tail)
            return final
        fetch = RemoteFetch(url, options, cache, tail, reader, choose_sink(options, cache.root, reader.size, in_memory))
        write_record(cache, url, reader.size, tail)
    except BaseException:
        reader.close()
        raise
    return _started(fetch, reader)


def _started(fetch: RemoteFetch, reader: RangeReader) -> RemoteFetch:
    try:
        fetch.start()
    except BaseException:
        reader.close()
        raise
    return fetch


def _read_with_hint(url: str, options: RemoteOptions, record: dict[str, Any]) -> tuple[RangeReader, Tail]:
    """The tail: with a record of an earlier fetch, one request for exactly its bytes (no size probe); when
    that fails because the file changed, the usual probe and tail."""
    size, start = record.get("size"), record.get("tail_start")
    if isinstance(size, int) and isinstance(start, int) and 0 <= start < size:
        reader = open_reader(url, options, size)
        try:
            return reader, read_tail(reader, start)
        except DDUFError as e:
            reader.close()
            logger.info("%s: the cached record no longer applies (%s); reading the tail again", url, e)
    reader = open_reader(url, options)
    try:
        return reader, read_tail(reader)
    except BaseException:
        reader.close()
        raise


def fetch_archive(url: str, options: RemoteOptions | dict[str, Any] | None = None, *,
                  local_files_only: bool = False) -> Path:
    """Fetch ``url`` completely into the remote cache and return the local file (no torch needed)."""
    if not RemoteOptions.of(options).cache:
        raise DDUFUsageError(f"{url}: fetching into the remote cache with cache=False keeps nothing")
    opened = open_remote(url, options, local_files_only=local_files_only, in_memory=False)
    if isinstance(opened, Path):
        return opened
    try:
        final = opened.finish()
    except BaseException:
        opened.abort()
        raise
    assert final is not None
    return final


class CacheSource:
    """A :class:`~dduf_plus.storage.source.ByteSource` over a fetch in progress: each read waits until its
    bytes have arrived, then reads the local file (``fd``: the archive maps it)."""

    def __init__(self, fetch: RemoteFetch):
        self.fetch, self.size, self.fd, self.bytes_read = fetch, fetch.size, fetch.fd, 0
        # cache=False: no file; a name that is not a URL (the archive maps local sources only)
        self.name = str(fetch.partial) if fetch.partial is not None else f"(memory) {fetch.url.split('://', 1)[-1]}"

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DDUFError(f"{self.fetch.url}: read of {length} bytes at {offset} is outside the file")
        self.fetch.wait_range(offset, length)
        data = os.pread(self.fd, length, offset)
        self.bytes_read += len(data)
        return data

    def close(self) -> None:
        pass  # the fetch owns the file descriptor


__all__ = ["CacheSource", "FetchStats", "RemoteFetch", "RemoteOptions", "cached_sha256", "fetch_archive", "open_remote",
           "wait_cache_writes"]
