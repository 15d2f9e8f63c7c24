"""A read-only fsspec file system over a DDUF archive (protocol ``dduf``).

    >>> import fsspec
    >>> with fsspec.open("dduf://unet/config.json", fo="model.dduf", mode="rt") as f:
    ...     config = json.load(f)
    >>> fsspec.open("dduf://unet/config.json::file:///data/model.dduf").open().read()  # chained URL
    >>> fs = DDUFFileSystem("model.dduf"); fs.ls("unet"); fs.cat("model_index.json")

Like fsspec's ``zip://``, ``fo`` is the archive: a local path, any fsspec URL (``hf://``, ``https://``: read
by range requests), a binary file object, or an open :class:`~dduf_plus.format.archive.DDUFArchive`. Local
archives are served from one memory map: an opened entry is a file object over a ``memoryview`` of it
(``readinto`` copies straight from the mapping; ``getbuffer()`` is zero-copy). Entries are STORED, so
every ``seek`` is O(1). Standard library and fsspec only: no torch."""

from __future__ import annotations

import io
import os
from typing import Any

from fsspec.spec import AbstractFileSystem

from .errors import DDUFError
from .format.archive import DDUFArchive
from .storage.urls import is_url


class _FileObjectSource:
    """A ByteSource over a seekable binary file object (what fsspec hands a chained file system)."""

    def __init__(self, fileobj: Any, name: str):
        self._f = fileobj
        self.name = name
        fileobj.seek(0, os.SEEK_END)
        self.size = fileobj.tell()
        self.bytes_read = 0

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DDUFError(f"{self.name}: read of {length} bytes at {offset} is outside the file")
        self._f.seek(offset)
        data = self._f.read(length)
        if len(data) != length:
            raise DDUFError(f"{self.name}: short read at {offset}")
        self.bytes_read += length
        return data

    def close(self) -> None:
        pass  # the caller owns the file object


class DDUFEntryFile(io.BufferedIOBase):
    """A read-only, seekable binary file over one archive entry."""

    def __init__(self, name: str, size: int, *, view: memoryview | None = None, read_range: Any = None):
        self.name = name
        self.size = size
        self._view = view
        self._read_range = read_range  # (offset in the entry, length) -> bytes
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._check_open()
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self.size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise ValueError("negative seek position")
        self._pos = pos
        return pos

    def _span(self, n: int | None) -> tuple[int, int]:
        start = min(self._pos, self.size)
        end = self.size if n is None or n < 0 else min(self.size, start + n)
        return start, end

    def read(self, n: int | None = -1) -> bytes:
        self._check_open()
        start, end = self._span(n)
        self._pos = end
        if end <= start:
            return b""
        if self._view is not None:
            return bytes(self._view[start:end])
        return self._read_range(start, end - start)

    read1 = read

    def readinto(self, buffer: Any) -> int:
        self._check_open()
        target = memoryview(buffer).cast("B")
        start, end = self._span(len(target))
        if self._view is not None:
            target[: end - start] = self._view[start:end]
        else:
            target[: end - start] = self._read_range(start, end - start)
        self._pos = end
        return end - start

    readinto1 = readinto

    def getbuffer(self) -> memoryview:
        """The whole entry as a read-only ``memoryview`` of the archive mapping (local archives only)."""
        self._check_open()
        if self._view is None:
            raise io.UnsupportedOperation("getbuffer() needs a local, memory-mapped archive")
        return self._view

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")

    def close(self) -> None:
        if not self.closed:
            if self._view is not None:
                self._view.release()
            self._view = None
        super().close()


class DDUFFileSystem(AbstractFileSystem):
    """Read-only view of a DDUF archive: ``model_index.json`` and the root files at the top, one directory
    per stored component. ``info`` of a file also gives its ``offset`` in the archive, ``crc32`` and, when
    the archive's dduf_plus index has it, ``sha256``."""

    protocol = "dduf"
    root_marker = ""
    cachable = False  # one instance per archive object, like zip://

    def __init__(self, fo: Any = "", mode: str = "r", target_protocol: str | None = None,
                 target_options: dict | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        if mode != "r":
            raise ValueError("DDUFFileSystem is read-only (mode must be 'r')")
        self._owns = True
        if isinstance(fo, DDUFArchive):
            self.archive, self._owns = fo, False
        elif isinstance(fo, (str, os.PathLike)):
            self.archive = self._open_archive(os.fspath(fo), target_protocol, target_options or {})
        elif hasattr(fo, "read") and hasattr(fo, "seek"):
            self.archive = DDUFArchive(_FileObjectSource(fo, getattr(fo, "name", None) or repr(fo)))
        else:
            raise ValueError(f"fo must be a path, URL, binary file object or DDUFArchive, not {type(fo).__name__}")
        self.fo = self.archive.path
        self._mapped = self._can_map()
        self._dirs: dict[str, dict[str, Any]] | None = None

    def _open_archive(self, fo: str, target_protocol: str | None, target_options: dict) -> DDUFArchive:
        if target_protocol in (None, "file", "local") and not is_url(fo):
            return DDUFArchive(fo.removeprefix("file://"))
        if target_protocol not in (None, "file", "local"):
            fo = f"{target_protocol}://{fo}" if "://" not in fo else fo
        return DDUFArchive(fo, **target_options)

    def _can_map(self) -> bool:
        try:
            return self.archive.mmap is not None
        except DDUFError:
            return False

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = super()._strip_protocol(path)
        return path.lstrip("/")

    # --- listing ------------------------------------------------------------------------------------------
    def _get_dirs(self) -> dict[str, dict[str, Any]]:
        if self._dirs is None:
            dirs: dict[str, dict[str, Any]] = {"": {"name": "", "size": 0, "type": "directory"}}
            for name, entry in self.archive.entries.items():
                if "/" in name:
                    folder = name.split("/", 1)[0]
                    dirs.setdefault(folder, {"name": folder, "size": 0, "type": "directory"})
                dirs[name] = {"name": name, "size": entry.length, "type": "file", "offset": entry.offset,
                              "crc32": f"{entry.crc32:08x}", "sha256": entry.sha256}
            self._dirs = dirs
        return self._dirs

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path).rstrip("/")
        dirs = self._get_dirs()
        if path not in dirs:
            raise FileNotFoundError(path)
        return dict(dirs[path])

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list:
        path = self._strip_protocol(path).rstrip("/")
        info = self.info(path)
        if info["type"] == "file":
            out = [info]
        else:
            prefix = f"{path}/" if path else ""
            out = [dict(v) for k, v in self._get_dirs().items()
                   if k and k.startswith(prefix) and "/" not in k[len(prefix):]]
            out.sort(key=lambda d: d["name"])
        return out if detail else [d["name"] for d in out]

    # --- reading ------------------------------------------------------------------------------------------
    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> DDUFEntryFile:
        if "r" not in mode or any(c in mode for c in "wa+x"):
            raise OSError("DDUFFileSystem is read-only")
        path = self._strip_protocol(path)
        info = self.info(path)
        if info["type"] != "file":
            raise IsADirectoryError(path)
        if self._mapped:
            return DDUFEntryFile(path, info["size"], view=self.archive.view(path))
        entry = self.archive.entry(path)
        read_range = lambda offset, length: self.archive.read_bytes(path, offset, length)  # noqa: E731
        return DDUFEntryFile(path, entry.length, read_range=read_range)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        if start is None and end is None and self.info(path)["type"] == "file":
            return self.archive.read_bytes(path)
        return super().cat_file(path, start=start, end=end, **kwargs)

    def ukey(self, path: str) -> str:
        from fsspec.utils import tokenize

        return tokenize(path, self.fo, self.protocol)

    def close(self) -> None:
        if self._owns:
            self.archive.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
