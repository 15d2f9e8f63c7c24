"""Move a component's tensors (views of the archive's mmap) to where the model will live.

* CPU, dtype unchanged: the very same tensor objects come back (zero copy).
* CPU, dtype changed: converted one tensor at a time, so a component never exists twice in full.
* CUDA: the bytes stream through a small ring of pinned host buffers into ONE device allocation per
  component (carved into aligned views); the host memcpy into buffer k+1 overlaps the async
  host-to-device copy of buffer k on a side stream, and dtype conversion happens on the device.

``prefetch`` asks the kernel to read an archive's pages ahead (``madvise(MADV_WILLNEED)``), so a cold
cache load can overlap disk reads with module construction."""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..format.archive import DDUFArchive

logger = logging.getLogger("dduf_plus")

DtypeFor = Callable[[str, torch.Tensor], "torch.dtype | None"]

DEFAULT_CHUNK_BYTES = 32 << 20  # large enough to reach PCIe bandwidth, small enough to pin cheaply
DEFAULT_BUFFERS = 3  # one being filled by the CPU, one in flight, one spare to absorb jitter
VIEW_ALIGNMENT = 256  # every view starts on a 256-byte boundary: fits any dtype, coalesced access
PAGE = mmap.PAGESIZE
MADV_POPULATE_READ = 22  # Linux >= 5.14; not exported by Python 3.11's mmap module


def materialize(
    tensors: Mapping[str, torch.Tensor],
    *,
    device: torch.device | str,
    dtype_for: DtypeFor | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    num_buffers: int = DEFAULT_BUFFERS,
) -> dict[str, torch.Tensor]:
    """Return ``tensors`` on ``device``, each in ``dtype_for(name, tensor)`` (None: keep its dtype).

    Example:
        >>> with DDUFArchive("model.dduf") as archive:
        ...     weights = materialize(archive.tensors("unet"), device="cuda",
        ...                           dtype_for=lambda name, t: torch.float16)

    On CUDA all returned tensors of the call share one device allocation; freeing one of them frees
    nothing until all are gone. The host side never holds more than ``num_buffers * chunk_bytes``.
    """
    device = torch.device(device)
    dtype_for = dtype_for or _keep_dtype
    if device.type == "cpu":
        return _to_cpu(tensors, dtype_for)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return _stream(tensors, device, dtype_for, chunk_bytes, num_buffers, _CudaCopier(device, num_buffers))
    # mps, xpu, ...: no pinned-ring implementation; torch's own copy, still one tensor at a time.
    out = {}
    for name in tensors:
        t = tensors[name]
        out[name] = t.to(device=device, dtype=dtype_for(name, t) or t.dtype)
    return out


def _keep_dtype(name: str, tensor: torch.Tensor) -> None:
    return None


def _to_cpu(tensors: Mapping[str, torch.Tensor], dtype_for: DtypeFor) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in tensors:
        # Rebinding ``t`` each turn drops the previous source before the next conversion: with a lazy
        # mapping, at most one source tensor is alive beside the converted ones.
        t = tensors[name]
        target = dtype_for(name, t)
        if t.device.type != "cpu":
            t = t.to("cpu")
        out[name] = t if target is None or target == t.dtype else t.to(target)
    return out


# --- streaming ---------------------------------------------------------------------------------------
class _Job(NamedTuple):
    name: str
    source: torch.Tensor  # 1-D uint8 view of the contiguous CPU source bytes
    src_dtype: torch.dtype
    dst_dtype: torch.dtype
    dst_offset: int  # in the component's flat device buffer
    stream_offset: int  # in the byte stream being copied (== dst_offset for direct jobs)

    @property
    def nbytes(self) -> int:
        return self.source.numel()


class _Piece(NamedTuple):
    job: _Job
    begin: int  # byte range inside the job's source
    end: int
    window_offset: int  # where these bytes sit in the window


def _align(value: int) -> int:
    return (value + VIEW_ALIGNMENT - 1) // VIEW_ALIGNMENT * VIEW_ALIGNMENT


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()  # rare (archive tensors are contiguous): one tensor's copy
    return t.detach().reshape(-1).view(torch.uint8)


def _plan(tensors: Mapping[str, torch.Tensor], dtype_for: DtypeFor) -> tuple[list[_Job], list[_Job], int, dict]:
    """Lay the component out in one flat buffer: tensors kept in their dtype first (their bytes go
    straight to their final place), then converted ones (staged in their source dtype)."""
    direct: list[tuple[str, torch.Tensor, torch.dtype]] = []
    convert: list[tuple[str, torch.Tensor, torch.dtype]] = []
    empty: dict[str, tuple[torch.Size, torch.dtype]] = {}
    shapes: dict[str, torch.Size] = {}
    for name in tensors:
        t = tensors[name]
        target = dtype_for(name, t) or t.dtype
        shapes[name] = t.shape
        if t.numel() == 0:
            empty[name] = (t.shape, target)
        elif target == t.dtype:
            direct.append((name, t, target))
        else:
            convert.append((name, t, target))
    direct_jobs, convert_jobs = [], []
    offset = 0
    for name, t, target in direct:
        source = _byte_view(t)
        direct_jobs.append(_Job(name, source, t.dtype, target, offset, offset))
        offset = _align(offset + source.numel())
    stream_offset = 0
    for name, t, target in convert:
        source = _byte_view(t)
        dst_bytes = t.numel() * _itemsize(target)
        convert_jobs.append(_Job(name, source, t.dtype, target, offset, stream_offset))
        offset = _align(offset + dst_bytes)
        stream_offset = _align(stream_offset + source.numel())
    return direct_jobs, convert_jobs, offset, {"empty": empty, "shapes": shapes}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _span(jobs: list[_Job]) -> int:
    return jobs[-1].stream_offset + jobs[-1].nbytes if jobs else 0


def _count(direct_span: int, convert_span: int, window_bytes: int) -> int:
    """How many windows the copy takes: no point pinning more buffers than that."""
    return -(-direct_span // window_bytes) + -(-convert_span // window_bytes)


def _windows(jobs: list[_Job], window_bytes: int) -> Iterator[tuple[int, int, list[_Piece]]]:
    """Cut the byte stream the jobs occupy into windows: (start, length, pieces). Windows start on
    multiples of ``window_bytes`` (a multiple of VIEW_ALIGNMENT), so every piece starts on an element
    boundary of its dtype and conversion can be done piece by piece."""
    total = _span(jobs)
    first = 0  # first job that may still overlap the current window
    for start in range(0, total, window_bytes):
        end = min(start + window_bytes, total)
        pieces = []
        i = first
        while i < len(jobs) and jobs[i].stream_offset < end:
            job = jobs[i]
            job_end = job.stream_offset + job.nbytes
            if job_end > start:
                begin = max(start, job.stream_offset)
                stop = min(end, job_end)
                pieces.append(_Piece(job, begin - job.stream_offset, stop - job.stream_offset, begin - start))
            if job_end <= end:
                first = i + 1
            i += 1
        yield start, end - start, pieces


class _SyncCopier:
    """The streaming loop's device side, done synchronously on the CPU: runs the exact windowing,
    carving and conversion code of the CUDA path where no GPU exists (tests), and is the model of
    what the CUDA copier does asynchronously."""

    def __init__(self, device: torch.device | None = None):
        self.device = device or torch.device("cpu")

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def wait_free(self, slot: int) -> None:
        pass

    def stream(self) -> Any:
        return nullcontext()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def release(self, slot: int) -> None:
        pass

    def finish(self) -> None:
        pass


class _CudaCopier(_SyncCopier):
    """Pinned host buffers, one side stream, one event per buffer telling when it may be refilled."""

    def __init__(self, device: torch.device, num_buffers: int):
        super().__init__(device)
        self.side = torch.cuda.Stream(device=device)
        self.events: list[torch.cuda.Event | None] = [None] * num_buffers

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        # torch's caching host allocator keeps freed pinned blocks, so later components reuse them.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def wait_free(self, slot: int) -> None:
        event = self.events[slot]
        if event is not None:
            event.synchronize()  # the H2D copy that read this buffer has finished

    def stream(self) -> Any:
        return torch.cuda.stream(self.side)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def release(self, slot: int) -> None:
        event = torch.cuda.Event()
        event.record(self.side)
        self.events[slot] = event

    def finish(self) -> None:
        # Work queued later on the caller's stream (the model's forward) sees complete weights; no host
        # sync: the caller may build the next module while the last windows land.
        torch.cuda.current_stream(self.device).wait_stream(self.side)


def _stream(
    tensors: Mapping[str, torch.Tensor],
    device: torch.device,
    dtype_for: DtypeFor,
    chunk_bytes: int,
    num_buffers: int,
    copier: _SyncCopier,
) -> dict[str, torch.Tensor]:
    if num_buffers < 1:
        raise ValueError("num_buffers must be at least 1")
    window_bytes = max(VIEW_ALIGNMENT, chunk_bytes // VIEW_ALIGNMENT * VIEW_ALIGNMENT)
    direct, convert, total, info = _plan(tensors, dtype_for)
    out: dict[str, torch.Tensor] = {}
    flat = torch.empty(total, dtype=torch.uint8, device=device) if total else None
    direct_span, convert_span = _span(direct), _span(convert)
    host_bytes = min(window_bytes, max(direct_span, convert_span))
    host = [copier.host_buffer(host_bytes) for _ in range(min(num_buffers, _count(direct_span, convert_span,
                                                                                   window_bytes)))]
    staging = None
    if convert:
        with copier.stream():  # allocated on the side stream: its reuse is ordered after our kernels
            staging = torch.empty(min(window_bytes, convert_span), dtype=torch.uint8, device=device)
    turn = 0

    def fill(slot: int, length: int, pieces: list[_Piece]) -> torch.Tensor:
        copier.wait_free(slot)
        buffer = host[slot][:length]
        for p in pieces:
            buffer[p.window_offset : p.window_offset + p.end - p.begin].copy_(p.job.source[p.begin : p.end])
        return buffer

    # Tensors that keep their dtype: the stream IS the flat buffer's layout, so each window is one copy
    # straight into place (alignment gaps carry garbage nobody views).
    for start, length, pieces in _windows(direct, window_bytes):
        slot = turn % len(host)
        buffer = fill(slot, length, pieces)
        with copier.stream():
            copier.copy(flat[start : start + length], buffer)
            copier.release(slot)
        turn += 1
    # Tensors that change dtype: the window lands in a device staging buffer in the source dtype and is
    # converted piece by piece into the flat buffer, on the device, on the same stream (so the next
    # window's copy into the staging buffer waits for these conversions).
    for _start, length, pieces in _windows(convert, window_bytes):
        slot = turn % len(host)
        buffer = fill(slot, length, pieces)
        with copier.stream():
            assert staging is not None and flat is not None
            copier.copy(staging[:length], buffer)
            for p in pieces:
                job = p.job
                src_size, dst_size = _itemsize(job.src_dtype), _itemsize(job.dst_dtype)
                src = staging[p.window_offset : p.window_offset + p.end - p.begin].view(job.src_dtype)
                first, count = p.begin // src_size, (p.end - p.begin) // src_size
                dst = flat[job.dst_offset + first * dst_size : job.dst_offset + (first + count) * dst_size]
                dst.view(job.dst_dtype).copy_(src)
            copier.release(slot)
        turn += 1
    copier.finish()

    shapes = info["shapes"]
    for job in direct + convert:
        nbytes = shapes[job.name].numel() * _itemsize(job.dst_dtype)
        assert flat is not None
        out[job.name] = flat[job.dst_offset : job.dst_offset + nbytes].view(job.dst_dtype).view(shapes[job.name])
    for name, (shape, dtype) in info["empty"].items():
        out[name] = torch.empty(shape, dtype=dtype, device=device)
    return {name: out[name] for name in shapes}  # the caller's order


# --- read-ahead --------------------------------------------------------------------------------------
def component_ranges(archive: DDUFArchive, component: str, variant: str | None = None) -> list[tuple[int, int]]:
    """(offset, length) of the tensor data of ``component``'s weight files in the archive."""
    ranges = []
    for name in archive.weight_files(component, variant):
        entry, header = archive.entry(name), archive.headers[name]
        ranges.append((entry.offset + header.data_start, entry.length - header.data_start))
    return ranges


def prefetch(
    source: DDUFArchive | mmap.mmap,
    ranges: Iterable[tuple[int, int]] | None = None,
    *,
    populate: bool = False,
) -> int:
    """Ask the kernel to read ``ranges`` of the mapping ahead (``MADV_WILLNEED``); returns the bytes
    advised. ``populate=True`` also maps the pages (``MADV_POPULATE_READ``, Linux >= 5.14; blocks until
    read), which spares the page faults of a later memcpy. Without ``ranges``: the whole file.
    Never raises for lack of kernel support: read-ahead is a hint.

    Example:
        >>> prefetch(archive, component_ranges(archive, "unet"))
    """
    mm = source if isinstance(source, mmap.mmap) else source.mmap
    size = len(mm)
    ranges = [(0, size)] if ranges is None else list(ranges)
    advised = 0
    for offset, length in ranges:
        stop = min(size, offset + length)
        if length <= 0 or stop <= max(0, offset):
            continue  # empty or past the end
        start = max(0, offset) // PAGE * PAGE  # madvise wants a page-aligned start
        for option, wanted in ((getattr(mmap, "MADV_WILLNEED", None), True), (MADV_POPULATE_READ, populate)):
            if option is None or not wanted or not hasattr(mm, "madvise"):
                continue
            try:
                mm.madvise(option, start, stop - start)
            except (OSError, ValueError):
                pass  # old kernel / unsupported: the hint is lost, correctness is not
        advised += stop - start
    return advised


def prefetch_in_background(
    source: DDUFArchive | mmap.mmap, ranges: Iterable[tuple[int, int]] | None = None, *, populate: bool = True
) -> threading.Thread:
    """Run :func:`prefetch` on a daemon thread (``madvise`` releases the GIL), so reading the archive
    overlaps building modules. Join the thread, or just let it finish."""
    ranges = None if ranges is None else list(ranges)
    thread = threading.Thread(target=prefetch, args=(source, ranges), kwargs={"populate": populate},
                              name="dduf-prefetch", daemon=True)
    thread.start()
    return thread
