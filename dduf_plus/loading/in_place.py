"""A component found in an app's model folder in another layout (an LDM UNet, a full checkpoint's part, BFL's
Flux transformer, an LDM VAE), loaded from the user's file where it lies: no copy on disk, no copy in memory
beyond the tensors whose bytes are not one range of the file.

:class:`MappedPartFiles` answers the :class:`~dduf_plus.loading.files.ComponentFiles` protocol as a diffusers
folder holding the recorded ``config.json`` and ONE virtual weights file under its recorded name: its header is
the one ``dduf complete`` would write (:func:`dduf_plus.refs.model_dirs.diffusers_header`), its tensors are
views of the user's file, mapped copy-on-write (``ACCESS_COPY``, as :class:`FolderComponentFiles` maps: nothing
a model does to its weights reaches the file):

- a tensor that is one contiguous range (a copy, a 1x1 convolution, one slice of a fused qkv) is a view of the
  mapping at its offset;
- a tensor made of several ranges (halves swapped) is concatenated, a transposed one is a transposed view made
  contiguous: only these, small, are copied.

The part was verified tensor by tensor (its digest over the same ranges) when it was found; between that and
the mapping the file is trusted as any verified folder file is (a loader does not hash weights as it maps
them), and a file whose stat changed since is refused. With ``use_mmap=False`` nothing is mapped: each tensor
is read from the checked descriptor into a buffer of its own when it is asked for."""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from ..errors import DDUFFormatError, DDUFIOError, DDUFLoadError, DDUFReferenceError
from ..format.archive import tensor_view, torch_dtype_of
from ..format.safetensors_header import SafetensorsHeader, TensorInfo
from ..format.weights import select_weights, tensor_files
from ..refs.model_dirs import InPlace, Source, diffusers_header
from ..storage.fd_io import open_regular, pread_upto
from ..storage.signed import StatKey

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .files import FolderComponentFiles

__all__ = ["MappedPartFiles"]


class MappedPartFiles:
    """A model-folder part as a component folder: ``config`` is the folder holding the recorded config (a
    :class:`~dduf_plus.loading.files.FolderComponentFiles` over a view folder in dduf_plus' cache, answering
    for config.json as any folder does), ``in_place`` says where each diffusers tensor lies in the user's file."""

    def __init__(self, config: FolderComponentFiles, name: str, in_place: InPlace, *, use_mmap: bool = True):
        self._config = config
        self.name = name
        self.in_place = in_place
        self.use_mmap = use_mmap
        self.description = f"{in_place.path} ({in_place.part.layout}, as {name})"
        self._header: SafetensorsHeader | None = None
        self._map: mmap.mmap | None = None
        self._fd: int | None = None  # use_mmap=False: the checked descriptor tensors are read from
        self._size = 0

    def __repr__(self) -> str:
        return f"MappedPartFiles({self.description!r})"

    def listdir(self) -> list[str]:
        return sorted({*self._config.listdir(), self.in_place.weights})

    def _is_weights(self, filename: str) -> bool:
        return filename == self.in_place.weights

    def read_bytes(self, filename: str) -> bytes:
        if self._is_weights(filename):
            raise DDUFLoadError(f"{self.description}: weights ({filename}) are never read whole; they are mapped")
        return self._config.read_bytes(filename)

    def read_json(self, filename: str) -> Any:
        return self._config.read_json(filename)

    def local_dir(self, filenames: Iterable[str] | None = None) -> str:
        names = [f for f in (self._config.listdir() if filenames is None else filenames) if not self._is_weights(f)]
        return self._config.local_dir(names)

    def weight_files(self, variant: str | None = None) -> list[str]:
        return tensor_files(select_weights(self.listdir(), variant))  # one file, never a shard index

    def prefetch(self, filenames: Sequence[str]) -> None:
        pass  # one map of the user's file: the kernel's read-ahead on sequential faults

    def safetensors_header(self, filename: str) -> SafetensorsHeader:
        """The virtual weights file's header: the one the part's diffusers-named copy would have."""
        if not self._is_weights(filename):
            raise DDUFLoadError(f"{self.description} has no weights file {filename!r} (has: {self.in_place.weights})")
        if self._header is None:
            self._header = diffusers_header(self.in_place.part)[1]
        return self._header

    def tensor_infos(self, filenames: Sequence[str]) -> dict[str, tuple[str, int, TensorInfo]]:
        """{tensor name: (file name, offset in the virtual file, info)}: metadata only, nothing read."""
        out: dict[str, tuple[str, int, TensorInfo]] = {}
        for filename in filenames:
            header = self.safetensors_header(filename)
            for tname, info in header.tensors.items():
                out[tname] = (filename, header.data_start + info.begin, info)
        return out

    def _open(self) -> mmap.mmap | int:
        if self._map is None and self._fd is None:
            where = self.in_place.path
            # Verified when found (its digest over these ranges) and unchanged in stat since: from here on it is
            # trusted as any verified folder file is (weights are not hashed as they are mapped). The stat is the
            # opened descriptor's (a file replaced after a check by path would be mapped unverified); no blocking
            # open (a FIFO put in its place). ACCESS_COPY: a write to a tensor never reaches the user's file.
            try:
                opened = open_regular(where)
                if opened is None:
                    raise DDUFReferenceError(f"component {self.name!r}: {where} is no longer a regular file")
                fd, st = opened
                try:
                    if StatKey.of(st) != self.in_place.key:
                        raise DDUFReferenceError(f"component {self.name!r}: {where} changed since its tensors were "
                                                 "verified (search the model folders again: load again)")
                    self._size = st.st_size
                    if self.use_mmap:
                        self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
                    else:
                        self._fd = os.dup(fd)
                        weakref.finalize(self, os.close, self._fd)
                finally:
                    os.close(fd)
            except (OSError, ValueError) as e:  # gone, unreadable, or a file system that cannot map files
                raise DDUFIOError(f"component {self.name!r}: {where} cannot be mapped: {e}") from None
        return self._map if self._map is not None else cast(int, self._fd)

    def check_unchanged(self) -> None:
        """Refuse (:class:`DDUFIOError`) a user's file shorter than when it was mapped: a page past its new end
        would kill the process with SIGBUS (as :meth:`ArchiveComponentFiles.check_unchanged`)."""
        if self._map is None:
            return  # nothing mapped: a short read is an error, not a signal
        try:
            now = os.stat(self.in_place.path).st_size
        except OSError as e:
            raise DDUFIOError(f"{self.in_place.path}: cannot check the file while loading {self.name}: {e}") from None
        if now < self._size:
            raise DDUFIOError(f"{self.in_place.path}: the file shrank from {self._size} to {now} bytes while "
                              f"{self.name} was loading; its weights can no longer be read")

    def tensors(self, filenames: Sequence[str]) -> Mapping[str, torch.Tensor]:
        import torch

        names = self.tensor_infos(filenames)
        opened = self._open()
        part = self.in_place.part
        if isinstance(opened, int):
            return _PartReads(opened, part.data_start, {n: part.tensors[n] for n in names}, str(self.in_place.path))
        self.check_unchanged()
        return {name: _tensor(opened, part.data_start, part.tensors[name], torch) for name in names}


def _tensor(mm: mmap.mmap, start: int, src: Source, torch: Any) -> torch.Tensor:
    """One diffusers tensor from the mapping: a view where its bytes are one range, else a small copy."""
    info = src.info
    if src.rows:  # the file holds its transpose: [rows, cols] there, [cols, rows] here
        (b, e), = src.ranges
        stored = info._replace(shape=(src.rows, info.shape[0]), begin=0, end=e - b)
        return tensor_view(mm, start + b, stored, torch).t().contiguous()
    ranges = [(b, e) for b, e in src.ranges if e > b]
    if len(ranges) <= 1:
        b = ranges[0][0] if ranges else 0
        return tensor_view(mm, start + b, info, torch)
    dtype = _dtype(info, torch)
    pieces = [torch.frombuffer(mm, dtype=torch.uint8, count=e - b, offset=start + b) for b, e in ranges]
    return torch.cat(pieces).view(dtype).view(info.shape)



class _PartReads(Mapping):
    """A part's tensors read on first access from a descriptor into buffers of their own (``use_mmap=False``);
    ``tensor_specs`` lets the transfer stream them one at a time (as the loader's ``LazyTensors``)."""

    def __init__(self, fd: int, start: int, sources: dict[str, Source], where: str):
        self._fd, self._start, self._sources, self._where = fd, start, sources, where

    def __getitem__(self, name: str) -> torch.Tensor:
        import torch

        src = self._sources[name]
        info, dtype = src.info, _dtype(src.info, torch)
        ranges = [(b, e) for b, e in src.ranges if e > b]
        buffer = torch.empty(sum(e - b for b, e in ranges), dtype=torch.uint8)
        view, done = memoryview(buffer.numpy()).cast("B"), 0  # type: ignore[arg-type]
        for b, e in ranges:
            try:
                data = pread_upto(self._fd, e - b, self._start + b)
            except (OSError, OverflowError) as err:  # EIO on a network file system, an offset no pread takes
                raise DDUFIOError(f"{self._where}: cannot read tensor {info.name}: "
                                  f"{getattr(err, 'strerror', None) or err}") from None
            if len(data) != e - b:
                raise DDUFIOError(f"{self._where}: the file ended while reading tensor {info.name}")
            view[done : done + len(data)] = data
            done += len(data)
        if src.rows:  # the file holds its transpose
            return buffer.view(dtype).view(src.rows, info.shape[0]).t().contiguous()
        return buffer.view(dtype).view(info.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def tensor_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        import torch

        return {name: (tuple(src.info.shape), _dtype(src.info, torch)) for name, src in self._sources.items()}


def _dtype(info: TensorInfo, torch: Any) -> torch.dtype:
    dtype, _size = torch_dtype_of(info.dtype, torch)
    if dtype is None:
        raise DDUFFormatError(f"tensor {info.name}: dtype {info.dtype} is not supported by this torch")
    return dtype
