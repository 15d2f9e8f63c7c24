"""DDUFWriter: streams entries into an aligned, deterministic ZIP64 archive, atomically.

Each safetensors entry's tensor data section lands on a 4096-byte boundary of the archive (padding
goes in the local header's extra field, the bytes stay the source's); other entries on 64 bytes.
File entries are copied by the kernel (``copy_file_range``) while two threads compute sha256 and
CRC-32 over the same pages, so one pass does all three."""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import DDUFPackError
from . import spec
from .index import FileRecord
from .safetensors_header import read_header_length
from .zipfmt import central_header, check_name, end_records, local_header, local_header_padding

CHUNK = 64 << 20
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
    it is a hidden temporary file in the same folder (removed on error)."""

    def __init__(self, path: str | os.PathLike, *, progress: ProgressFn | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".partial", dir=self.path.parent)
        self._fd, self._tmp = fd, Path(tmp)
        self._position = 0
        self._central: list[bytes] = []
        self._names: set[str] = set()
        self.records: list[FileRecord] = []
        self._progress = progress
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="dduf-hash")
        self._closed = False

    # --- entries -------------------------------------------------------------------------------------
    def _begin(self, name: str, size: int, inner_offset: int, alignment: int) -> int:
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

    def _end(self, name: str, size: int, data_offset: int, crc: int, sha256: str, source_sha256: str | None) -> FileRecord:
        os.pwrite(self._fd, crc.to_bytes(4, "little"), self._header_offset + 14)  # CRC slot of the local header
        self._central.append(central_header(name.encode("utf-8"), size, crc, self._header_offset))
        self._position = data_offset + size
        record = FileRecord(name, size, data_offset, sha256, crc, source_sha256)
        self.records.append(record)
        return record

    @staticmethod
    def _alignment_for(name: str, head: bytes | None) -> tuple[int, int]:
        if name.endswith(".safetensors") and head is not None and len(head) >= 8:
            return 8 + read_header_length(head), spec.TENSOR_ALIGNMENT
        return 0, spec.ENTRY_ALIGNMENT

    def add_bytes(self, name: str, data: bytes | bytearray | memoryview, *, source_sha256: str | None = None) -> FileRecord:
        data = memoryview(data).cast("B")
        inner, alignment = self._alignment_for(name, bytes(data[:8]))
        start = self._begin(name, len(data), inner, alignment)
        self._pwrite(data, start)
        return self._end(name, len(data), start, zlib.crc32(data), hashlib.sha256(data).hexdigest(), source_sha256)

    def add_file(self, name: str, source: str | os.PathLike) -> FileRecord:
        """Copy a file's bytes unchanged; sha256 and CRC-32 are computed in the same pass."""
        try:
            src = os.open(source, os.O_RDONLY)
        except OSError as e:
            raise DDUFPackError(f"{name!r}: cannot read {source}: {e.strerror}") from None
        try:
            size = os.fstat(src).st_size
            inner, alignment = self._alignment_for(name, os.pread(src, 8, 0))
            if name.endswith(".safetensors") and inner > size:
                raise DDUFPackError(f"{name!r}: {source} is not a safetensors file (header length past the end)")
            start = self._begin(name, size, inner, alignment)
            if size == 0:
                return self._end(name, 0, start, 0, hashlib.sha256().hexdigest(), None)
            with mmap.mmap(src, size, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    sha = self._pool.submit(_sha256, view)
                    crc = self._pool.submit(_crc32, view)
                    self._copy(src, view, size, start)
                    return self._end(name, size, start, crc.result(), sha.result(), None)
                finally:
                    view.release()
        finally:
            os.close(src)

    def add_chunks(self, name: str, size: int, chunks: Iterable[Any], *, source_sha256: str | None = None) -> FileRecord:
        """Stream ``size`` bytes given as buffers (e.g. a safetensors header then each tensor's bytes).
        Hashing of each chunk overlaps the write of the same chunk."""
        chunks = iter(chunks)
        first = memoryview(next(chunks, b"")).cast("B")
        inner, alignment = self._alignment_for(name, bytes(first[:8]))
        start = self._begin(name, size, inner, alignment)
        sha, crc, written = hashlib.sha256(), 0, 0
        for chunk in _chain(first, chunks):
            view = memoryview(chunk).cast("B")
            hashed = self._pool.submit(sha.update, view)
            crc_future = self._pool.submit(zlib.crc32, view, crc)
            self._pwrite(view, start + written)
            hashed.result()
            crc = crc_future.result()
            written += len(view)
            if self._progress:
                self._progress(len(view))
        if written != size:
            raise DDUFPackError(f"{name!r}: announced {size} bytes, wrote {written}")
        return self._end(name, size, start, crc, sha.hexdigest(), source_sha256)

    # --- I/O -----------------------------------------------------------------------------------------
    def _pwrite(self, data: Any, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    def _copy(self, src: int, view: memoryview, size: int, dst_offset: int) -> None:
        done = 0
        copy_range = getattr(os, "copy_file_range", None)
        while done < size:
            n = min(CHUNK, size - done)
            copied = 0
            if copy_range is not None:
                try:
                    copied = copy_range(src, self._fd, n, done, dst_offset + done)
                except OSError:
                    copy_range = None  # cross-device or unsupported: fall back to writes from the map
            if copied <= 0:
                self._pwrite(view[done : done + n], dst_offset + done)
                copied = n
            done += copied
            if self._progress:
                self._progress(copied)

    # --- lifetime ------------------------------------------------------------------------------------
    def close(self) -> Path:
        """Write the central directory and end records, fsync, and rename into place."""
        if self._closed:
            return self.path
        cd_offset = self._position
        directory = b"".join(self._central)
        self._pwrite(directory + end_records(len(self._central), cd_offset, len(directory)), cd_offset)
        os.ftruncate(self._fd, cd_offset + len(directory) + spec.EOCD64_SIZE + spec.LOCATOR_SIZE + spec.EOCD_SIZE)
        os.fsync(self._fd)
        os.close(self._fd)
        self._pool.shutdown()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self._tmp, 0o644 & ~umask)
        os.replace(self._tmp, self.path)
        _fsync_dir(self.path.parent)
        self._closed = True
        return self.path

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(cancel_futures=True)
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._tmp.unlink(missing_ok=True)

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


def _sha256(view: memoryview) -> str:
    h = hashlib.sha256()
    for at in range(0, len(view), CHUNK):
        h.update(view[at : at + CHUNK])
    return h.hexdigest()


def _crc32(view: memoryview) -> int:
    crc = 0
    for at in range(0, len(view), CHUNK):
        crc = zlib.crc32(view[at : at + CHUNK], crc)
    return crc


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
