"""Fetch a remote archive (``https://``, ``s3://``, ``gs://``, ``hf://``...) into a content-keyed local cache
file, with concurrent range reads, verifying every entry as its bytes arrive.

Steps:

1. the **tail** (end records, central directory, dduf_plus index) in one or two range requests; its bytes
   and the size give the content key (never the URL alone);
2. ``cache_dir("remote")/<key>.dduf`` already complete: done, the archive is local (see *second load*);
3. else a preallocated ``<key>.dduf.partial`` is filled with ``os.pwrite`` by ``concurrency`` threads, each
   reading ``chunk_size`` ranges: first the small *metadata* (local headers, configs, tokenizer files,
   safetensors headers: what opening the archive reads), then the rest in archive order;
4. each entry is hashed as its bytes arrive, in order, and checked against the index's sha256 (its CRC-32
   where the index has none; an archive without an index is CRC-checked entry by entry once complete);
5. a progress record ``<key>.progress.json`` (completed byte ranges, written atomically, at most every
   half second) lets an interrupted fetch resume: the ranges it lists are re-hashed locally, never
   re-fetched, unless their entry does not match;
6. once everything has arrived and matched, the partial file is renamed to ``<key>.dduf`` (atomic).

Second load: a small record per URL (``urls/<sha256 of the URL>.json``: size, where the tail starts, the
key) lets it read exactly the tail in **one** request with no size probe; equal key: no other request.
With ``local_files_only`` (or ``HF_HUB_OFFLINE``) the record alone finds the file: no request at all.

Every failure is a :class:`~dduf_plus.errors.DDUFError` naming the URL and the range: a server that
ignores ``Range``, reports another size, stalls (``timeout``), trickles (``deadline``) or sends other bytes
(sha256 mismatch). All writes go through :class:`~dduf_plus.storage.confined.Confined`."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import zlib
from bisect import bisect_right
from collections import deque
from pathlib import Path
from typing import Any

from ..errors import DDUFError, DDUFIntegrityError, DDUFIOError, DDUFNotFoundError
from ..storage.confined import Confined
from .intervals import Intervals
from .readers import RangeReader, RemoteOptions, open_reader
from .tail import Tail, read_tail

logger = logging.getLogger("dduf_plus.remote.fetch")

METADATA_MAX_ENTRY = 4 << 20  # other entries up to this size come with the metadata (configs, tokenizers)
MERGE_GAP = 256 << 10  # metadata ranges closer than this are read as one request
PROGRESS_EVERY_S = 0.5
_HASH_BLOCK = 8 << 20


class _Entry:
    """One entry being verified as its bytes arrive: hashed in order up to ``upto``."""

    def __init__(self, name: str, offset: int, size: int, sha256: str | None, crc32: int | None):
        self.name, self.offset, self.end = name, offset, offset + size
        self.sha256, self.crc32 = sha256, crc32
        self.hasher = hashlib.sha256() if sha256 else None
        self.crc = 0
        self.upto = offset
        self.ok = False
        self.lock = threading.Lock()


class RemoteFetch:
    """One archive being fetched (or already complete) in the remote cache.

    ``path`` is the local file; while ``complete`` is False it is the partial file, filled by background
    threads: :meth:`wait_range` / :meth:`wait_entries` block until bytes have arrived (and matched),
    :meth:`finish` until all has and the file is renamed complete, :meth:`abort` stops and keeps the
    progress for a later resume."""

    def __init__(self, url: str, options: RemoteOptions, cache: Confined, tail: Tail, reader: RangeReader):
        self.url, self.options, self.cache, self.tail, self.reader = url, options, cache, tail, reader
        self.size = reader.size
        self.final = cache.path(f"{tail.key}.dduf")
        self.partial = cache.path(f"{tail.key}.dduf.partial")
        self.progress_path = cache.path(f"{tail.key}.progress.json")
        self.complete = False
        self.path = self.partial
        self.fd = -1
        self.fetched_bytes = 0
        self.requests = 0
        self.timeline: list[tuple[float, float, int, int]] = []  # (start, end, offset, length) per request
        self._cond = threading.Condition()
        self._done = Intervals()
        self._error: BaseException | None = None
        self._stop = False
        self._queue: deque[tuple[int, int]] = deque()
        self._threads: list[threading.Thread] = []
        self._saved_at = 0.0
        # Pieces that arrived before their entry's hash reached them, kept (bounded) so that hashing does not
        # read them back from the file: {start: bytes}, only pieces lying inside one entry's data.
        self._pending: dict[int, bytes] = {}
        self._pending_bytes = 0
        self._pending_cap = 2 * options.concurrency * options.chunk_size
        self._entries = self._verifiable_entries()
        self._starts = [e.offset for e in self._entries]

    # --- setting up ------------------------------------------------------------------------------------------
    def _verifiable_entries(self) -> list[_Entry]:
        files = self.tail.file_records()
        by_name = {r.name: r for r in self.tail.records}
        out = []
        for name, record in files.items():
            if not isinstance(record, dict):
                continue
            offset, size, sha = record.get("offset"), record.get("size"), record.get("sha256")
            central = by_name.get(name)
            if not (isinstance(offset, int) and isinstance(size, int) and 0 <= offset <= offset + size
                    <= self.tail.cd_offset and central is not None and central.size == size):
                raise DDUFIntegrityError(f"{self.url}: the index places entry {name!r} outside the archive or "
                                         "disagrees with the central directory about its size")
            sha = sha.lower() if isinstance(sha, str) and len(sha) == 64 else None
            out.append(_Entry(name, offset, size, sha, central.crc32))
        return sorted(out, key=lambda e: e.offset)

    def _metadata_ranges(self) -> list[tuple[int, int]]:
        """What opening the archive reads: every local header, the small entries, each safetensors header."""
        files = self.tail.file_records()
        ranges = []
        for record in self.tail.records:
            found = files.get(record.name)
            info: dict[str, Any] = found if isinstance(found, dict) else {}
            data_at = info.get("offset")
            if not isinstance(data_at, int) or data_at < record.header_offset:
                continue
            end = data_at  # a weight file: its header only (below)
            if not record.name.endswith(".safetensors") and record.size <= METADATA_MAX_ENTRY:
                end = data_at + record.size
            tensors_at = info.get("tensor_data_offset")
            if isinstance(tensors_at, int) and data_at <= tensors_at <= data_at + record.size:
                end = max(end, tensors_at)
            ranges.append((record.header_offset, min(end, self.tail.cd_offset)))
        merged: list[tuple[int, int]] = []
        for start, end in sorted(ranges):
            if merged and start - merged[-1][1] <= MERGE_GAP:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged

    def _plan(self) -> None:
        """Queue what is missing: metadata first, then the rest in archive order, in ``chunk_size`` pieces."""
        chunk = self.options.chunk_size
        missing = Intervals([(0, self.tail.start)]).minus(self._done)
        metadata = Intervals(self._metadata_ranges()).intersect(missing)
        for span in (metadata, missing.minus(metadata)):
            for start, end in span:
                for at in range(start, end, chunk):
                    self._queue.append((at, min(end, at + chunk)))

    def start(self) -> None:
        """Open the partial file (resuming from the progress record), write the tail, start the workers."""
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        self.cache.check(self.partial)
        self.fd = os.open(self.partial, flags, 0o644)
        try:
            resumed = self._resume()
            if os.fstat(self.fd).st_size != self.size:
                os.ftruncate(self.fd, self.size)
                if hasattr(os, "posix_fallocate"):
                    try:
                        os.posix_fallocate(self.fd, 0, self.size)
                    except OSError:
                        pass  # preallocation is an optimisation; a sparse file works as well
            self._write(self.tail.fetched_at, self.tail.fetched)  # the first guess may reach before the tail
            self._done.add(self.tail.fetched_at, self.size)
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise
        self._plan()
        if resumed:
            logger.info("%s: resuming, %d of %d bytes already here", self.url, self._done.total(), self.size)
        for entry in self._entries:  # entries already here (a resume) are re-hashed locally
            self._advance(entry)
        for i in range(min(self.options.concurrency, max(1, len(self._queue)))):
            thread = threading.Thread(target=self._work, name=f"dduf-fetch-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _resume(self) -> bool:
        try:
            record = json.loads(self.progress_path.read_text())
            if record.get("size") != self.size or os.fstat(self.fd).st_size != self.size:
                return False
            done = [(int(a), int(b)) for a, b in record.get("done", []) if 0 <= int(a) < int(b) <= self.size]
        except (OSError, ValueError, TypeError, AttributeError):
            return False
        self._done = Intervals(done)
        return bool(done)

    # --- the workers ---------------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                if self._stop or self._error is not None or not self._queue:
                    return
                start, end = self._queue.popleft()
            try:
                t0 = time.perf_counter()
                data = self.reader.read(start, end - start)
                t1 = time.perf_counter()
                self._write(start, data)
                with self._cond:
                    self.requests += 1
                    self.fetched_bytes += len(data)
                    self.timeline.append((t0, t1, start, end - start))
                    self._done.add(start, end)
                    self._cond.notify_all()
                self._keep(start, end, data)
                self._entries_touched(start, end, data)
                self._save_progress()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                self._fail(e)
                return

    def _write(self, offset: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(self.fd, view, offset)
            view, offset = view[written:], offset + written

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    # --- verification as bytes arrive ----------------------------------------------------------------------------
    def _keep(self, start: int, end: int, data: bytes) -> None:
        i = bisect_right(self._starts, start) - 1
        if i < 0 or self._entries[i].end < end or self._entries[i].upto >= end:
            return
        with self._cond:
            if self._pending_bytes + len(data) <= self._pending_cap:
                self._pending[start] = data
                self._pending_bytes += len(data)

    def _take(self, start: int) -> bytes | None:
        with self._cond:
            data = self._pending.pop(start, None)
            if data is not None:
                self._pending_bytes -= len(data)
            return data

    def _entries_touched(self, start: int, end: int, data: bytes) -> None:
        i = max(0, bisect_right(self._starts, start) - 1)
        while i < len(self._entries) and self._entries[i].offset < end:
            if self._entries[i].end > start or self._entries[i].offset == self._entries[i].end:
                self._advance(self._entries[i], start, data)
            i += 1

    def _advance(self, entry: _Entry, start: int = 0, data: bytes = b"") -> None:
        """Hash ``entry`` forward over the bytes that have arrived. One thread hashes an entry at a time;
        the others move on (the hashing thread looks again before it lets go)."""
        while not entry.ok:
            if not entry.lock.acquire(blocking=False):
                return
            try:
                while entry.upto < entry.end:
                    with self._cond:
                        reach = min(entry.end, self._done.reach(entry.upto))
                    if reach <= entry.upto:
                        break
                    while entry.upto < reach:
                        n = min(_HASH_BLOCK, reach - entry.upto)
                        block: bytes | memoryview
                        if start <= entry.upto < start + len(data):  # the piece just received: no re-read
                            block = memoryview(data)[entry.upto - start:min(reach, start + len(data)) - start]
                        else:
                            kept = self._take(entry.upto) if self._pending else None
                            if kept is not None and entry.upto + len(kept) <= reach:
                                block = kept
                            else:
                                block = os.pread(self.fd, n, entry.upto)
                        if entry.hasher is not None:
                            entry.hasher.update(block)
                        else:
                            entry.crc = zlib.crc32(block, entry.crc)
                        entry.upto += len(block)
                if entry.upto >= entry.end:
                    self._check(entry)
                    return
            finally:
                entry.lock.release()
            with self._cond:
                if self._done.reach(entry.upto) <= entry.upto:
                    return

    def _check(self, entry: _Entry) -> None:
        good = (entry.hasher.hexdigest() == entry.sha256 if entry.hasher is not None
                else entry.crc32 is None or entry.crc == entry.crc32)
        if not good:
            with self._cond:
                self._done.remove(entry.offset, entry.end)  # a resume fetches it again
            what = "sha256 in the index" if entry.hasher is not None else "CRC-32"
            self._fail(DDUFIntegrityError(
                f"{self.url}: entry {entry.name!r} (bytes {entry.offset}-{entry.end - 1}) does not match its "
                f"{what}: the server sent other bytes than the archive's index records"))
            return
        with self._cond:
            entry.ok = True
            self._cond.notify_all()

    # --- waiting ---------------------------------------------------------------------------------------------------
    def _wait(self, ready: Any, what: str) -> None:
        with self._cond:
            while not ready():
                if self._error is not None:
                    raise _reraise(self._error)
                if not any(t.is_alive() for t in self._threads) and not ready():
                    raise DDUFIOError(f"{self.url}: the fetch stopped before {what} arrived")
                try:
                    left = self.reader.remaining()
                except DDUFError as e:
                    self._error = e
                    raise
                self._cond.wait(min(left, 1.0))

    def wait_range(self, offset: int, length: int) -> None:
        self._wait(lambda: self._done.covers(offset, offset + length), f"bytes {offset}-{offset + length - 1}")

    def wait_entries(self, names: list[str] | None = None) -> None:
        """Until every named entry (all when None) has arrived and matched its hash."""
        wanted = [e for e in self._entries if names is None or e.name in names]
        self._wait(lambda: all(e.ok for e in wanted), f"entries {', '.join(e.name for e in wanted[:3])}")

    def prioritize(self, components: list[str]) -> None:
        """Fetch the components' entries in this order (the loader's build order), then the rest."""
        rank: list[tuple[int, int, int]] = []  # (start, end, rank)
        for i, name in enumerate(components):
            rank += [(e.offset, e.end, i) for e in self._entries if e.name.startswith(name + "/")]
        def key(piece: tuple[int, int]) -> tuple[int, int]:
            return min((r for a, b, r in rank if a < piece[1] and piece[0] < b), default=len(components)), piece[0]
        with self._cond:
            self._queue = deque(sorted(self._queue, key=key))

    def wait_component(self, component: str) -> None:
        if not self.complete:
            prefix = component + "/"
            self.wait_entries([e.name for e in self._entries if e.name.startswith(prefix)])

    # --- ending ---------------------------------------------------------------------------------------------------------
    def finish(self) -> Path:
        """Wait for everything, check what the index does not cover, rename the file complete."""
        if self.complete:
            return self.final
        self._wait(lambda: self._done.covers(0, self.size) and all(e.ok for e in self._entries), "the archive")
        for thread in self._threads:
            thread.join()
        self._check_unindexed()
        try:
            self.cache.replace(self.partial, self.final)
        except FileNotFoundError:  # another process fetching the same archive finished first
            if not self.final.is_file():
                raise DDUFIOError(f"{self.url}: the partial cache file {self.partial} vanished") from None
        self.cache.unlink(self.progress_path)
        self.complete, self.path = True, self.final
        self._close()
        logger.info("%s: fetched %d bytes in %d requests into %s", self.url, self.fetched_bytes, self.requests,
                    self.final)
        return self.final

    def _check_unindexed(self) -> None:
        """Entries the index does not list (every entry, without an index): their CRC-32, now that all is here."""
        from ..format.archive import DDUFArchive

        covered = {e.name for e in self._entries}
        with DDUFArchive(self.partial, check=False) as archive:
            for name, entry in archive.entries.items():
                if name in covered:
                    continue
                if zlib.crc32(archive.view(name)) != entry.crc32:
                    self.cache.unlink(self.partial)
                    self.cache.unlink(self.progress_path)
                    raise DDUFIntegrityError(f"{self.url}: entry {name!r} (bytes {entry.offset}-"
                                             f"{entry.offset + entry.length - 1}) does not match its CRC-32")

    def abort(self) -> None:
        """Stop the workers (their requests end within the timeout) and keep the progress for a resume."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._save_progress(force=True)
        self._close()

    def _save_progress(self, force: bool = False) -> None:
        now = time.monotonic()
        with self._cond:
            if not force and now - self._saved_at < PROGRESS_EVERY_S:
                return
            self._saved_at = now
            record = {"url": self.url, "size": self.size, "key": self.tail.key, "done": self._done.spans()}
        try:
            self.cache.write_bytes(self.progress_path, json.dumps(record).encode())
        except OSError as e:
            logger.warning("%s: cannot save the fetch progress: %s", self.url, e)

    def _close(self) -> None:
        self.reader.close()
        if self.fd >= 0 and all(not t.is_alive() for t in self._threads):
            os.close(self.fd)
            self.fd = -1


def _reraise(error: BaseException) -> BaseException:
    return error if isinstance(error, DDUFError) else DDUFIOError(f"fetch failed: {type(error).__name__}: {error}")


# --- the front door ------------------------------------------------------------------------------------------------------
def _url_record(cache: Confined, url: str) -> Path:
    return cache.path("urls", hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest() + ".json")


def _read_record(cache: Confined, url: str) -> dict[str, Any]:
    try:
        record = json.loads(_url_record(cache, url).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) and record.get("url") == url else {}


def _write_record(cache: Confined, url: str, size: int, tail: Tail) -> None:
    path = _url_record(cache, url)
    cache.mkdir(path.parent)
    cache.write_bytes(path, json.dumps({"url": url, "size": size, "tail_start": tail.start, "key": tail.key}).encode())


def open_remote(url: str, options: RemoteOptions | dict[str, Any] | None = None, *,
                local_files_only: bool = False) -> RemoteFetch | Path:
    """The local file of ``url``'s archive (a :class:`Path` when it is complete in the cache) or a
    started :class:`RemoteFetch` filling it.

    Raises:
        DDUFUsageError: a URL scheme that is not allowed; bad options.
        DDUFNotFoundError: not found (or, offline, not in the cache).
        DDUFIOError, DDUFIntegrityError: the server misbehaves (see the module docstring).
    """
    options = RemoteOptions.of(options)
    cache = Confined(options.folder())
    record = _read_record(cache, url)
    known = cache.path(f"{record['key']}.dduf") if isinstance(record.get("key"), str) and len(record["key"]) == 64 else None
    if local_files_only or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        if known is not None and known.is_file() and known.stat().st_size == record.get("size"):
            return known
        raise DDUFNotFoundError(f"{url}: not in the remote cache ({cache.root}) and local_files_only/HF_HUB_OFFLINE "
                                "forbids fetching it", url)
    reader, tail = _read_with_hint(url, options, record)
    try:
        final = cache.path(f"{tail.key}.dduf")
        if final.is_file() and final.stat().st_size == reader.size:
            reader.close()
            _write_record(cache, url, reader.size, tail)
            return final
        fetch = RemoteFetch(url, options, cache, tail, reader)
        _write_record(cache, url, reader.size, tail)
        fetch.start()
        return fetch
    except BaseException:
        reader.close()
        raise


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
    opened = open_remote(url, options, local_files_only=local_files_only)
    if isinstance(opened, Path):
        return opened
    try:
        return opened.finish()
    except BaseException:
        opened.abort()
        raise


class CacheSource:
    """A :class:`~dduf_plus.storage.source.ByteSource` over a fetch in progress: each read waits until its
    bytes have arrived, then reads the local file (``fd``: the archive maps it)."""

    def __init__(self, fetch: RemoteFetch):
        self.fetch, self.name, self.size, self.fd, self.bytes_read = fetch, str(fetch.partial), fetch.size, fetch.fd, 0

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DDUFError(f"{self.fetch.url}: read of {length} bytes at {offset} is outside the file")
        self.fetch.wait_range(offset, length)
        data = os.pread(self.fd, length, offset)
        self.bytes_read += len(data)
        return data

    def close(self) -> None:
        pass  # the fetch owns the file descriptor


__all__ = ["CacheSource", "RemoteFetch", "RemoteOptions", "fetch_archive", "open_remote"]
