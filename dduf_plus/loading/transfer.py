"""Move a component's tensors (views of the archive's mmap) to where the model will live.

* CPU, dtype unchanged: the very same tensor objects come back (zero copy).
* CPU, dtype changed: converted one tensor at a time, so a component never exists twice in full.
* CUDA: the bytes stream through a small ring of pinned host buffers into ONE device allocation per
  component (carved into aligned views); the host memcpy into buffer k+1 overlaps the async
  host-to-device copy of buffer k on a side stream, and dtype conversion happens on the device.

Read-ahead (``prefetch``, ``component_ranges``) lives in ``dduf_plus.loading.prefetch``; the names are
re-exported here for existing callers."""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch

from .prefetch import component_ranges, prefetch  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

DtypeFor = Callable[[str, torch.Tensor], "torch.dtype | None"]

DEFAULT_CHUNK_BYTES = 32 << 20  # large enough to reach PCIe bandwidth, small enough to pin cheaply
DEFAULT_BUFFERS = 3  # one being filled by the CPU, one in flight, one spare to absorb jitter
VIEW_ALIGNMENT = 256  # every view starts on a 256-byte boundary: fits any dtype, coalesced access
PAGE = mmap.PAGESIZE


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

    On CUDA all returned tensors of the call share one device allocation (freeing one of them frees
    nothing until all are gone); they are ready for work queued on the caller's current stream (no host
    sync: call ``torch.cuda.synchronize()`` to time it). Pinned host memory: ``num_buffers *
    chunk_bytes``. A mapping with a ``tensor_specs()`` method ({name: (shape, dtype)}) is read lazily,
    tensor by tensor, in copy order; any other mapping is read once up front (right for mmap views).
    ``dtype_for`` then sees meta tensors.
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
    shape: torch.Size
    nbytes: int  # source bytes
    src_dtype: torch.dtype
    dst_dtype: torch.dtype
    dst_offset: int  # in the component's flat device buffer
    stream_offset: int  # in the byte stream being copied (== dst_offset for direct jobs)


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


class _Sources:
    """Source bytes by tensor name. A mapping that can describe its tensors without reading them
    (``tensor_specs()``, e.g. the loader's pread-backed one) is read lazily, in stream order, each tensor
    dropped after its last byte is copied: host memory holds a few tensors, never the component. Any
    other mapping is read once while planning (archive views cost nothing to keep)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], lazy: bool):
        self._tensors = tensors
        self._lazy = lazy
        self._kept: dict[str, torch.Tensor] = {}  # read while planning
        self._views: dict[str, torch.Tensor] = {}  # 1-D uint8 views of tensors being copied

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        if not self._lazy:
            self._kept[name] = tensor

    def get(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is None:
            tensor = self._kept.pop(name) if name in self._kept else self._tensors[name]
            view = self._views[name] = _byte_view(tensor)
        return view

    def done(self, name: str) -> None:
        self._views.pop(name, None)
        self._kept.pop(name, None)


def _specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.dtype]] | None:
    specs = getattr(tensors, "tensor_specs", None)
    if not callable(specs):
        return None
    return {name: (torch.Size(shape), dtype) for name, (shape, dtype) in specs().items()}


def _plan(tensors: Mapping[str, torch.Tensor], dtype_for: DtypeFor
          ) -> tuple[list[_Job], list[_Job], int, dict[str, torch.Size], dict[str, torch.dtype], _Sources]:
    """Lay the component out in one flat buffer: tensors kept in their dtype first (their bytes go
    straight to their final place), then converted ones (staged in their source dtype)."""
    specs = _specs(tensors)
    sources = _Sources(tensors, lazy=specs is not None)
    shapes: dict[str, torch.Size] = {}
    targets: dict[str, torch.dtype] = {}
    direct: list[tuple[str, torch.dtype]] = []
    convert: list[tuple[str, torch.dtype]] = []
    src_dtypes: dict[str, torch.dtype] = {}
    for name in (specs if specs is not None else tensors):
        if specs is not None:  # described, not read: dtype_for sees a meta tensor of that shape/dtype
            shape, src_dtype = specs[name]
            t = torch.empty(shape, dtype=src_dtype, device="meta")
        else:
            t = tensors[name]
            sources.keep(name, t)
        shapes[name], src_dtypes[name] = t.shape, t.dtype
        targets[name] = dtype_for(name, t) or t.dtype
        if t.numel() == 0:
            continue
        (direct if targets[name] == t.dtype else convert).append((name, targets[name]))
    direct_jobs, convert_jobs = [], []
    offset = 0
    for name, target in direct:
        nbytes = shapes[name].numel() * _itemsize(target)
        direct_jobs.append(_Job(name, shapes[name], nbytes, target, target, offset, offset))
        offset = _align(offset + nbytes)
    stream_offset = 0
    for name, target in convert:
        nbytes = shapes[name].numel() * _itemsize(src_dtypes[name])
        convert_jobs.append(_Job(name, shapes[name], nbytes, src_dtypes[name], target, offset, stream_offset))
        offset = _align(offset + shapes[name].numel() * _itemsize(target))
        stream_offset = _align(stream_offset + nbytes)
    return direct_jobs, convert_jobs, offset, shapes, targets, sources


_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


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

    def begin(self) -> None:
        pass

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

    def begin(self) -> None:
        # The flat buffer was allocated on the caller's stream: its memory may have been freed there by
        # tensors whose kernels are still queued. Our writes must come after them.
        self.side.wait_stream(torch.cuda.current_stream(self.device))

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
    """Plan the flat buffer, stream the kept-dtype tensors into it, then the converted ones; return views."""
    if num_buffers < 1:
        raise ValueError("num_buffers must be at least 1")
    window_bytes = max(VIEW_ALIGNMENT, chunk_bytes // VIEW_ALIGNMENT * VIEW_ALIGNMENT)
    direct, convert, total, shapes, targets, sources = _plan(tensors, dtype_for)
    flat = torch.empty(total, dtype=torch.uint8, device=device) if total else None
    copier.begin()
    direct_span, convert_span = _span(direct), _span(convert)
    host_bytes = min(window_bytes, max(direct_span, convert_span))
    buffers = min(num_buffers, _count(direct_span, convert_span, window_bytes))
    ring = _HostRing(copier, [copier.host_buffer(host_bytes) for _ in range(buffers)], sources)
    staging = None
    if convert:
        with copier.stream():  # allocated on the side stream: its reuse is ordered after our kernels
            staging = torch.empty(min(window_bytes, convert_span), dtype=torch.uint8, device=device)
    if direct:
        assert flat is not None
        _copy_direct(direct, window_bytes, flat, ring, copier)
    if convert:
        assert flat is not None and staging is not None
        _copy_converted(convert, window_bytes, flat, staging, ring, copier)
    copier.finish()
    return _carve(flat, direct + convert, shapes, targets, device)


class _HostRing:
    """The host buffers, used in turn: each is refilled only once the copy that read it has finished."""

    def __init__(self, copier: _SyncCopier, buffers: list[torch.Tensor], sources: _Sources):
        self.copier, self.buffers, self.sources = copier, buffers, sources
        self.turn = 0

    def fill(self, length: int, pieces: list[_Piece]) -> tuple[int, torch.Tensor]:
        """(slot, buffer): the next buffer, holding the window's ``pieces`` of source bytes."""
        slot = self.turn % len(self.buffers)
        self.turn += 1
        self.copier.wait_free(slot)
        buffer = self.buffers[slot][:length]
        for p in pieces:
            source = self.sources.get(p.job.name)
            buffer[p.window_offset : p.window_offset + p.end - p.begin].copy_(source[p.begin : p.end])
            if p.end == p.job.nbytes:
                self.sources.done(p.job.name)  # its bytes are in the pinned buffer: the source may go
        return slot, buffer


def _copy_direct(jobs: list[_Job], window_bytes: int, flat: torch.Tensor, ring: _HostRing,
                 copier: _SyncCopier) -> None:
    """Tensors that keep their dtype: the stream IS the flat buffer's layout, so each window is one copy
    straight into place (alignment gaps carry garbage nobody views)."""
    for start, length, pieces in _windows(jobs, window_bytes):
        slot, buffer = ring.fill(length, pieces)
        with copier.stream():
            copier.copy(flat[start : start + length], buffer)
            copier.release(slot)


def _copy_converted(jobs: list[_Job], window_bytes: int, flat: torch.Tensor, staging: torch.Tensor,
                    ring: _HostRing, copier: _SyncCopier) -> None:
    """Tensors that change dtype: the window lands in a device staging buffer in the source dtype and is
    converted piece by piece into the flat buffer, on the device, on the same stream (so the next
    window's copy into the staging buffer waits for these conversions)."""
    for _start, length, pieces in _windows(jobs, window_bytes):
        slot, buffer = ring.fill(length, pieces)
        with copier.stream():
            copier.copy(staging[:length], buffer)
            for p in pieces:
                job = p.job
                src_size, dst_size = _itemsize(job.src_dtype), _itemsize(job.dst_dtype)
                src = staging[p.window_offset : p.window_offset + p.end - p.begin].view(job.src_dtype)
                first, count = p.begin // src_size, (p.end - p.begin) // src_size
                dst = flat[job.dst_offset + first * dst_size : job.dst_offset + (first + count) * dst_size]
                dst.view(job.dst_dtype).copy_(src)
            copier.release(slot)


def _carve(flat: torch.Tensor | None, jobs: list[_Job], shapes: dict[str, torch.Size],
           targets: dict[str, torch.dtype], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor as a view of the flat buffer, in the caller's order; empty tensors need no bytes and
    get no place in the flat buffer."""
    out: dict[str, torch.Tensor] = {}
    for job in jobs:
        nbytes = job.shape.numel() * _itemsize(job.dst_dtype)
        assert flat is not None
        out[job.name] = flat[job.dst_offset : job.dst_offset + nbytes].view(job.dst_dtype).view(job.shape)
    return {name: out[name] if name in out else torch.empty(shape, dtype=targets[name], device=device)
            for name, shape in shapes.items()}
