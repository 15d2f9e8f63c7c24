"""One archive being fetched into its local file: :class:`RemoteFetch` (opened by :mod:`.fetch`).

``concurrency`` worker threads read ``chunk_size`` ranges in the order :mod:`.pieces` plans (metadata first,
then the loader's build order, the last pieces cut smaller); each answer is streamed through a small buffer the
thread reuses and written block by block with ``pwrite`` while the block is cache-hot, one writer at a time,
into ``fd``: the partial cache file, or an in-memory file that a writer thread copies into the partial cache
file behind the load (:mod:`.sink` chooses; :mod:`.cache_writes` tracks that writer). Every entry is placed
and hashed as its bytes arrive, in place through a read-only mapping (:mod:`.entries` says what it must
match). The loader waits on it (:meth:`RemoteFetch.wait_range`, :meth:`~RemoteFetch.wait_component`);
:meth:`~RemoteFetch.finish` completes the cache file, and :meth:`~RemoteFetch.abort` stops, keeping a progress
record for a resume unless the archive was refused."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import DDUFError, DDUFIOError
from ..sizes import format_size
from ..storage.confined import Confined
from ..storage.fd_io import copy_range, pwrite_all
from . import partials
from .cache_records import progress_bytes, read_progress, write_manifest
from .cache_writes import track_writer, untrack_writer
from .entries import HASH_BLOCK, Entry, hash_block, make_entries, mismatch, place, public_error, refused
from .intervals import Intervals
from .pieces import PieceQueue
from .readers import RECEIVE_BLOCK, RangeReader, RemoteOptions, read_each
from .sink import ReadMap, in_ram, map_for_reading, memory_file, size_file
from .tail import Tail

logger = logging.getLogger("dduf_plus.remote.transfer")

PROGRESS_EVERY_S = 0.5


@dataclass
class FetchStats:
    """What the client did with the bytes of one fetch (a counting hook: tests and benchmarks read it)."""

    received: int = 0  # body bytes of the range answers the workers received
    written: int = 0  # of those, written into ``fd`` (pwrite from the small receive buffer: the one copy)
    largest_write: int = 0  # the largest block written at once (the receive buffer's size: cache-sized)
    hashed: int = 0  # bytes hashed (sha256, and the CRC-32 where no index sha256 is checked), all entries
    read_back: int = 0  # of those, read back from the file into a buffer first (a copy; mapped: 0)


class _Stopped(Exception):
    """abort() stopped the fetch while a worker was receiving: it ends without recording its piece."""


class RemoteFetch:
    """One archive being fetched (or already complete) in the remote cache.

    ``fd`` is what the archive maps: the partial cache file (``sink="file"``) or an in-memory file
    (``"write-behind"``: written to the partial cache file behind the load; ``"memory"``: ``cache=False``,
    nothing on disk). While ``verified`` is False background threads fill it: :meth:`wait_range` blocks
    until bytes have arrived, :meth:`wait_entries` / :meth:`wait_component` until entries have arrived *and
    matched*, :meth:`finish` until all has (and, with a cache file, the file is complete or being completed
    behind the load), :meth:`abort` stops (keeping the progress for a resume unless the archive was
    refused)."""

    def __init__(self, url: str, options: RemoteOptions, cache: Confined | None, tail: Tail, reader: RangeReader,
                 sink: str = "file"):
        self.url, self.options, self.cache, self.tail, self.reader = url, options, cache, tail, reader
        self.sink = sink if cache is not None else "memory"
        self.size = reader.size
        self.final = cache.path(f"{tail.key}.dduf") if cache is not None else None
        self.partial = cache.path(f"{tail.key}.dduf.partial") if cache is not None else None
        self.progress_path = cache.path(f"{tail.key}.progress.json") if cache is not None else None
        self.complete = False  # the cache file is complete (renamed)
        self.verified = False  # every byte has arrived and matched
        self.path = self.partial
        self.fd = -1  # what the archive maps (the partial file, or the in-memory file)
        self.file_fd = -1  # the partial cache file (-1: none, cache=False)
        self.fetched_bytes = 0
        self.requests = 0
        self.timeline: list[tuple[float, float, int, int]] = []  # (start, end, offset, length) per request
        self._cond = threading.Condition()
        self._done = Intervals()  # bytes that have arrived in ``fd``
        self._written = Intervals()  # bytes in the cache file (write-behind: behind ``_done``)
        self._to_write: deque[tuple[int, int]] = deque()
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stop = False
        self._discarded = False
        self._writing = 0  # workers inside a pwrite
        self._progress_lock = threading.Lock()  # a save in flight ends before a discard removes the files
        self._queue = PieceQueue(options.chunk_size, options.concurrency)
        self._threads: list[threading.Thread] = []
        self._saved_at = 0.0
        self._scratch = threading.local()  # each thread's reused buffers (nothing allocated per piece)
        self._mapped: ReadMap | None = None  # ``fd`` mapped read-only: arrived bytes are hashed in place
        self.stats = FetchStats()
        self._write_lock = threading.Lock()
        self._entries = make_entries(url, tail)
        self._starts = [e.header_offset for e in self._entries]

    # --- setting up ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Check the disk rules, open the partial file (resuming from the progress record) and, unless the
        bytes land in the cache file itself, the in-memory file; write the tail; start the workers."""
        if self.cache is not None and self.partial is not None:
            partials.enforce_budget(self.cache, active=self.partial)
            partials.check_room(self.url, self.cache.root, self.size, self.partial)
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            self.cache.check(self.partial)
            self.file_fd = os.open(self.partial, flags, 0o644)
        try:
            resumed = self._resume() if self.file_fd >= 0 else False
            if self.file_fd >= 0 and self.cache is not None:  # on tmpfs, reserving would allocate (and zero)
                # every page before any byte comes
                size_file(self.file_fd, self.size, reserve=self.sink != "file" or not in_ram(self.cache.root))
            self.fd = self.file_fd if self.sink == "file" else memory_file(self.url, self.size)
            self._mapped = map_for_reading(self.fd, self.size)
            if resumed and self.sink == "write-behind":
                self._load_resumed()
            self._written = Intervals(self._done)
            self._put(self.tail.fetched_at, memoryview(self.tail.fetched))  # the first guess may reach before the tail
            self._queue.plan(self.tail, self._done)
            for entry in self._entries:  # entries already here (a resume, the tail) are hashed locally
                self._advance(entry)
        except BaseException as e:
            self._close_files()
            if refused(e) and self.cache is not None and self.partial is not None:
                partials.discard(self.cache, self.partial)
            raise
        if resumed:
            logger.info("%s: resuming, %d of %d bytes already here", self.url, self._done.total(), self.size)
        self._start_threads()

    def _start_threads(self) -> None:
        for i in range(min(self.options.concurrency, max(1, len(self._queue)))):
            thread = threading.Thread(target=self._work, name=f"dduf-fetch-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.sink == "write-behind":
            # Not a daemon: the interpreter lets it finish the cache file (a disk write, no network) at exit.
            self._writer = threading.Thread(target=self._write_behind, name="dduf-cache-writer")
            track_writer(self.final, self._writer)
            self._writer.start()

    def _resume(self) -> bool:
        """Take over the ranges a progress record lists, when it is this archive's (same key: for an archive
        whose key is bound to its URL, the same URL) and the partial file has the archive's size."""
        assert self.progress_path is not None
        if os.fstat(self.file_fd).st_size != self.size:
            return False
        done = read_progress(self.progress_path, self.size, self.tail.key)
        self._done = Intervals(done)
        return bool(done)

    def _load_resumed(self) -> None:
        """The ranges a resume takes over, copied from the partial file into memory (by the kernel)."""
        for start, end in self._done:
            copy_range(self.file_fd, self.fd, start, end)

    def _put(self, offset: int, data: memoryview) -> None:
        """Bytes that did not come through a worker (the tail): into ``fd``, arrived, queued for the file."""
        pwrite_all(self.fd, data, offset)
        with self._cond:
            self._done.add(offset, offset + len(data))
            if self.sink == "write-behind":
                self._to_write.append((offset, offset + len(data)))
            elif self.sink == "file":
                self._written.add(offset, offset + len(data))

    # --- the workers ---------------------------------------------------------------------------------------------
    def _buffer(self, size: int) -> memoryview:
        """This thread's receive buffer (allocated once, reused for every piece)."""
        buf = getattr(self._scratch, "receive", None)
        if buf is None or len(buf) < size:
            buf = self._scratch.receive = memoryview(bytearray(size))
        return buf[:size]

    def _work(self) -> None:
        while True:
            with self._cond:
                if self._stop or self._error is not None or not self._queue:
                    return
                start, end = self._queue.next()
            try:
                t0 = time.perf_counter()
                # one range request, its body streamed through a small buffer: each block is written while it
                # is still in the CPU's cache (a 16 MiB buffer per thread is not, and was copied from memory)
                read_each(self.reader, start, end - start, self._buffer(RECEIVE_BLOCK), self._write_block)
                self._arrived(start, end, t0, time.perf_counter())
                self._entries_touched(start, end)  # hashed in place (mapped), else read back
                self._save_progress()
            except _Stopped:
                return
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                self._fail(e)
                return

    def _write_block(self, at: int, block: memoryview) -> None:
        """One received block into ``fd`` (``pwrite``: a full disk or memory is an error, never a crash)."""
        with self._cond:
            if self._stop:  # abort() may be releasing the blocks not written yet
                raise _Stopped()
            self._writing += 1
        written = 0
        try:
            with self._write_lock:  # one writer at a time: the others sleep instead of spinning in the kernel
                pwrite_all(self.fd, block, at)
            written = len(block)
        except OSError as e:
            raise DDUFIOError(f"{self.url}: cannot write bytes {at}-{at + len(block) - 1} of the fetched archive "
                              f"into {self.partial or 'memory'}: {e.strerror or e}") from None
        finally:
            with self._cond:
                self._writing -= 1
                self.stats.written += written
                self.stats.largest_write = max(self.stats.largest_write, written)
                if self._stop:  # abort() waits for the writes in flight (no one else waits for a block)
                    self._cond.notify_all()

    def _arrived(self, start: int, end: int, t0: float, t1: float) -> None:
        with self._cond:  # recorded as done at once (abort() computes the holes)
            if self._stop:
                raise _Stopped()
            self.requests += 1
            self.fetched_bytes += end - start
            self.stats.received += end - start
            self.timeline.append((t0, t1, start, end - start))
            self._done.add(start, end)
            if self.sink == "write-behind":
                self._to_write.append((start, end))
            elif self.sink == "file":
                self._written.add(start, end)
            self._cond.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    # --- the cache file behind the load (write-behind) -------------------------------------------------------------
    def _write_behind(self) -> None:
        """Copy what has arrived into the partial cache file (the kernel copies, at the disk's pace), then
        complete it once everything has arrived and matched. A failure here costs the cache, never the load."""
        try:
            while True:
                with self._cond:
                    while not self._to_write and not self._stop and self._error is None and not self._all_ok():
                        self._cond.wait(1.0)
                    if self._stop or self._error is not None:
                        return
                    if not self._to_write:  # everything arrived, matched and written
                        break
                    start, end = self._to_write.popleft()
                copy_range(self.fd, self.file_fd, start, end)
                with self._cond:
                    if self._error is not None:  # perhaps a mismatching entry's bytes: not recorded
                        return
                    self._written.add(start, end)
                self._save_progress()
            self._complete_file()
        except BaseException as e:  # noqa: BLE001 - the pipeline does not need the cache file
            logger.warning("%s: the remote cache file %s could not be written (%s: %s); the loaded pipeline is "
                           "not affected, the next load fetches what is missing", self.url, self.partial,
                           type(e).__name__, e)
            self._save_progress(force=True)
            self._close_file()
        finally:
            untrack_writer(self.final, threading.current_thread())

    def _all_ok(self) -> bool:
        return self._done.covers(0, self.size) and all(e.ok for e in self._entries)

    def wait_written(self, timeout: float | None = None) -> bool:
        """Until the write-behind has completed the cache file (or stopped). Returns whether it is complete."""
        if self._writer is not None:
            self._writer.join(timeout)
        return self.complete

    # --- verification as bytes arrive ----------------------------------------------------------------------------
    def _entries_touched(self, start: int, end: int) -> None:
        i = max(0, bisect_right(self._starts, start) - 1)
        while i < len(self._entries) and self._entries[i].header_offset < end:
            entry = self._entries[i]
            if entry.end > start or entry.offset is None or entry.offset == entry.end:
                self._advance(entry)
            i += 1

    def _advance(self, entry: Entry) -> None:
        """Place ``entry`` once its local header is here, then hash it forward over the bytes that have
        arrived. One thread works on an entry at a time; the others move on (it looks again before it
        lets go)."""
        while not entry.ok:
            if not entry.lock.acquire(blocking=False):
                return
            try:
                if entry.offset is None and not self._place(entry):
                    return
                self._hash_arrived(entry)
                if entry.upto >= entry.end:
                    self._check(entry)
                    return
            finally:
                entry.lock.release()
            with self._cond:
                if self._done.reach(entry.upto) <= entry.upto:
                    return

    def _place(self, entry: Entry) -> bool:
        """Place ``entry`` by its local header, once that has arrived (:func:`.entries.place` checks it)."""
        with self._cond:
            if not self._done.covers(entry.header_offset, entry.head_end):
                return False
        head = os.pread(self.fd, entry.head_end - entry.header_offset, entry.header_offset)
        place(entry, head, self.url, self.tail.cd_offset)
        return True

    def _hash_arrived(self, entry: Entry) -> None:
        """Hash ``entry`` from ``upto`` over every byte that has arrived, once: in place in the mapped file
        (then let go of those pages), else read back from ``fd`` into this thread's hash buffer."""
        hashed = copied = 0
        while entry.upto < entry.end:
            with self._cond:
                reach = min(entry.end, self._done.reach(entry.upto))
            if reach <= entry.upto:
                break
            while entry.upto < reach:
                at = entry.upto
                block, was_copied = self._read_back(at, min(HASH_BLOCK, reach - at))
                hash_block(entry, block)
                if was_copied:
                    copied += len(block)
                elif self._mapped is not None:
                    self._mapped.forget(at, at + len(block))
                hashed += len(block)
        with self._cond:
            self.stats.hashed += hashed
            self.stats.read_back += copied

    def _read_back(self, offset: int, length: int) -> tuple[memoryview, bool]:
        """Bytes that arrived earlier, to hash: in place in the mapped file (False: not copied), else copied
        into this thread's hash buffer (True)."""
        mapped = self._mapped.window(offset, offset + length) if self._mapped is not None else None
        if mapped is not None:
            return mapped, False
        buf = getattr(self._scratch, "hash", None)
        if buf is None:
            buf = self._scratch.hash = memoryview(bytearray(HASH_BLOCK))
        got = os.preadv(self.fd, [buf[:length]], offset)
        if got != length:
            raise DDUFIOError(f"{self.url}: short read of the local copy at byte {offset}")
        return buf[:length], True

    def _check(self, entry: Entry) -> None:
        """``entry`` hashed to its end: matched (its sha256 recorded), or the fetch fails and a resume
        fetches its bytes again."""
        digest = entry.hasher.hexdigest()
        error = mismatch(entry, self.url, digest)
        if error is not None:
            with self._cond:  # at once: the writer records nothing of it as written after this
                for spans in (self._done, self._written):  # a resume fetches it again
                    spans.remove(entry.offset or entry.header_offset, entry.end)
                self._error = self._error or error
                self._cond.notify_all()
            return
        with self._cond:
            entry.digest, entry.ok = digest, True
            self._cond.notify_all()

    # --- waiting ---------------------------------------------------------------------------------------------------
    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        with self._cond:
            while not ready():
                if self._error is not None:
                    raise public_error(self._error)
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
        ranked: list[tuple[int, int, int]] = []  # (start, end, rank)
        for i, name in enumerate(components):
            ranked += [(e.header_offset, e.end, i) for e in self._entries if e.name.startswith(name + "/")]
        with self._cond:
            self._queue.prioritize(ranked, len(components))

    def wait_component(self, component: str) -> None:
        """Until every entry of ``component``'s folder has arrived and matched: its tensors view only
        checked bytes (an archive without an index too: its entries come from the central directory)."""
        if not self.verified:
            prefix = component + "/"
            self.wait_entries([e.name for e in self._entries if e.name.startswith(prefix)])

    def entry_sha256(self) -> dict[str, str]:
        """{entry: sha256} of the entries checked so far (every entry once :meth:`finish` returned)."""
        with self._cond:
            return {e.name: e.digest for e in self._entries if e.ok and e.digest is not None}

    # --- ending ---------------------------------------------------------------------------------------------------------
    def finish(self) -> Path | None:
        """Wait until everything has arrived and matched. ``sink="file"``: record every entry's sha256 and
        rename the file complete; ``"write-behind"``: the writer does that once the disk has caught up (see
        :meth:`wait_written`); ``"memory"``: nothing is kept (None)."""
        if self.verified:
            return self.final
        self._wait(self._all_ok, "the archive")
        for thread in self._threads:
            thread.join()
        self.reader.close()
        if self._mapped is not None:  # the loader maps the file on its own
            self._mapped.close()
        self.verified = True
        if self.sink == "file":
            self._complete_file()
        elif self.sink == "write-behind" and not self.complete:
            with self._cond:
                behind = self.size - self._written.total()
            if behind:
                logger.info("%s: loaded from memory; %s are still being written to the remote cache %s",
                            self.url, format_size(behind), self.partial)
        logger.info("%s: fetched %d bytes in %d requests", self.url, self.fetched_bytes, self.requests)
        return self.final

    def _complete_file(self) -> None:
        """Every entry's sha256 recorded, the partial file renamed complete, the progress record removed."""
        assert self.cache is not None and self.partial is not None and self.final is not None
        write_manifest(self.cache, self.tail, self.url, self.size, self.entry_sha256())
        try:
            self.cache.replace(self.partial, self.final)
        except FileNotFoundError:  # another process fetching the same archive finished first
            if not self.final.is_file():
                raise DDUFIOError(f"{self.url}: the partial cache file {self.partial} vanished") from None
        if self.progress_path is not None:
            self.cache.unlink(self.progress_path)
        self.complete, self.path = True, self.final
        if self.sink == "file":
            self._close_files()
        else:
            self._close_file()

    def _close_file(self) -> None:
        with self._cond:
            fd, self.file_fd = self.file_fd, -1
        if fd >= 0:
            os.close(fd)

    def abort(self, error: BaseException | None = None) -> None:
        """Stop the workers (their requests end within the timeout). ``error`` (default: the exception
        being handled) says why: a refused archive leaves nothing; otherwise the progress is kept for a
        resume, the blocks nothing was written to are released, and the kept partials' budget applies."""
        error = error if error is not None else sys.exc_info()[1]
        with self._cond:
            self._stop = True
            already = self._discarded
            self._discarded = already or refused(error)
            self._cond.notify_all()
            while self._writing:  # a write in flight lands before the unwritten blocks are computed
                self._cond.wait(0.1)
        if self._writer is not None:
            self._writer.join()  # its copy in flight ends (one piece); it keeps its progress
        if self.complete or already or self.cache is None or self.partial is None:
            self.reader.close()
            return
        if self._discarded:
            self._discard()
            self._close_files()
            return
        self._save_progress(force=True)
        with self._cond:
            holes = list(Intervals([(0, self.size)]).minus(self._written))
        if self.file_fd >= 0:
            partials.release_unwritten(self.file_fd, holes)
        self._close_files()
        if not partials.enforce_budget(self.cache, keep=self.partial):
            self._discard()  # again, under the lock: a worker may have saved meanwhile

    def _save_progress(self, force: bool = False) -> None:
        if self.cache is None or self.progress_path is None:
            return
        now = time.monotonic()
        with self._progress_lock:
            with self._cond:
                if self._discarded or self.complete or (not force and now - self._saved_at < PROGRESS_EVERY_S):
                    return
                self._saved_at = now
                record = progress_bytes(self.url, self.size, self.tail.key, self._written.spans())
            try:
                self.cache.write_bytes(self.progress_path, record)
            except OSError as e:
                logger.warning("%s: cannot save the fetch progress: %s", self.url, e)

    def _discard(self) -> None:
        with self._cond:
            self._discarded = True
        with self._progress_lock:
            if self.cache is not None and self.partial is not None:
                partials.discard(self.cache, self.partial)

    def _close_files(self) -> None:
        """Close the partial file (unless the writer still uses it); the archive's own fd (in memory) is
        closed when this fetch is collected: mappings taken from it stay valid."""
        self.reader.close()
        if any(t.is_alive() for t in self._threads) or (self._writer is not None and self._writer.is_alive()):
            return
        with self._cond:
            fd, self.file_fd = self.file_fd, -1
            if self.fd == fd:
                self.fd = -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        fds = {getattr(self, "file_fd", -1)} | ({getattr(self, "fd", -1)} if getattr(self, "sink", "") != "file" else set())
        for fd in fds - {-1}:
            try:
                os.close(fd)
            except OSError:
                pass

