"""zstd transport for DDUF archives: ``X.dduf`` <-> ``X.dduf.zst``.

A DDUF archive is STORED (uncompressed) so that it can be memory-mapped; for transfer and storage a
zstd stream is smaller. The stream this module writes is plain zstd that any ``zstd -d`` decodes, laid out
so that it can be decompressed in parallel and checked for truncation:

    [header]  skippable frame (magic 0x184D2A50): b"DDUF+ZST", version, total size, frame size
    [frame]*  independent zstd frames, one per ``frame_size`` bytes of input, each with its content size
              and XXH64 content checksum (the decoder verifies it)
    [table]   zstd "seekable format" seek table (skippable frame 0x184D2A5E + footer, magic 0x8F92EAB1):
              compressed and decompressed size of every frame above (the header frame included, as 0 bytes)

Because frames are independent and the table gives each one's offsets, :func:`decompress` hands frames to
a thread pool that ``pwrite``s them into a preallocated file. Memory is constant: a few MiB of buffers and
the zstd window per thread, whatever the archive size. Streams without the table (written by the ``zstd``
CLI, say) are decompressed sequentially.

:func:`cached_decompress` decompresses once into a cache keyed by the sha256 of the ``.zst`` file (the
same value as its Hub LFS oid) and returns the plain archive, which loaders then mmap as usual.

Only ``zstandard`` and the standard library are imported here (no torch)."""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import DDUFError, DDUFFormatError, DDUFIntegrityError
from .writer import _fsync_dir

logger = logging.getLogger("dduf_plus")

MiB = 1 << 20
DEFAULT_LEVEL = 3
DEFAULT_FRAME_SIZE = 256 * MiB
IO_CHUNK = 8 * MiB  # read/write buffer per thread
LONG_WINDOW_LOG = 27  # 128 MiB: the largest window `zstd -d` accepts without --long (ZSTD_WINDOWLOG_LIMIT_DEFAULT)

SKIPPABLE_HEADER_MAGIC = 0x184D2A50
SKIPPABLE_SEEK_TABLE_MAGIC = 0x184D2A5E
SEEKABLE_MAGIC = 0x8F92EAB1
SEEK_FOOTER_SIZE = 9  # u32 number of frames, u8 descriptor, u32 magic
SEEK_ENTRY = struct.Struct("<II")  # compressed size, decompressed size (no per-entry checksum: frames carry one)
HEADER_TAG = b"DDUF+ZST"
HEADER_PAYLOAD = struct.Struct("<8sIQQ")  # tag, version, total decompressed size, frame size
HEADER_VERSION = 1
HEADER_FRAME_SIZE = 8 + HEADER_PAYLOAD.size
MAX_FRAMES = 1 << 20  # bound what we trust from a seek table before allocating for it

CACHE_ENV = "DDUF_PLUS_CACHE"
_SHA256_BLOB = re.compile(r"^[0-9a-f]{64}$")


class Frame(NamedTuple):
    offset: int  # in the compressed file
    compressed_size: int
    output_offset: int  # in the decompressed archive
    size: int  # decompressed bytes


class StreamLayout(NamedTuple):
    total_size: int | None  # from the header frame; None for foreign streams
    frame_size: int | None
    frames: list[Frame] | None  # None when the stream has no seek table


class ZstResult(NamedTuple):
    path: Path
    input_bytes: int
    output_bytes: int
    frames: int
    seconds: float


# --- helpers -----------------------------------------------------------------------------------------


def is_zst(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a zstd-compressed archive (by suffix, like ``X.dduf.zst``)."""
    return os.fspath(path).endswith(".zst")


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:  # a declared dependency; only a broken install gets here
        raise DDUFError("the zstandard package is needed for .zst archives: pip install zstandard") from None
    return zstandard


def _threads(threads: int | None) -> int:
    if threads is None or threads < 1:
        return os.cpu_count() or 1
    return threads


def _pread_exact(fd: int, length: int, offset: int, name: str) -> bytes:
    parts, want = [], length
    while want:
        chunk = os.pread(fd, want, offset)
        if not chunk:
            raise DDUFFormatError(f"{name}: truncated zstd stream (read past the end at {offset})")
        parts.append(chunk)
        offset += len(chunk)
        want -= len(chunk)
    return b"".join(parts)


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


@contextmanager
def _atomic_output(dst: Path) -> Iterator[int]:
    """A temporary file beside ``dst``, renamed over it after fsync when the block succeeds, removed
    otherwise: readers never see a half-written archive."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent)
    try:
        yield fd
        os.fsync(fd)
        os.close(fd)
        fd = -1
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o644 & ~umask)
        os.replace(tmp, dst)
        _fsync_dir(dst.parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _open_input(src: Path) -> tuple[int, int]:
    try:
        fd = os.open(src, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise DDUFError(f"cannot open {src}: {e.strerror}") from None
    return fd, os.fstat(fd).st_size


def _progress(total: int, desc: str, quiet: bool) -> Any:
    from .pack import progress_bar  # huggingface_hub's tqdm, silent off a TTY

    return progress_bar(total, desc, quiet)


# --- compress ----------------------------------------------------------------------------------------


def _header_frame(total: int, frame_size: int) -> bytes:
    payload = HEADER_PAYLOAD.pack(HEADER_TAG, HEADER_VERSION, total, frame_size)
    return struct.pack("<II", SKIPPABLE_HEADER_MAGIC, len(payload)) + payload


def _seek_table(entries: list[tuple[int, int]]) -> bytes:
    body = b"".join(SEEK_ENTRY.pack(c, d) for c, d in entries)
    footer = struct.pack("<IBI", len(entries), 0, SEEKABLE_MAGIC)
    return struct.pack("<II", SKIPPABLE_SEEK_TABLE_MAGIC, len(body) + len(footer)) + body + footer


def compress(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    level: int = DEFAULT_LEVEL,
    threads: int = -1,
    frame_size: int = DEFAULT_FRAME_SIZE,
    long: bool = False,
    quiet: bool = False,
) -> ZstResult:
    """zstd-compress ``src`` (any file; a ``.dduf`` archive in practice) into ``dst``, atomically.

    The input is cut into independent frames of ``frame_size`` bytes so that decompression can run them in
    parallel; each frame is compressed by ``threads`` zstd worker threads (-1: one per CPU) and carries its
    content size and checksum. ``long`` enables long-distance matching with a 128 MiB window (better ratio
    on archives with repeated tensors; still decodable by a plain ``zstd -d``). Memory stays constant.

    Example:
        >>> compress("sd15.dduf", "sd15.dduf.zst", level=3)
        ZstResult(path=PosixPath('sd15.dduf.zst'), input_bytes=2133..., output_bytes=19..., frames=9, ...)

    Raises:
        DDUFError: ``src`` cannot be read, or ``dst`` is ``src``.
    """
    zstd = _zstd()
    src, dst = Path(src), Path(dst)
    if _same_file(src, dst):
        raise DDUFError(f"{dst}: output would overwrite the input")
    if frame_size < MiB or frame_size >= 1 << 32:
        raise DDUFError(f"frame size {frame_size} must be between 1 MiB and 4 GiB")
    if not zstd.MAX_COMPRESSION_LEVEL >= level >= -(1 << 17):
        raise DDUFError(f"zstd level {level} is out of range (max {zstd.MAX_COMPRESSION_LEVEL})")
    started = time.perf_counter()
    params = zstd.ZstdCompressionParameters.from_level(
        level, threads=_threads(threads), write_checksum=True, write_content_size=True,
        **({"enable_ldm": True, "window_log": LONG_WINDOW_LOG} if long else {}),
    )
    cctx = zstd.ZstdCompressor(compression_params=params)
    fd_in, total = _open_input(src)
    bar = _progress(total, dst.name, quiet)
    buffer = bytearray(IO_CHUNK)
    try:
        with _atomic_output(dst) as fd_out:
            position = 0
            header = _header_frame(total, frame_size)
            _pwrite_all(fd_out, header, position)
            position += len(header)
            entries = [(len(header), 0)]
            for frame_start in range(0, total, frame_size):
                frame_len = min(frame_size, total - frame_start)
                cobj = cctx.compressobj(size=frame_len)  # a fresh frame: independent of the others
                written = 0
                done = 0
                while done < frame_len:
                    n = os.preadv(fd_in, [memoryview(buffer)[: min(IO_CHUNK, frame_len - done)]], frame_start + done)
                    if n <= 0:
                        raise DDUFError(f"{src}: file shrank while compressing")
                    out = cobj.compress(memoryview(buffer)[:n])
                    _pwrite_all(fd_out, out, position + written)
                    written += len(out)
                    done += n
                    bar.update(n)
                out = cobj.flush(zstd.COMPRESSOBJ_FLUSH_FINISH)
                _pwrite_all(fd_out, out, position + written)
                written += len(out)
                position += written
                entries.append((written, frame_len))
            table = _seek_table(entries)
            _pwrite_all(fd_out, table, position)
            position += len(table)
            os.ftruncate(fd_out, position)
    finally:
        bar.close()
        os.close(fd_in)
    return ZstResult(dst, total, position, len(entries) - 1, time.perf_counter() - started)


# --- layout ------------------------------------------------------------------------------------------


def read_layout(fd: int, size: int, name: str = "<stream>") -> StreamLayout:
    """Parse the header frame and seek table of a stream, checking every number against the file size.

    Raises:
        DDUFFormatError: a dduf_plus stream whose seek table is missing (truncated) or inconsistent.
    """
    zstd = _zstd()
    total = frame_size = None
    if size >= HEADER_FRAME_SIZE:
        head = os.pread(fd, HEADER_FRAME_SIZE, 0)
        magic, length = struct.unpack_from("<II", head)
        if magic == SKIPPABLE_HEADER_MAGIC and length == HEADER_PAYLOAD.size and head[8:16] == HEADER_TAG:
            _tag, version, total, frame_size = HEADER_PAYLOAD.unpack_from(head, 8)
            if version > HEADER_VERSION:
                logger.info("%s: zstd header version %d is newer than this reader's; decoding anyway", name, version)
    magic = int.from_bytes(os.pread(fd, 4, 0), "little") if size >= 4 else None
    if magic != zstd.MAGIC_NUMBER and (magic is None or not _is_skippable(magic)):
        raise DDUFFormatError(f"{name}: not a zstd stream (bad magic number)")
    frames = _read_seek_table(fd, size, name)
    if frames is None:
        if total is not None:
            raise DDUFFormatError(f"{name}: truncated zstd stream (its seek table is missing)")
        return StreamLayout(None, None, None)
    decoded = sum(f.size for f in frames)
    if total is not None and decoded != total:
        raise DDUFFormatError(f"{name}: seek table covers {decoded} bytes, header announces {total}")
    return StreamLayout(total if total is not None else decoded, frame_size, frames)


def _read_seek_table(fd: int, size: int, name: str) -> list[Frame] | None:
    if size < SEEK_FOOTER_SIZE + 8:
        return None
    count, descriptor, magic = struct.unpack("<IBI", os.pread(fd, SEEK_FOOTER_SIZE, size - SEEK_FOOTER_SIZE))
    if magic != SEEKABLE_MAGIC:
        return None
    entry_size = SEEK_ENTRY.size + (4 if descriptor & 0x80 else 0)
    table_size = 8 + count * entry_size + SEEK_FOOTER_SIZE
    if descriptor & 0x7C or count > MAX_FRAMES or table_size > size:
        raise DDUFFormatError(f"{name}: malformed zstd seek table ({count} frames, descriptor {descriptor:#x})")
    raw = _pread_exact(fd, table_size, size - table_size, name)
    magic, length = struct.unpack_from("<II", raw)
    if magic != SKIPPABLE_SEEK_TABLE_MAGIC or length != table_size - 8:
        raise DDUFFormatError(f"{name}: zstd seek table frame header is inconsistent")
    frames, offset, out_offset = [], 0, 0
    for i in range(count):
        csize, dsize = SEEK_ENTRY.unpack_from(raw, 8 + i * entry_size)
        frames.append(Frame(offset, csize, out_offset, dsize))
        offset += csize
        out_offset += dsize
    if offset != size - table_size:
        raise DDUFFormatError(f"{name}: seek table frames cover {offset} bytes, stream has {size - table_size}")
    return frames


# --- decompress --------------------------------------------------------------------------------------


class _RangeReader:
    """File-like view of ``length`` bytes at ``offset`` of a descriptor (for zstd's stream_reader)."""

    def __init__(self, fd: int, offset: int, length: int, on_read: Callable[[bytes], None] | None = None):
        self.fd, self.position, self.end = fd, offset, offset + length
        self.on_read = on_read

    def read(self, size: int = -1) -> bytes:
        remaining = self.end - self.position
        size = remaining if size < 0 else min(size, remaining)
        if size <= 0:
            return b""
        data = os.pread(self.fd, size, self.position)
        self.position += len(data)
        if self.on_read is not None:
            self.on_read(data)
        return data


def _decode_into(reader: Any, fd_out: int, out_offset: int, limit: int | None, buffer: bytearray,
                 progress: Callable[[int], Any]) -> int:
    """Copy decompressed bytes from ``reader`` to ``fd_out`` at ``out_offset``; returns the count. Reads
    at most ``limit + 1`` bytes so an overlong frame is noticed without decoding it all."""
    view = memoryview(buffer)
    written = 0
    while True:
        want = len(view) if limit is None else min(len(view), limit + 1 - written)
        if want <= 0:
            return written
        n = reader.readinto(view[:want])
        if not n:
            return written
        _pwrite_all(fd_out, view[:n], out_offset + written)
        written += n
        progress(n)


def decompress(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    threads: int = -1,
    quiet: bool = False,
) -> ZstResult:
    """Decompress ``src`` (a ``.dduf.zst``) into ``dst``, atomically, byte-exact.

    Frames listed in the seek table are decoded by ``threads`` threads in parallel (-1: one per CPU), each
    writing at its frame's offset; every frame's content checksum is verified by zstd and its size checked
    against the table, so a truncated or corrupted stream raises instead of leaving a short archive.

    Example:
        >>> decompress("sd15.dduf.zst", "sd15.dduf")

    Raises:
        DDUFFormatError: not a zstd stream, truncated, or inconsistent frames.
        DDUFIntegrityError: a frame's content checksum does not match (corrupted data).
    """
    zstd = _zstd()
    src, dst = Path(src), Path(dst)
    if _same_file(src, dst):
        raise DDUFError(f"{dst}: output would overwrite the input")
    started = time.perf_counter()
    fd_in, size = _open_input(src)
    try:
        layout = read_layout(fd_in, size, str(src))
        bar = _progress(layout.total_size or size, dst.name, quiet)
        lock = threading.Lock()

        def progress(n: int) -> None:
            with lock:
                bar.update(n)

        try:
            with _atomic_output(dst) as fd_out:
                if layout.frames is None:
                    total = _decompress_sequential(zstd, fd_in, size, fd_out, progress, str(src))
                else:
                    total = layout.total_size or 0
                    os.ftruncate(fd_out, total)  # frames then fill their slices in any order
                    _decompress_frames(zstd, fd_in, fd_out, layout.frames, _threads(threads), progress, str(src))
        finally:
            bar.close()
        frames = len([f for f in layout.frames or [] if f.size]) or 1
    finally:
        os.close(fd_in)
    return ZstResult(dst, size, total, frames, time.perf_counter() - started)


def _zstd_failure(name: str, where: str, error: Exception) -> DDUFError:
    message = str(error)
    if "checksum" in message:
        return DDUFIntegrityError(f"{name}: {where}: content checksum mismatch (the file is corrupted)")
    return DDUFFormatError(f"{name}: {where}: corrupt zstd data ({message})")


def _decompress_frames(zstd: Any, fd_in: int, fd_out: int, frames: list[Frame], threads: int,
                       progress: Callable[[int], Any], name: str) -> None:
    def one(index: int, frame: Frame) -> None:
        if frame.size == 0:  # the header frame (skippable), or an empty input
            return
        head = os.pread(fd_in, 18, frame.offset)
        try:
            params = zstd.get_frame_parameters(head)
        except zstd.ZstdError as e:
            raise _zstd_failure(name, f"frame {index}", e) from None
        if params.content_size not in (frame.size, zstd.CONTENTSIZE_UNKNOWN):
            raise DDUFFormatError(f"{name}: frame {index} holds {params.content_size} bytes, seek table says {frame.size}")
        # A fresh context per frame: zstd contexts are not thread-safe.
        reader = zstd.ZstdDecompressor().stream_reader(
            _RangeReader(fd_in, frame.offset, frame.compressed_size), read_size=IO_CHUNK, read_across_frames=False)
        try:
            written = _decode_into(reader, fd_out, frame.output_offset, frame.size, bytearray(IO_CHUNK), progress)
        except zstd.ZstdError as e:
            raise _zstd_failure(name, f"frame {index}", e) from None
        if written != frame.size:
            raise DDUFFormatError(f"{name}: frame {index} decoded to {written} bytes, expected {frame.size} "
                                  "(truncated or corrupted stream)")

    work = [(i, f) for i, f in enumerate(frames) if f.size]
    if threads <= 1 or len(work) <= 1:
        for i, f in work:
            one(i, f)
        return
    with ThreadPoolExecutor(min(threads, len(work)), thread_name_prefix="dduf-unzstd") as pool:
        futures = [pool.submit(one, i, f) for i, f in work]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _decompress_sequential(zstd: Any, fd_in: int, size: int, fd_out: int, progress: Callable[[int], Any],
                           name: str) -> int:
    """Streams without a seek table (e.g. from the zstd CLI): one pass over every frame, after checking
    that the frames tile the file (zstd itself reports a stream cut inside a frame only as an early end)."""
    _walk_frames(zstd, fd_in, size, name)
    reader = zstd.ZstdDecompressor().stream_reader(_RangeReader(fd_in, 0, size), read_size=IO_CHUNK,
                                                   read_across_frames=True)
    try:
        return _decode_into(reader, fd_out, 0, None, bytearray(IO_CHUNK), progress)
    except zstd.ZstdError as e:
        raise _zstd_failure(name, "stream", e) from None


def _is_skippable(magic: int) -> bool:
    return magic & 0xFFFFFFF0 == 0x184D2A50


def _walk_frames(zstd: Any, fd: int, size: int, name: str) -> list[tuple[int, int]]:
    """(offset, compressed size) of every frame, found from frame and block headers alone (3 bytes read
    per block of up to 128 KiB): proves the stream is not truncated without decoding it.

    Raises:
        DDUFFormatError: a frame or block runs past the end of the file, or a header is malformed.
    """
    frames, offset = [], 0
    while offset < size:
        head = os.pread(fd, 18, offset)  # 18: the largest zstd frame header
        if len(head) < 8:
            raise DDUFFormatError(f"{name}: truncated zstd stream (partial frame header at {offset})")
        magic = int.from_bytes(head[:4], "little")
        if _is_skippable(magic):
            length = 8 + int.from_bytes(head[4:8], "little")
        elif magic == zstd.MAGIC_NUMBER:
            try:
                length = zstd.frame_header_size(head)
                has_checksum = zstd.get_frame_parameters(head).has_checksum
            except zstd.ZstdError as e:
                raise DDUFFormatError(f"{name}: malformed zstd frame header at {offset} ({e})") from None
            while True:
                block = os.pread(fd, 3, offset + length)
                if len(block) < 3:
                    raise DDUFFormatError(f"{name}: truncated zstd stream (frame at {offset} is incomplete)")
                bits = int.from_bytes(block, "little")
                last, kind, block_size = bits & 1, (bits >> 1) & 3, bits >> 3
                if kind == 3:
                    raise DDUFFormatError(f"{name}: malformed zstd block at {offset + length}")
                length += 3 + (1 if kind == 1 else block_size)  # RLE blocks hold one byte
                if last:
                    break
            length += 4 if has_checksum else 0
        else:
            raise DDUFFormatError(f"{name}: bytes at {offset} are not a zstd frame")
        if offset + length > size:
            raise DDUFFormatError(f"{name}: truncated zstd stream (frame at {offset} runs past the end)")
        frames.append((offset, length))
        offset += length
    return frames


# --- cache -------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """``$DDUF_PLUS_CACHE``, else huggingface_hub's cache home (``$HF_HOME``, default
    ``~/.cache/huggingface``) + ``/dduf_plus``; computed like huggingface_hub without importing it."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    hf_home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(hf_home).expanduser() / "dduf_plus"


def content_key(path: str | os.PathLike) -> str:
    """The cache key of a ``.zst`` file: the sha256 of its bytes (= its Hub LFS oid). A file inside the
    Hugging Face cache is named by that digest already (``blobs/<sha256>``) and is not re-hashed."""
    resolved = Path(path).resolve()
    if _SHA256_BLOB.match(resolved.name) and resolved.parent.name == "blobs":
        return resolved.name
    fd, size = _open_input(resolved)
    try:
        digest = hashlib.sha256()
        if size:
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    for at in range(0, size, 64 * MiB):
                        digest.update(view[at : at + 64 * MiB])  # hashlib releases the GIL on big updates
                finally:
                    view.release()
        return digest.hexdigest()
    finally:
        os.close(fd)


def _stat_key(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "dev": st.st_dev}


def cached_decompress(
    path: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    threads: int = -1,
    quiet: bool = True,
) -> Path:
    """Decompress a ``.dduf.zst`` once and return the plain archive's path in the cache.

    The cache entry is ``<cache>/zst/<sha256 of the .zst file>.dduf`` (see :func:`content_key`), so two
    copies of the same file share one entry and a changed file gets a new one. To avoid re-hashing on every
    load, the key of each path is remembered with the file's (size, mtime_ns, inode, device); a file whose
    stat changed is hashed again. ``cache_dir`` defaults to :func:`cache_root`. Delete the folder to reclaim
    space; entries are written atomically, so concurrent processes at worst decompress twice.

    Example:
        >>> archive_path = cached_decompress("sd15.dduf.zst")   # first call: decompresses
        >>> archive_path = cached_decompress("sd15.dduf.zst")   # later calls: a stat and a small JSON read

    Raises:
        DDUFFormatError / DDUFIntegrityError: as :func:`decompress`.
    """
    src = Path(path).resolve()
    if not src.is_file():
        raise DDUFError(f"{path}: no such file")
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    folder = root / "zst"
    seen = folder / "seen" / f"{hashlib.sha256(str(src).encode('utf-8', 'surrogateescape')).hexdigest()}.json"
    stat = _stat_key(src)
    key = None
    try:
        memo = json.loads(seen.read_text())
        if isinstance(memo, dict) and {k: memo.get(k) for k in stat} == stat and isinstance(memo.get("key"), str):
            key = memo["key"]
    except (OSError, ValueError):
        pass
    if key is None or not _SHA256_BLOB.match(key):
        key = content_key(src)
    target = folder / f"{key}.dduf"
    if not _cache_entry_ok(target, src):
        logger.info("decompressing %s into the cache (%s)", src, target)
        decompress(src, target, threads=threads, quiet=quiet)
    try:
        seen.parent.mkdir(parents=True, exist_ok=True)
        tmp = seen.with_name(f".{seen.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**stat, "key": key}))
        os.replace(tmp, seen)
    except OSError as e:  # a read-only cache still serves entries
        logger.debug("cannot record %s: %s", seen, e)
    return target


def _cache_entry_ok(target: Path, src: Path) -> bool:
    """The entry exists and has the size the stream announces (entries are renamed into place whole, so
    a size match means a complete write; content was verified by zstd when it was written)."""
    if not target.is_file():
        return False
    fd, size = _open_input(src)
    try:
        layout = read_layout(fd, size, str(src))
    finally:
        os.close(fd)
    return layout.total_size is None or target.stat().st_size == layout.total_size


def open_for_validation(path: str | os.PathLike) -> Path:
    """The plain archive behind ``path`` for ``dduf validate``: a ``.zst`` is decompressed (verifying every
    frame's checksum and size) into the cache via :func:`cached_decompress`; any other path is returned as is.

    Raises:
        DDUFFormatError: truncated stream, bad magic, inconsistent frames (validate reports it as an error).
        DDUFIntegrityError: a frame's content checksum does not match.
    """
    return cached_decompress(path) if is_zst(path) else Path(path)
