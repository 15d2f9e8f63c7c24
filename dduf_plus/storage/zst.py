"""zstd transport for DDUF archives: ``X.dduf`` <-> ``X.dduf.zst``.

A DDUF archive is STORED (uncompressed) so that it can be memory-mapped; for transfer and storage a
zstd stream is smaller. The stream this module writes is plain zstd that any ``zstd -d`` decodes, laid out
(:mod:`.zst_layout`: a header frame, independent frames, a seek table) so that it can be decompressed in
parallel and checked for truncation.

Because frames are independent and the table gives each one's offsets, :func:`decompress` hands frames to
a thread pool that ``pwrite``s them into a preallocated file. Memory is constant: a few MiB of buffers and
the zstd window per thread, whatever the archive size. Streams without the table (written by the ``zstd``
CLI, say) are decompressed sequentially.

A ``.zst`` is untrusted like the archive inside: decompression has a budget (:class:`DecompressionBudget`:
an absolute cap, a ratio cap above a floor, and the free disk space), checked before writing when the
stream announces its size and enforced while decoding when it does not.

:func:`~dduf_plus.storage.zst_cache.cached_decompress` decompresses once
into a cache keyed by the sha256 of the ``.zst`` file and returns the plain archive, which loaders then
mmap as usual; every hit is verified against content.

Only ``zstandard`` and the standard library are imported here (no torch)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import DDUFError, DDUFFormatError, DDUFIntegrityError, DDUFUsageError, io_error
from .cache_dirs import CACHE_ENV  # noqa: F401 (re-exported: tests and zst_cache name it here)
from .confined import Confined
from .fd_io import pwrite_all
from .progress import progress_bar  # huggingface_hub's tqdm, silent off a TTY
from .zst_budget import (  # noqa: F401 (the budget's names, re-exported: callers and tests name them here)
    DEFAULT_MAX_BYTES,
    DISK_RESERVE,
    MAX_DECOMPRESSED_ENV,
    RAISE_HINT,
    RATIO_FLOOR,
    BudgetLike,
    DecompressionBudget,
    DecompressionBudgetError,
    allowance_for,
    decompression_budget,
    free_bytes,
    no_space,
    over_budget,
)
from .zst_layout import (  # noqa: F401 (HEADER_FRAME_SIZE, StreamLayout, zstd_module: re-exported)
    HEADER_FRAME_SIZE,
    MAX_FRAMES,
    Frame,
    StreamLayout,
    header_frame,
    read_layout,
    seek_table,
    walk_frames,
    zstd_module,
)

logger = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_LEVEL = 3
DEFAULT_FRAME_SIZE = 256 * MiB
IO_CHUNK = 8 * MiB  # read/write buffer per thread
LONG_WINDOW_LOG = 27  # 128 MiB: the largest window `zstd -d` accepts without --long (ZSTD_WINDOWLOG_LIMIT_DEFAULT)



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


def _threads(threads: int | None) -> int:
    if threads is None or threads < 1:
        return os.cpu_count() or 1
    return threads


@contextmanager
def _atomic_output(dst: Path) -> Iterator[int]:
    """An exclusively created temporary file beside ``dst``, renamed over it after fsync when the block
    succeeds, removed otherwise (also on Ctrl-C): readers never see a half-written archive."""
    with Confined(dst.parent).atomic(dst.name, mode=0o644) as out:
        yield out.fd


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def open_input(src: Path, name: str | None = None) -> tuple[int, int]:
    """``src`` opened for reading, and its size; an error names it as ``name`` (the path the user gave)."""
    try:
        fd = os.open(src, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise io_error(f"cannot open {name or src}: {e.strerror}", e, name or src) from None
    return fd, os.fstat(fd).st_size


def _progress(total: int, desc: str, quiet: bool) -> Any:
    return progress_bar(total, desc, quiet)


# --- compress ----------------------------------------------------------------------------------------


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
    zstd = zstd_module()
    src, dst = Path(src), Path(dst)
    _check_compress_args(zstd, src, dst, level, frame_size)
    started = time.perf_counter()
    cctx = _compressor(zstd, level, threads, long)
    fd_in, total = open_input(src)
    bar = _progress(total, dst.name, quiet)
    try:
        with _atomic_output(dst) as fd_out:
            output_bytes, frames = _write_stream(cctx, fd_in, fd_out, total, frame_size, bar, src)
    finally:
        bar.close()
        os.close(fd_in)
    return ZstResult(dst, total, output_bytes, frames, time.perf_counter() - started)


def _check_compress_args(zstd: Any, src: Path, dst: Path, level: int, frame_size: int) -> None:
    """Bad arguments are usage errors (the CLI exits 2, as for any bad argument)."""
    if _same_file(src, dst):
        raise DDUFUsageError(f"{dst}: output would overwrite the input")
    if frame_size < MiB or frame_size >= 1 << 32:
        raise DDUFUsageError(f"frame size {frame_size} must be between 1 MiB and 4 GiB")
    if not zstd.MAX_COMPRESSION_LEVEL >= level >= -(1 << 17):
        raise DDUFUsageError(f"zstd level {level} is out of range (max {zstd.MAX_COMPRESSION_LEVEL})")


def _compressor(zstd: Any, level: int, threads: int, long: bool) -> Any:
    """A compressor whose frames carry their content size and checksum (``long``: 128 MiB LDM window)."""
    params = zstd.ZstdCompressionParameters.from_level(
        level, threads=_threads(threads), write_checksum=True, write_content_size=True,
        **({"enable_ldm": True, "window_log": LONG_WINDOW_LOG} if long else {}),
    )
    return zstd.ZstdCompressor(compression_params=params)


def _write_stream(cctx: Any, fd_in: int, fd_out: int, total: int, frame_size: int, bar: Any,
                  src: Path) -> tuple[int, int]:
    """Header frame, one frame per ``frame_size`` input bytes, seek table: (bytes written, data frames)."""
    header = header_frame(total, frame_size)
    pwrite_all(fd_out, header, 0)
    position = len(header)
    entries = [(len(header), 0)]
    buffer = bytearray(IO_CHUNK)
    for frame_start in range(0, total, frame_size):
        frame_len = min(frame_size, total - frame_start)
        written = _write_frame(cctx, fd_in, fd_out, frame_start, frame_len, position, buffer, bar, src)
        position += written
        entries.append((written, frame_len))
    table = seek_table(entries)
    pwrite_all(fd_out, table, position)
    position += len(table)
    os.ftruncate(fd_out, position)
    return position, len(entries) - 1


def _write_frame(cctx: Any, fd_in: int, fd_out: int, frame_start: int, frame_len: int, position: int,
                 buffer: bytearray, bar: Any, src: Path) -> int:
    """Compress input ``[frame_start, frame_start + frame_len)`` as one fresh frame (independent of the
    others) written at ``position``, in ``IO_CHUNK`` reads; returns its compressed size."""
    zstd = zstd_module()
    cobj = cctx.compressobj(size=frame_len)
    written = 0
    done = 0
    while done < frame_len:
        n = os.preadv(fd_in, [memoryview(buffer)[: min(IO_CHUNK, frame_len - done)]], frame_start + done)
        if n <= 0:
            raise DDUFError(f"{src}: file shrank while compressing")
        out = cobj.compress(memoryview(buffer)[:n])
        pwrite_all(fd_out, out, position + written)
        written += len(out)
        done += n
        bar.update(n)
    out = cobj.flush(zstd.COMPRESSOBJ_FLUSH_FINISH)
    pwrite_all(fd_out, out, position + written)
    return written + len(out)


# --- layout ------------------------------------------------------------------------------------------


# --- decompress --------------------------------------------------------------------------------------


class _FdSlice:
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


class _Stopped(Exception):
    """Another thread failed: this one stops decoding (the first failure is what is raised)."""


def _decode_into(reader: Any, fd_out: int, out_offset: int, limit: int | None, buffer: bytearray,
                 progress: Callable[[int], Any], stop: threading.Event | None = None) -> int:
    """Copy decompressed bytes from ``reader`` to ``fd_out`` at ``out_offset``; returns the count. Reads
    at most ``limit + 1`` bytes so an overlong frame (or a stream past its budget) is noticed without
    decoding it all."""
    view = memoryview(buffer)
    written = 0
    while True:
        if stop is not None and stop.is_set():
            raise _Stopped
        want = len(view) if limit is None else min(len(view), limit + 1 - written)
        if want <= 0:
            return written
        n = reader.readinto(view[:want])
        if not n:
            return written
        pwrite_all(fd_out, view[:n], out_offset + written)
        written += n
        progress(n)


def decompress(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    threads: int = -1,
    quiet: bool = False,
    max_decompressed: BudgetLike = None,
) -> ZstResult:
    """Decompress ``src`` (a ``.dduf.zst``) into ``dst``, atomically, byte-exact, within a budget.

    Frames listed in the seek table are decoded by ``threads`` threads in parallel (-1: one per CPU), each
    writing at its frame's offset; every frame's content checksum is verified by zstd and its size checked
    against the table, so a truncated or corrupted stream raises instead of leaving a short archive.

    The output may be at most ``max_decompressed`` (see :func:`decompression_budget`: default 256 GiB and
    16x the compressed size above 256 MiB; ``$DDUF_PLUS_MAX_DECOMPRESSED``) and must fit the free disk
    space. A size the stream announces (header frame, seek table, frame headers) is checked before
    anything is written; a stream that announces none is cut off where the budget ends. Nothing is left
    at ``dst`` on failure.

    Example:
        >>> decompress("sd15.dduf.zst", "sd15.dduf")
        >>> decompress("zeros.dduf.zst", "zeros.dduf", max_decompressed="64G")  # a ratio over 16x, trusted

    Raises:
        DDUFFormatError: not a zstd stream, truncated, or inconsistent frames.
        DDUFIntegrityError: a frame's content checksum does not match (corrupted data).
        DecompressionBudgetError: over the budget or the free disk space.
    """
    zstd_module()
    src, dst = Path(src), Path(dst)
    if _same_file(src, dst):
        raise DDUFError(f"{dst}: output would overwrite the input")
    budget = decompression_budget(max_decompressed)
    started = time.perf_counter()
    with _atomic_output(dst) as fd_out:
        size, total, frames = decompress_into(src, fd_out, dst.parent, budget=budget, threads=threads,
                                              quiet=quiet, desc=dst.name)
    return ZstResult(dst, size, total, frames, time.perf_counter() - started)


def decompress_into(src: Path, fd_out: int, out_dir: Path, *, budget: DecompressionBudget, threads: int = -1,
                    quiet: bool = True, desc: str = "", name: str | None = None) -> tuple[int, int, int]:
    """Decompress ``src`` into the open, empty file ``fd_out`` (on the file system of ``out_dir``, whose
    free space is checked). Returns (compressed bytes, decompressed bytes, frames). The caller owns the
    output file and removes it when this raises (see :func:`decompress`)."""
    zstd = zstd_module()
    name = name or str(src)
    fd_in, size = open_input(src, name)
    try:
        layout = read_layout(fd_in, size, name)
        announced: int | None
        if layout.frames is None:
            walked = walk_frames(zstd, fd_in, size, name)
            sizes = [content for _offset, _length, content in walked]
            announced = None if None in sizes else sum(s or 0 for s in sizes)
        else:
            announced = layout.total_size or 0
        allowance = allowance_for(name, size, announced, budget, out_dir)
        bar = _progress(announced or size, desc or name, quiet)
        lock = threading.Lock()

        def progress(n: int) -> None:
            with lock:
                bar.update(n)

        try:
            if layout.frames is None:
                total = _decompress_sequential(zstd, fd_in, size, fd_out, progress, name, allowance.cutoff)
                if announced is not None and total != announced:
                    raise DDUFFormatError(f"{name}: decoded {total} bytes, its frames announce {announced}")
                if allowance.cutoff is not None and total > allowance.cutoff:
                    if allowance.over_budget:
                        raise over_budget(name, size, total, allowance.cutoff, budget, announced=False)
                    raise no_space(name, None, allowance.cutoff, out_dir)
            else:
                total = layout.total_size or 0  # what was announced: the frame table's total
                os.ftruncate(fd_out, total)  # frames then fill their slices in any order
                _decompress_frames(zstd, fd_in, fd_out, layout.frames, _threads(threads), progress, name)
        finally:
            bar.close()
        frames = len([f for f in layout.frames or [] if f.size]) or 1
    finally:
        os.close(fd_in)
    return size, total, frames


def _zstd_failure(name: str, where: str, error: Exception) -> DDUFError:
    message = str(error)
    if "checksum" in message:
        return DDUFIntegrityError(f"{name}: {where}: content checksum mismatch (the file is corrupted)")
    return DDUFFormatError(f"{name}: {where}: corrupt zstd data ({message})")


def _decompress_frames(zstd: Any, fd_in: int, fd_out: int, frames: list[Frame], threads: int,
                       progress: Callable[[int], Any], name: str) -> None:
    stop = threading.Event()  # set on the first failure (or Ctrl-C): the other threads stop within a chunk

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
            _FdSlice(fd_in, frame.offset, frame.compressed_size), read_size=IO_CHUNK, read_across_frames=False)
        try:
            written = _decode_into(reader, fd_out, frame.output_offset, frame.size, bytearray(IO_CHUNK), progress,
                                   stop)
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
            stop.set()
            for future in futures:
                future.cancel()
            raise


def _decompress_sequential(zstd: Any, fd_in: int, size: int, fd_out: int, progress: Callable[[int], Any],
                           name: str, cutoff: int | None) -> int:
    """Streams without a seek table (e.g. from the zstd CLI): one pass over every frame (whose tiling of
    the file :func:`decompress_into` checked first). Decodes at most ``cutoff + 1`` bytes."""
    reader = zstd.ZstdDecompressor().stream_reader(_FdSlice(fd_in, 0, size), read_size=IO_CHUNK,
                                                   read_across_frames=True)
    try:
        return _decode_into(reader, fd_out, 0, cutoff, bytearray(IO_CHUNK), progress)
    except zstd.ZstdError as e:
        raise _zstd_failure(name, "stream", e) from None
