"""Drop-in for huggingface_hub's ``read_dduf_file``: same return shape, no copies, stricter checks.

Switch by changing one import::

    from dduf_plus import read_dduf_file   # was: from huggingface_hub import read_dduf_file

Difference: ``as_mmap()`` yields a zero-copy read-only ``memoryview`` of the entry instead of a bytes
copy. Code that hands it to ``safetensors.torch.load`` (which insists on ``bytes``) should call
``entry.as_tensors()`` instead: torch tensors viewing the file mapping, no copy at all."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .format.archive import DDUFArchive, tensor_view

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass
class DDUFEntry:
    """One entry of a DDUF archive, as huggingface_hub describes it."""

    filename: str
    length: int
    offset: int
    dduf_path: Path = field(repr=False)
    _archive: DDUFArchive = field(repr=False, compare=False, default=None)  # type: ignore[assignment]

    @contextlib.contextmanager
    def as_mmap(self) -> Iterator[memoryview]:
        """A read-only memoryview of the entry's bytes over the archive's mmap (no copy)."""
        view = self._archive.view(self.filename)
        try:
            yield view
        finally:
            view.release()

    def read_text(self, encoding: str = "utf-8") -> str:
        return self._archive.read_text(self.filename, encoding)

    def as_tensors(self) -> dict[str, torch.Tensor]:
        """The entry's safetensors tensors as torch views of the mapping (safetensors entries only)."""
        import torch

        header = self._archive.headers.get(self.filename)
        if header is None:
            from .errors import DDUFFormatError

            raise DDUFFormatError(f"{self.dduf_path}: {self.filename!r} is not a safetensors entry")
        start = self.offset + header.data_start
        return {name: tensor_view(self._archive.mmap, start + t.begin, t, torch) for name, t in header.tensors.items()}


def read_dduf_file(dduf_path: str | os.PathLike, **kwargs: Any) -> dict[str, DDUFEntry]:
    """Read a DDUF file and return ``{filename: DDUFEntry}``, like ``huggingface_hub.read_dduf_file``.

    Example:
        >>> entries = read_dduf_file("FLUX.1-dev.dduf")
        >>> json.loads(entries["model_index.json"].read_text())["_class_name"]
        'FluxPipeline'
        >>> weights = entries["vae/diffusion_pytorch_model.safetensors"].as_tensors()

    Raises:
        DDUFValidationError: the file breaks a structural DDUF, ZIP or safetensors rule.
    """
    archive = DDUFArchive(dduf_path, **kwargs)
    path = Path(dduf_path)
    return {
        e.name: DDUFEntry(e.name, e.length, e.offset, path, archive)
        for e in archive.entries.values()
    }
