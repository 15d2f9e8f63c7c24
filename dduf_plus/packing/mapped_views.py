"""Zero-copy torch views of safetensors files mapped privately, and page dropping while a file is streamed, so
reading a multi-GB file through a map keeps RSS about one slice. Shared by the single-file conversion (in and
out) and the reference lookup in model folders."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..format.safetensors_header import TensorInfo

__all__ = ["Dropper", "bytes_of", "mapped", "view"]


@contextmanager
def mapped(path: Path) -> Iterator[mmap.mmap | None]:
    """A private (copy-on-write) map of ``path``: writable for ``torch.frombuffer``, never written."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        try:
            yield mm
        finally:
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a consumer kept a view: the map goes with it
                    pass


_DROP_EVERY = 64 << 20  # bytes read through a map between two page drops


class Dropper:
    """Drops the pages read so far from this process every :data:`_DROP_EVERY` bytes (``MADV_DONTNEED``;
    the maps are private and never written, so a page read again comes back from the file): RSS stays
    about one slice, not the whole checkpoint, as ``dduf pack --dtype`` does."""

    def __init__(self, *maps: mmap.mmap | None):
        self.maps = [m for m in maps if m is not None]
        self.pending = 0

    def read(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending < _DROP_EVERY:
            return
        self.pending = 0
        for m in self.maps:
            if hasattr(m, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                m.madvise(mmap.MADV_DONTNEED)


def view(mm: mmap.mmap | None, data_start: int, info: TensorInfo) -> Any:
    """A torch tensor viewing ``info``'s bytes in the map (copied only when a foreign writer misaligned it)."""
    import torch

    dtype = getattr(torch, info.dtype)
    width = torch.empty((), dtype=dtype).element_size()
    offset, count = data_start + info.begin, info.nbytes // width
    if mm is None or count == 0:
        return torch.empty(info.shape, dtype=dtype)
    if offset % width:
        flat = torch.frombuffer(bytearray(mm[offset:offset + info.nbytes]), dtype=dtype)
    else:
        flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=offset)
    return flat.view(info.shape)


def bytes_of(t: Any) -> Any:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)

