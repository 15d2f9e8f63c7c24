"""DDUFWriter: streams entries into an aligned, deterministic ZIP64 archive, atomically.

Each safetensors entry's tensor data section lands on a 4096-byte boundary of the archive (padding
goes in the local header's extra field, the bytes stay the source's); other entries on 64 bytes.
File entries are copied by the kernel (``copy_file_range``) while worker threads read the same
(page-cached) bytes once for sha256 and CRC-32. ``hash_ahead`` opens every source up front and starts
hashing the largest first, so the slowest hash (sha256, ~1.8 GB/s on one core with SHA-NI) overlaps all
the copying instead of starting when its file's turn comes. The CRC slots of local headers are patched
when the hashes are in. Memory stays constant: 16 MiB buffers, no mapping of the source (a source
truncated under a mapping would kill the process with SIGBUS)."""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import DDUFIOError, DDUFPackError, DDUFUsageError
from ..storage.confined import Confined
from ..storage.fd_io import kernel_copy, open_regular, pwrite_all
from . import spec
from .index import FileRecord
from .safetensors_header import read_header_length
from .zipfmt import central_header, check_name, end_records, local_header, local_header_padding

try:  # zlib-ng's CRC-32 runs at ~20 GB/s (vpclmulqdq) against stdlib zlib's ~3 GB/s; same values
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover
    from zlib import crc32

CHUNK = 16 << 20
ProgressFn = Callable[[int], Any]


def check_entry_name(name: str) -> None:
    """Refuse names DDUF forbids, naming the rule."""
    decoded, problems = check_name(name.encode("utf-8", "surrogateescape"), spec.FLAG_UTF8)
    if problems:
        raise DDUFPackError(f"{name!r}: {problems[0].message}")
    if name.count("/") > 1:
        raise DDUFPackError(f"{name!r}: DDUF allows one folder level (no sub-folders)")
    if not name.endswith(spec.ALLOWED_EXTENSIONS):
        raise DDUFPackError(f"{name!r}: file type not allowed in DDUF (only {', '.join(spec.ALLOWED_EXTENSIONS)})")


class DDUFWriter:
    """Write a DDUF archive entry by entry; ``close()`` publishes it atomically.

    Example:
        >>> with DDUFWriter("model.dduf") as w:
        ...     w.add_bytes("model_index.json", b"{...}")
        ...     w.add_file("unet/diffusion_pytorch_model.safetensors", "src/unet/diffusion_pytorch_model.safetensors")

    The archive appears at ``path`` only when the ``with`` block ends without an exception; until then
    it is a hidden temporary file in the same folder (removed on error). ``fsync=False`` keeps the
    atomic rename but skips flushing to disk (as ``cp`` does): faster, but a power cut soon after may
    leave a truncated archive at ``path``."""

    def __init__(self, path: str | os.PathLike, *, progress: ProgressFn | None = None, fsync: bool = True,
                 check: Callable[[Path], Any] | None = None, no_follow: Iterable[str] = ()):
        self.path = Path(path)
        # Entries whose source path is a real path (a planned folder's, checked inside it): opened without
        # following links (O_NOFOLLOW), so a link put in a file's place since the planning is refused
        self._no_follow = frozenset(no_follow)
        self._fsync = fsync
        self._check = check  # called with the finished temporary file before the rename; raising aborts
        # The caller chose the output (the CLI has checked its folder exists, as cp does; the Python API creates
        # it, as save_pretrained does); the temp file beside it is created exclusively and only it is removed
        # on failure (a planted link at any name is never followed).
        parent = self.path.absolute().parent
        if parent.exists() and not parent.is_dir():
            raise DDUFIOError(f"cannot write {self.path}: {parent} is not a folder")
        self._out = Confined(parent).atomic(self.path.name, fsync=fsync, mode=0o644)
        self._fd = self._out.fd
        self._position = 0
        self._central: list[bytes] = []
        self._names: set[str] = set()
        self._records: list[FileRecord] = []
        self._pending: list[tuple] = []
        self._progress = progress
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="dduf-hash")
        self._ahead: dict[str, tuple[int, os.stat_result, Future]] = {}  # name -> (fd, stat at open, digests)
        self._chunks: ThreadPoolExecutor | None = None
        self._expected: dict[str, tuple[int | None, str | None, str]] = {}  # add_region: what its source records
        self._closed = False

    # --- entries -------------------------------------------------------------------------------------
    def _check_open(self, name: str) -> None:
        if self._closed:
            raise DDUFUsageError(f"{name!r}: the DDUFWriter for {self.path} is closed; entries go in before close()")

    def _begin(self, name: str, size: int, inner_offset: int, alignment: int) -> int:
        self._check_open(name)
        check_entry_name(name)
        if name in self._names:
            raise DDUFPackError(f"{name!r}: duplicate entry")
        self._names.add(name)
        encoded = name.encode("utf-8")
        padding = local_header_padding(self._position, len(encoded), inner_offset, alignment)
        header = local_header(encoded, size, 0, padding)
        self._header_offset = self._position
        self._pwrite(header, self._position)
        self._position += len(header)
        return self._position

    def _end(self, name: str, size: int, data_offset: int, digests: Future, source_sha256: str | None) -> None:
        """Finish an entry; ``digests`` resolves to (crc32, sha256 hex) once hashing is done."""
        self._pending.append((name, size, data_offset, self._header_offset, digests, source_sha256))
        self._position = data_offset + size

    @property
    def records(self) -> list[FileRecord]:
        """Every entry written so far (waits for pending hashes, patches their CRC slots)."""
        while self._pending:
            name, size, data_offset, header_offset, digests, source_sha256 = self._pending.pop(0)
            crc, sha256 = digests.result()
            self._check_expected(name, crc, sha256)
            self._pwrite(crc.to_bytes(4, "little"), header_offset + 14)  # CRC slot of the local header
            self._central.append(central_header(name.encode("utf-8"), size, crc, header_offset))
            self._records.append(FileRecord(name, size, data_offset, sha256, crc, source_sha256))
        return list(self._records)

    def _check_expected(self, name: str, crc: int, sha256: str) -> None:
        """A region copied from another archive: its bytes must be what that archive records for them."""
        expected = self._expected.pop(name, None)
        if expected is None:
            return
        want_crc, want_sha, where = expected
        if want_crc is not None and crc != want_crc:
            raise DDUFPackError(f"{where}: H001: CRC-32 {crc:08x} of its bytes differs from the {want_crc:08x} its "
                                "ZIP records give (damaged or changed); nothing is written")
        if want_sha is not None and sha256 != want_sha:
            raise DDUFPackError(f"{where}: H002: sha256 of its bytes differs from its dduf_plus index's; nothing "
                                "is written")

    @staticmethod
    def _alignment_for(name: str, head: bytes | None) -> tuple[int, int]:
        if name.endswith(".safetensors") and head is not None and len(head) >= 8:
            return 8 + read_header_length(head), spec.TENSOR_ALIGNMENT
        return 0, spec.ENTRY_ALIGNMENT

    def add_bytes(self, name: str, data: bytes | bytearray | memoryview, *, source_sha256: str | None = None) -> None:
        """Write ``data`` as entry ``name``; its record joins :attr:`records`."""
        data = memoryview(data).cast("B")
        inner, alignment = self._alignment_for(name, bytes(data[:8]))
        start = self._begin(name, len(data), inner, alignment)
        self._pwrite(data, start)
        self._end(name, len(data), start, _done((crc32(data), hashlib.sha256(data).hexdigest())), source_sha256)

    def hash_ahead(self, files: Iterable[tuple[str, str | os.PathLike]]) -> None:
        """Open ``(entry name, source path)`` pairs now and start their CRC-32 + sha256, largest first; a later
        ``add_file`` of the same name copies from the very file that was hashed."""
        opened = []
        try:
            for name, source in files:
                self._check_open(name)
                fd, st = open_source_file(name, source, name not in self._no_follow)
                opened.append((st, name, fd))
        except BaseException:
            for _st, _name, fd in opened:
                os.close(fd)
            raise
        for st, name, fd in sorted(opened, key=lambda item: -item[0].st_size):
            self._ahead[name] = (fd, st, self._submit_hash(fd, st.st_size, opened=(name, st)))

    def _submit_hash(self, fd: int, size: int, offset: int = 0, opened: tuple[str, os.stat_result] | None = None
                     ) -> Future:
        """CRC-32 + sha256 in a worker, on a duplicate descriptor the job closes (or we do, if cancelled).
        ``opened``: (entry name, stat when opened) of a whole file, checked unchanged once hashed."""
        dup = os.dup(fd)
        future = self._pool.submit(_hash_fd, dup, size, offset, opened)
        future.add_done_callback(lambda f: os.close(dup) if f.cancelled() else None)
        return future

    def add_file(self, name: str, source: str | os.PathLike) -> None:
        """Copy a file's bytes unchanged (kernel copy); CRC-32 and sha256 come from a worker. The source must be
        a regular file (a FIFO is refused, never waited on) and stay unchanged until it is copied and hashed
        (a file rewritten meanwhile is refused: its hash would not be of the bytes copied)."""
        if name in self._ahead:
            src, st, sha = self._ahead.pop(name)
        else:
            src, st = open_source_file(name, source, name not in self._no_follow)
            sha = None
        size = st.st_size
        try:
            inner, alignment = self._alignment_for(name, os.pread(src, 8, 0))
            if name.endswith(".safetensors") and inner > size:
                raise DDUFPackError(f"{name!r}: {source} is not a safetensors file (header length past the end)")
            start = self._begin(name, size, inner, alignment)
            if sha is None:
                sha = self._submit_hash(src, size, opened=(name, st))
            self._copy(src, size, start, name=name)
            check_unchanged(name, src, st)
        except BaseException:
            if sha is not None:
                sha.cancel()
            raise
        finally:
            os.close(src)
        self._end(name, size, start, sha, None)

    def add_region(self, name: str, source: str | os.PathLike, offset: int, length: int, *,
                   crc32: int | None = None, sha256: str | None = None) -> None:
        """Copy bytes ``offset .. offset + length`` of ``source`` (an entry of another archive) unchanged, as
        :meth:`add_file` copies a whole file. ``crc32`` / ``sha256``, when given, are checked against the bytes
        copied once they are hashed (:attr:`records` raises ``DDUFPackError``: H001 / H002)."""
        src, _st = open_source_file(name, source)
        sha: Future | None = None
        try:
            if offset < 0 or length < 0 or offset + length > os.fstat(src).st_size:
                raise DDUFPackError(f"{name!r}: bytes {offset}..{offset + length} are past the end of {source}")
            inner, alignment = self._alignment_for(name, os.pread(src, min(8, length), offset))
            if name.endswith(".safetensors") and inner > length:
                raise DDUFPackError(f"{name!r}: {source} at {offset} is not a safetensors file (header length past its end)")
            start = self._begin(name, length, inner, alignment)
            sha = self._submit_hash(src, length, offset)
            self._copy(src, length, start, offset, name=name)
        except BaseException:
            if sha is not None:
                sha.cancel()
            raise
        finally:
            os.close(src)
        if crc32 is not None or sha256 is not None:
            self._expected[name] = (crc32, sha256, f"{source}#{name}")
        self._end(name, length, start, sha, None)

    def add_chunks(self, name: str, size: int, chunks: Iterable[Any], *, source_sha256: str | None = None) -> None:
        """Stream ``size`` bytes given as buffers (e.g. a safetensors header then each tensor's bytes).
        Hashing of each chunk overlaps the write of the same chunk."""
        chunks = iter(chunks)
        first = memoryview(next(chunks, b"")).cast("B")
        inner, alignment = self._alignment_for(name, bytes(first[:8]))
        start = self._begin(name, size, inner, alignment)
        sha, crc, written = hashlib.sha256(), 0, 0
        for chunk in _chain(first, chunks):
            view = memoryview(chunk).cast("B")
            hashed = self._chunk_pool().submit(sha.update, view)  # overlaps the write of the same bytes
            self._pwrite(view, start + written)
            crc = crc32(view, crc)
            hashed.result()
            written += len(view)
            if self._progress:
                self._progress(len(view))
        if written != size:
            raise DDUFPackError(f"{name!r}: announced {size} bytes, wrote {written}")
        self._end(name, size, start, _done((crc, sha.hexdigest())), source_sha256)

    def _chunk_pool(self) -> ThreadPoolExecutor:
        # apart from the file-hashing workers, so a queue of ``hash_ahead`` jobs never stalls a stream
        if self._chunks is None:
            self._chunks = ThreadPoolExecutor(1, thread_name_prefix="dduf-sha256-stream")
        return self._chunks

    # --- I/O -----------------------------------------------------------------------------------------
    def _pwrite(self, data: Any, offset: int) -> None:
        pwrite_all(self._fd, data, offset)

    def _copy(self, src: int, size: int, dst_offset: int, src_offset: int = 0, name: str = "") -> None:
        done, kernel = 0, True
        buffer: memoryview | None = None
        while done < size:
            n = min(4 * CHUNK, size - done)
            copied = kernel_copy(src, self._fd, n, src_offset + done, dst_offset + done) if kernel else 0
            if copied <= 0:
                kernel = False  # another file system, or none: read + write from here on
                if buffer is None:
                    buffer = memoryview(bytearray(min(CHUNK, size)))
                copied = _pread_into(src, buffer[: min(n, len(buffer))], src_offset + done, repr(name))
                self._pwrite(buffer[:copied], dst_offset + done)
            if self._fsync:
                _start_writeback(self._fd, dst_offset + done, copied)
            done += copied
            if self._progress:
                self._progress(copied)

    # --- lifetime ------------------------------------------------------------------------------------
    def close(self) -> Path:
        """Write the central directory and end records, fsync, and rename into place."""
        if self._closed:
            return self.path
        try:
            return self._publish()
        except BaseException:
            self.abort()  # e.g. a source that shrank while it was hashed: leave nothing behind
            raise

    def _publish(self) -> Path:
        self._drop_ahead()  # hashed ahead but never added
        self.records  # noqa: B018 - wait for hashes, patch CRC slots, build central records
        cd_offset = self._position
        directory = b"".join(self._central)
        self._pwrite(directory + end_records(len(self._central), cd_offset, len(directory)), cd_offset)
        os.ftruncate(self._fd, cd_offset + len(directory) + spec.EOCD64_SIZE + spec.LOCATOR_SIZE + spec.EOCD_SIZE)
        self._shutdown()
        if self._check is not None:
            self._check(self._out.tmp)
        self._fd = -1
        self._out.commit()  # fsync, close, chmod 0644 less umask, rename, fsync the folder
        self._closed = True
        return self.path

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pending in self._pending:
            pending[4].cancel()
        self._drop_ahead()
        self._shutdown(cancel=True)
        self._fd = -1
        self._out.abort()

    def _drop_ahead(self) -> None:
        for fd, _size, sha in self._ahead.values():
            sha.cancel()
            os.close(fd)
        self._ahead.clear()

    def _shutdown(self, cancel: bool = False) -> None:
        self._pool.shutdown(cancel_futures=cancel)
        if self._chunks is not None:
            self._chunks.shutdown(cancel_futures=cancel)

    def __enter__(self) -> DDUFWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _chain(first: Any, rest: Iterable[Any]) -> Iterable[Any]:
    if len(first):
        yield first
    yield from rest


def _load_sync_file_range() -> Callable[[int, int, int], Any] | None:
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
        return lambda fd, offset, length: fn(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE: start, don't wait
    except (OSError, AttributeError):
        return None


_SYNC_FILE_RANGE = _load_sync_file_range() if os.name == "posix" else None


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing copied pages to disk now, so the closing fsync (atomicity) has little left to do."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length)


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def open_source_file(name: str, source: str | os.PathLike, follow_links: bool = True) -> tuple[int, os.stat_result]:
    """``source`` opened to read, with its stat: a regular file only, never waited on (a FIFO put in a planned
    file's place would block a plain open for ever); ``follow_links=False`` refuses a link (``O_NOFOLLOW``).
    ``name`` (the entry, or what the file is) names it in the DDUFPackError. Every reader of a planned source
    opens it so (the writer, conversion, quantization, the identity check)."""
    try:
        opened = open_regular(source, follow_links=follow_links)
    except OSError as e:
        if not follow_links and e.errno == errno.ELOOP:
            raise DDUFPackError(f"{name!r}: {source} became a link since the folder was planned; not followed "
                                "(pack it again)") from None
        raise DDUFPackError(f"{name!r}: cannot read {source}: {e.strerror}") from None
    if opened is None:
        raise DDUFPackError(f"{name!r}: {source} is not a regular file (a FIFO, a device or a folder); not read")
    return opened


def check_unchanged(name: str, fd: int, before: os.stat_result) -> None:
    """Refuse a source whose size or modification changed since it was opened: it was rewritten while packed,
    so the bytes copied and the bytes hashed may differ (an archive every CRC check refuses)."""
    now = os.fstat(fd)
    if (now.st_size, now.st_mtime_ns, now.st_ctime_ns) != (before.st_size, before.st_mtime_ns, before.st_ctime_ns):
        raise DDUFPackError(f"{name!r}: its source changed while it was being packed (size {before.st_size} -> "
                            f"{now.st_size}, or rewritten); nothing is written: pack again once it is complete")


def _pread_into(fd: int, buffer: memoryview, offset: int, name: str = "") -> int:
    n = os.preadv(fd, [buffer], offset)
    if n <= 0:
        raise DDUFPackError(f"{name + ': ' if name else ''}its source changed while it was being packed (it shrank: "
                            f"no byte at {offset}); nothing is written: pack again once it is complete")
    return n


def _hash_fd(fd: int, size: int, offset: int = 0, opened: tuple[str, os.stat_result] | None = None
             ) -> tuple[int, str]:
    """CRC-32 and sha256 of a file's ``size`` bytes from ``offset``, one read pass through a reused buffer;
    closes ``fd``. ``opened``: (entry name, stat when opened), checked unchanged after the pass."""
    try:
        sha, crc, done = hashlib.sha256(), 0, 0
        buffer = memoryview(bytearray(min(CHUNK, max(size, 1))))
        while done < size:
            n = _pread_into(fd, buffer[: min(len(buffer), size - done)], offset + done, repr(opened[0]) if opened else "")
            sha.update(buffer[:n])
            crc = crc32(buffer[:n], crc)
            done += n
        if opened is not None:
            check_unchanged(opened[0], fd, opened[1])
        return crc, sha.hexdigest()
    finally:
        os.close(fd)
