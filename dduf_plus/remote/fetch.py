"""Fetch a remote archive (``https://``, ``s3://``, ``gs://``, ``hf://``...) into a local cache file, with
concurrent range reads, verifying every entry as its bytes arrive.

Steps:

1. the **tail** (end records, central directory, dduf_plus index) in one or two range requests, checked
   by the validator's ZIP rules and proven to account for the whole file (:mod:`.tail`) before anything is
   written; its bytes, the size and (unless the index pins every entry by sha256) the URL give the key;
2. ``cache_dir("remote")/<key>.dduf`` already complete: done, the archive is local (see *second load*);
3. else ``<key>.dduf.partial`` is preallocated (when it fits the free disk, :mod:`.partials`) and filled
   with ``os.pwrite`` by ``concurrency`` threads, each reading ``chunk_size`` ranges: first the small
   *metadata* (local headers, configs, tokenizer files, safetensors headers: what opening the archive
   reads), then the rest in the loader's build order;
4. every entry (the central directory lists them all) is placed by its local header and hashed as its
   bytes arrive, in order: checked against the index's sha256, else against its CRC-32 (damage only: a
   CRC-32 is forged with 4 bytes, which is why such an archive's key is bound to its URL), and its sha256
   is recorded either way; a component is built only once all of its entries have arrived and matched;
5. a progress record ``<key>.progress.json`` (completed byte ranges, written atomically, at most every
   half second) lets an interrupted fetch resume: the ranges it lists are re-hashed locally, never
   re-fetched, unless their entry does not match; a refused archive leaves no partial, a kept one holds
   only the bytes that arrived and counts against ``$DDUF_PLUS_REMOTE_PARTIALS_MAX``;
6. once everything has arrived and matched, ``<key>.sha256.json`` (the URL when the key is bound to it,
   every entry's sha256) is written and the partial file is renamed to ``<key>.dduf`` (atomic).

Second load: a small record per URL (``urls/<sha256 of the URL>.json``: size, where the tail starts, the
key) lets it read exactly the tail in **one** request with no size probe; equal key: no other request.
With ``local_files_only`` (or ``HF_HUB_OFFLINE``) the record finds the file, whose own tail must give the
recorded key again for this URL: no request at all.

Every failure is a :class:`~dduf_plus.errors.DDUFError` naming the URL and the range: a server that
ignores ``Range``, reports another size, stalls (``timeout``), trickles (``deadline``) or sends other bytes
(sha256 or CRC-32 mismatch). All writes go through :class:`~dduf_plus.storage.confined.Confined`."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import sys
import threading
import time
import zlib
from bisect import bisect_right
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DDUFError, DDUFFormatError, DDUFIntegrityError, DDUFIOError, DDUFNotFoundError
from ..format import spec
from ..storage.confined import Confined
from . import partials
from .intervals import Intervals
from .readers import RangeReader, RemoteOptions, open_reader
from .tail import MAX_LOCAL_SLACK, Tail, read_tail

if TYPE_CHECKING:  # pragma: no cover
    from ..format.zipfmt import ZipEntry

logger = logging.getLogger("dduf_plus.remote.fetch")

METADATA_MAX_ENTRY = 4 << 20  # other entries up to this size come with the metadata (configs, tokenizers)
MERGE_GAP = 256 << 10  # metadata ranges closer than this are read as one request
PROGRESS_EVERY_S = 0.5
HEADER_GUESS = 1 << 20  # safetensors header bytes fetched with the metadata when no index says how many
EXTRA_GUESS = 4096 + 64  # a local header's extra field when no index says where the data starts (alignment)
_HASH_BLOCK = 8 << 20


class _EntryMismatch(DDUFIntegrityError):
    """An entry's bytes do not match its hash: this transfer went wrong (a resume fetches the entry again);
    the archive itself is not refused for it."""


class _Entry:
    """One central directory entry being verified as its bytes arrive: placed once its local header is
    here, then hashed in order up to ``upto``. ``sha256`` is the index's (checked), else None (the CRC-32
    is checked and the sha256 recorded)."""

    def __init__(self, record: ZipEntry, sha256: str | None, index_offset: int | None):
        self.name, self.size, self.crc32, self.header_offset = record.name, record.size, record.crc32, record.header_offset
        self.name_bytes = record.name.encode("utf-8")
        self.head_end = record.header_offset + spec.LOCAL_HEADER_SIZE + len(self.name_bytes)
        self.offset: int | None = None  # the first data byte, once the local header has arrived
        self.end = self.head_end + MAX_LOCAL_SLACK + record.size  # an upper bound until then
        self.upto = self.end
        self.sha256, self.index_offset = sha256, index_offset
        self.hasher = hashlib.sha256()
        self.crc = 0
        self.digest: str | None = None
        self.ok = False
        self.lock = threading.Lock()


def _refused(error: BaseException | None) -> bool:
    """The archive itself is refused (its tail, its structure once opened, a local header): nothing of it is
    worth keeping. A mismatching entry, an I/O error or an interrupt keeps the partial for a resume."""
    return isinstance(error, DDUFFormatError) and not isinstance(error, _EntryMismatch)


class RemoteFetch:
    """One archive being fetched (or already complete) in the remote cache.

    ``path`` is the local file; while ``complete`` is False it is the partial file, filled by background
    threads: :meth:`wait_range` blocks until bytes have arrived, :meth:`wait_entries` /
    :meth:`wait_component` until entries have arrived *and matched*, :meth:`finish` until all has and the
    file is renamed complete, :meth:`abort` stops (keeping the progress for a resume unless the archive
    was refused)."""

    def __init__(self, url: str, options: RemoteOptions, cache: Confined, tail: Tail, reader: RangeReader):
        self.url, self.options, self.cache, self.tail, self.reader = url, options, cache, tail, reader
        self.size = reader.size
        self.final = cache.path(f"{tail.key}.dduf")
        self.partial = cache.path(f"{tail.key}.dduf.partial")
        self.progress_path = cache.path(f"{tail.key}.progress.json")
        self.manifest_path = manifest_path(cache, tail.key)
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
        self._discarded = False
        self._writing = 0  # workers inside a pwrite
        self._progress_lock = threading.Lock()  # a save in flight ends before a discard removes the files
        self._queue: deque[tuple[int, int]] = deque()
        self._threads: list[threading.Thread] = []
        self._saved_at = 0.0
        # Pieces that arrived before their entry's hash reached them, kept (bounded) so that hashing does not
        # read them back from the file: {start: bytes}, only pieces lying inside one entry's data.
        self._pending: dict[int, bytes] = {}
        self._pending_bytes = 0
        self._pending_cap = 2 * options.concurrency * options.chunk_size
        self._entries = self._make_entries()
        self._starts = [e.header_offset for e in self._entries]

    # --- setting up ------------------------------------------------------------------------------------------
    def _make_entries(self) -> list[_Entry]:
        """Every central directory entry, with what the index says of it (checked against the directory)."""
        files = self.tail.file_records()
        out = []
        for record in self.tail.records:
            info = files.get(record.name)
            info = info if isinstance(info, dict) else {}
            offset, size = info.get("offset"), info.get("size", record.size)
            if size != record.size or not (offset is None or isinstance(offset, int)):
                raise DDUFIntegrityError(f"{self.url}: the index and the central directory disagree about entry "
                                         f"{record.name!r} (I002)")
            out.append(_Entry(record, self.tail.indexed_sha256(record.name), offset))
        return sorted(out, key=lambda e: e.header_offset)

    def _metadata_ranges(self) -> list[tuple[int, int]]:
        """What opening the archive reads: every local header, the small entries, each safetensors header
        (where the index does not say where data and tensors start: a guess, the rest comes in order)."""
        files = self.tail.file_records()
        ranges = []
        for e in self._entries:
            found = files.get(e.name)
            info: dict[str, Any] = found if isinstance(found, dict) else {}
            indexed = e.index_offset is not None and e.index_offset >= e.head_end
            data_at = e.index_offset if indexed and e.index_offset is not None else e.head_end + EXTRA_GUESS
            end = data_at  # a large entry: its local header only
            if not e.name.endswith(".safetensors") and e.size <= METADATA_MAX_ENTRY:
                end = data_at + e.size
            elif e.name.endswith(".safetensors"):
                tensors_at = info.get("tensor_data_offset")
                if indexed and isinstance(tensors_at, int) and data_at <= tensors_at <= data_at + e.size:
                    end = tensors_at
                elif not indexed:
                    end = data_at + min(e.size, HEADER_GUESS)
            ranges.append((e.header_offset, min(end, self.tail.cd_offset)))
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
        """Check the disk rules, open the partial file (resuming from the progress record), write the tail,
        start the workers."""
        partials.enforce_budget(self.cache, active=self.partial)
        partials.check_room(self.url, self.cache.root, self.size, self.partial)
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
            self._plan()
            for entry in self._entries:  # entries already here (a resume, the tail) are hashed locally
                self._advance(entry)
        except BaseException as e:
            os.close(self.fd)
            self.fd = -1
            if _refused(e):
                partials.discard(self.cache, self.partial)
            raise
        if resumed:
            logger.info("%s: resuming, %d of %d bytes already here", self.url, self._done.total(), self.size)
        for i in range(min(self.options.concurrency, max(1, len(self._queue)))):
            thread = threading.Thread(target=self._work, name=f"dduf-fetch-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _resume(self) -> bool:
        """Take over the ranges a progress record lists, when it is this archive's (same key: for an archive
        whose key is bound to its URL, the same URL)."""
        try:
            record = json.loads(self.progress_path.read_text())
            if (record.get("size") != self.size or record.get("key") != self.tail.key
                    or os.fstat(self.fd).st_size != self.size):
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
                with self._cond:
                    if self._stop:  # abort() may be releasing the blocks not written yet
                        return
                    self._writing += 1
                try:
                    self._write(start, data)
                except BaseException:
                    with self._cond:
                        self._writing -= 1
                        self._cond.notify_all()
                    raise
                with self._cond:  # written and recorded as done at once (abort() computes the holes)
                    self._writing -= 1
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
        entry = self._entries[i] if i >= 0 else None
        if entry is None or entry.offset is None or start < entry.offset or entry.end < end or entry.upto >= end:
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
        while i < len(self._entries) and self._entries[i].header_offset < end:
            entry = self._entries[i]
            if entry.end > start or entry.offset is None or entry.offset == entry.end:
                self._advance(entry, start, data)
            i += 1

    def _advance(self, entry: _Entry, start: int = 0, data: bytes = b"") -> None:
        """Place ``entry`` once its local header is here, then hash it forward over the bytes that have
        arrived. One thread works on an entry at a time; the others move on (it looks again before it
        lets go)."""
        while not entry.ok:
            if not entry.lock.acquire(blocking=False):
                return
            try:
                if entry.offset is None and not self._place(entry):
                    return
                self._hash_arrived(entry, start, data)
                if entry.upto >= entry.end:
                    self._check(entry)
                    return
            finally:
                entry.lock.release()
            with self._cond:
                if self._done.reach(entry.upto) <= entry.upto:
                    return

    def _place(self, entry: _Entry) -> bool:
        """Read ``entry``'s local header (once it has arrived): where its data starts, checked against the
        central directory's name and, where the index records one, the index's offset."""
        with self._cond:
            if not self._done.covers(entry.header_offset, entry.head_end):
                return False
        head = os.pread(self.fd, entry.head_end - entry.header_offset, entry.header_offset)
        fields = struct.unpack_from(spec.LOCAL_HEADER_FMT, head) if len(head) >= spec.LOCAL_HEADER_SIZE else None
        where = f"{self.url}: entry {entry.name!r}"
        if (fields is None or fields[0] != spec.SIG_LOCAL or fields[9] != len(entry.name_bytes)
                or head[spec.LOCAL_HEADER_SIZE:] != entry.name_bytes):
            raise DDUFIntegrityError(f"{where}: no local header naming it at byte {entry.header_offset} (Z014)")
        offset = entry.head_end + fields[10]
        if offset + entry.size > self.tail.cd_offset:
            raise DDUFIntegrityError(f"{where}: its data runs into the central directory (Z017)")
        if entry.index_offset is not None and entry.index_offset != offset:
            raise DDUFIntegrityError(f"{where}: the index places its data at {entry.index_offset}, its local "
                                     f"header at {offset} (I002)")
        entry.offset, entry.end, entry.upto = offset, offset + entry.size, offset
        return True

    def _hash_arrived(self, entry: _Entry, start: int, data: bytes) -> None:
        """Hash ``entry`` from ``upto`` over every byte that has arrived (the piece just received, a kept
        piece, else the file)."""
        while entry.upto < entry.end:
            with self._cond:
                reach = min(entry.end, self._done.reach(entry.upto))
            if reach <= entry.upto:
                return
            while entry.upto < reach:
                block: bytes | memoryview
                if start <= entry.upto < start + len(data):  # the piece just received: no re-read
                    block = memoryview(data)[entry.upto - start:min(reach, start + len(data)) - start]
                else:
                    kept = self._take(entry.upto) if self._pending else None
                    if kept is not None and entry.upto + len(kept) <= reach:
                        block = kept
                    else:
                        block = os.pread(self.fd, min(_HASH_BLOCK, reach - entry.upto), entry.upto)
                entry.hasher.update(block)
                if entry.sha256 is None:  # no sha256 to check: the CRC-32 (damage), and the sha256 is recorded
                    entry.crc = zlib.crc32(block, entry.crc)
                entry.upto += len(block)

    def _check(self, entry: _Entry) -> None:
        digest = entry.hasher.hexdigest()
        good = digest == entry.sha256 if entry.sha256 is not None else entry.crc == entry.crc32
        if not good:
            with self._cond:
                self._done.remove(entry.offset or entry.header_offset, entry.end)  # a resume fetches it again
            what = "sha256 in the index" if entry.sha256 is not None else "CRC-32 in the central directory"
            self._fail(_EntryMismatch(
                f"{self.url}: entry {entry.name!r} (bytes {entry.offset}-{entry.end - 1}) does not match its "
                f"{what}: the server sent other bytes than the archive records"))
            return
        with self._cond:
            entry.digest, entry.ok = digest, True
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
        """Until bytes ``[offset, offset + length)`` have arrived (not yet checked: opening reads headers)."""
        self._wait(lambda: self._done.covers(offset, offset + length), f"bytes {offset}-{offset + length - 1}")

    def wait_entries(self, names: list[str] | None = None) -> None:
        """Until every named entry (all when None) has arrived and matched its hash."""
        wanted = [e for e in self._entries if names is None or e.name in names]
        self._wait(lambda: all(e.ok for e in wanted), f"entries {', '.join(e.name for e in wanted[:3])}")

    def prioritize(self, components: list[str]) -> None:
        """Fetch the components' entries in this order (the loader's build order), then the rest."""
        rank: list[tuple[int, int, int]] = []  # (start, end, rank)
        for i, name in enumerate(components):
            rank += [(e.header_offset, e.end, i) for e in self._entries if e.name.startswith(name + "/")]
        def key(piece: tuple[int, int]) -> tuple[int, int]:
            return min((r for a, b, r in rank if a < piece[1] and piece[0] < b), default=len(components)), piece[0]
        with self._cond:
            self._queue = deque(sorted(self._queue, key=key))

    def wait_component(self, component: str) -> None:
        """Until every entry of ``component``'s folder has arrived and matched: its tensors view only
        checked bytes (an archive without an index too: its entries come from the central directory)."""
        if not self.complete:
            prefix = component + "/"
            self.wait_entries([e.name for e in self._entries if e.name.startswith(prefix)])

    def entry_sha256(self) -> dict[str, str]:
        """{entry: sha256} of the entries checked so far (every entry once :meth:`finish` returned)."""
        with self._cond:
            return {e.name: e.digest for e in self._entries if e.ok and e.digest is not None}

    # --- ending ---------------------------------------------------------------------------------------------------------
    def finish(self) -> Path:
        """Wait for everything, record every entry's sha256, rename the file complete."""
        if self.complete:
            return self.final
        self._wait(lambda: self._done.covers(0, self.size) and all(e.ok for e in self._entries), "the archive")
        for thread in self._threads:
            thread.join()
        write_manifest(self.cache, self.tail, self.url, self.size, self.entry_sha256())
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

    def abort(self, error: BaseException | None = None) -> None:
        """Stop the workers (their requests end within the timeout). ``error`` (default: the exception
        being handled) says why: a refused archive leaves nothing; otherwise the progress is kept for a
        resume, the blocks nothing was written to are released, and the kept partials' budget applies."""
        error = error if error is not None else sys.exc_info()[1]
        with self._cond:
            self._stop = True
            already = self._discarded
            self._discarded = already or _refused(error)
            self._cond.notify_all()
            while self._writing:  # a write in flight lands before the unwritten blocks are computed
                self._cond.wait(0.1)
        if self.complete or already:
            return
        if self._discarded:
            self._discard()
            self._close()
            return
        self._save_progress(force=True)
        with self._cond:
            holes = list(Intervals([(0, self.size)]).minus(self._done))
        if self.fd >= 0:
            partials.release_unwritten(self.fd, holes)
        self._close()
        if not partials.enforce_budget(self.cache, keep=self.partial):
            self._discard()  # again, under the lock: a worker may have saved meanwhile

    def _save_progress(self, force: bool = False) -> None:
        now = time.monotonic()
        with self._progress_lock:
            with self._cond:
                if self._discarded or (not force and now - self._saved_at < PROGRESS_EVERY_S):
                    return
                self._saved_at = now
                record = {"url": self.url, "size": self.size, "key": self.tail.key, "done": self._done.spans()}
            try:
                self.cache.write_bytes(self.progress_path, json.dumps(record).encode())
            except OSError as e:
                logger.warning("%s: cannot save the fetch progress: %s", self.url, e)

    def _discard(self) -> None:
        with self._cond:
            self._discarded = True
        with self._progress_lock:
            partials.discard(self.cache, self.partial)

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


def manifest_path(cache: Confined, key: str) -> Path:
    return cache.path(f"{key}.sha256.json")


def write_manifest(cache: Confined, tail: Tail, url: str, size: int, digests: dict[str, str]) -> None:
    """``<key>.sha256.json`` beside a completed archive: every entry's sha256 as fetched and checked, and the
    URL it came from when the key is bound to it (no index sha256 for every entry)."""
    record = {"key": tail.key, "size": size, "shared": tail.shared, "url": None if tail.shared else url,
              "sha256": dict(sorted(digests.items()))}
    cache.write_bytes(manifest_path(cache, tail.key), json.dumps(record, indent=1).encode())


def cached_sha256(path: str | os.PathLike) -> dict[str, str] | None:
    """{entry: sha256} recorded when the remote-cache file ``path`` was fetched and checked (None: no record).
    For an archive without a complete index these are the only strong hashes of its entries."""
    path = Path(path)
    try:
        record = json.loads(path.with_name(path.name.removesuffix(".dduf") + ".sha256.json").read_text())
    except (OSError, ValueError):
        return None
    digests = record.get("sha256") if isinstance(record, dict) else None
    return dict(digests) if isinstance(digests, dict) else None


class _LocalRanges:
    """A :class:`RangeReader` over a cached file, named by the URL it was fetched from (the key of an
    archive bound to its URL covers the URL)."""

    def __init__(self, url: str, path: Path):
        self.url, self.path, self.size = url, path, path.stat().st_size

    def read(self, offset: int, length: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        if len(data) != length:
            raise DDUFIOError(f"{self.path}: short read at {offset}")
        return data

    def remaining(self) -> float:
        return float("inf")

    def close(self) -> None:
        pass


def _offline_hit(cache: Confined, url: str, record: dict[str, Any]) -> Path | None:
    """The cached file the URL's record names, if its own tail gives the recorded key again for this URL: a
    record written by an older dduf_plus (whose keys did not cover the URL) or pointing at another archive
    finds nothing."""
    key = record.get("key")
    if not (isinstance(key, str) and len(key) == 64 and all(c in "0123456789abcdef" for c in key)):
        return None
    known = cache.path(f"{key}.dduf")
    try:
        if not known.is_file() or known.stat().st_size != record.get("size"):
            return None
        tail = read_tail(_LocalRanges(url, known), record.get("tail_start"))
    except (DDUFError, OSError):
        return None
    return known if tail.key == key else None


def open_remote(url: str, options: RemoteOptions | dict[str, Any] | None = None, *,
                local_files_only: bool = False) -> RemoteFetch | Path:
    """The local file of ``url``'s archive (a :class:`Path` when it is complete in the cache) or a
    started :class:`RemoteFetch` filling it.

    Raises:
        DDUFUsageError: a URL scheme that is not allowed; bad options.
        DDUFNotFoundError: not found (or, offline, not in the cache).
        DDUFValidationError: the archive's tail breaks a ZIP or DDUF rule (nothing is written).
        DDUFIOError, DDUFIntegrityError: the server misbehaves (see the module docstring); the archive does
            not fit the free disk space.
    """
    options = RemoteOptions.of(options)
    cache = Confined(options.folder())
    record = _read_record(cache, url)
    if local_files_only or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        known = _offline_hit(cache, url, record)
        if known is not None:
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


__all__ = ["CacheSource", "RemoteFetch", "RemoteOptions", "cached_sha256", "fetch_archive", "open_remote"]
