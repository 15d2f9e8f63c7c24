"""Every file-system write or removal dduf_plus makes goes through here, or through :mod:`.beneath` (an output
folder receiving an archive's entry names, walked by descriptor); tests/test_writes_confined.py lists the few
places that may not (the server's private temporary folder) and fails on any other.

Archives are untrusted: a name read from one (a component, a reference's subfolder or file name, an
entry) must never choose where something is written or what is removed. So:

* :func:`plain_name` refuses anything but a plain name (no separator, no ``.``/``..``, no control
  character, not empty) before it is joined into a path;
* a :class:`Confined` root resolves every target (symlinks included) and refuses one outside the root,
  for writes, renames, links and removals alike;
* temporary files and folders are created exclusively (``O_EXCL``/``O_NOFOLLOW``: a planted symlink is
  never followed), and only what this process created is removed on failure;
* every file dduf_plus writes appears whole or not at all: :class:`AtomicFile` (temp file beside the
  target, fsync, rename, fsync of the folder) is the one implementation, behind :meth:`Confined.atomic`
  and :meth:`Confined.write_bytes`.

Standard library only."""

from __future__ import annotations

import os
import shutil
import tempfile
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from ..errors import DDUFFormatError, DDUFIOError, DDUFPathError

MAX_PLAIN_NAME = 255  # one path component on every common file system


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a plain name (one path component, printable, not ``.``/``..``); None if it is."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not name or not name.strip():
        return "is empty"
    if name in (".", ".."):
        return "is a relative path ('.' or '..')"
    if "/" in name or "\\" in name:
        return "contains a path separator"
    if any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in name):
        return "contains control or format characters"
    if ":" in name:
        return "contains ':' (a drive or stream name on Windows)"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_PLAIN_NAME:
        return f"is longer than {MAX_PLAIN_NAME} bytes"
    return None


def component_name_problem(name: object) -> str | None:
    """A pipeline component name must also be what diffusers accepts as an attribute name."""
    why = name_problem(name)
    if why is None and not (isinstance(name, str) and name.isidentifier()):
        why = "is not a Python identifier (diffusers sets components as attributes)"
    return why


def plain_name(name: object, what: str = "name") -> str:
    """``name`` if it is a plain name, else :class:`DDUFFormatError` naming ``what`` and the rule."""
    why = name_problem(name)
    if why is not None:
        raise DDUFFormatError(f"{what} {name!r} {why}: refusing to use it as a file name")
    return name  # type: ignore[return-value]


class Confined:
    """A folder that writes and removals are confined to (an output folder, one of dduf_plus' caches).

    Example:
        >>> cache = Confined(Path("~/.cache/huggingface/dduf_plus/refs").expanduser())
        >>> view = cache.path("views", digest, component)   # each part must be a plain name
        >>> cache.remove_tree(view)                          # refused unless inside the root
    """

    def __init__(self, root: str | os.PathLike, *, create: bool = True):
        root = Path(root).expanduser()
        if create:
            root.mkdir(parents=True, exist_ok=True)
        self.root = root.resolve()

    def __repr__(self) -> str:
        return f"Confined({str(self.root)!r})"

    def path(self, *parts: str) -> Path:
        """``root / parts...`` after checking each part is a plain name and the result stays inside."""
        for part in parts:
            plain_name(part, "path component")
        return self.check(self.root.joinpath(*parts))

    def check(self, path: str | os.PathLike) -> Path:
        """``path`` (absolute or relative to the root) if it resolves inside the root, else DDUFPathError.
        The root itself is not a valid target."""
        path = Path(path)
        if not path.is_absolute():
            path = self.root / path
        resolved = path.resolve()
        if resolved == self.root or not resolved.is_relative_to(self.root):
            raise DDUFPathError(f"refusing to write {path}: it resolves to {resolved}, outside {self.root}")
        return path

    def mkdir(self, path: str | os.PathLike) -> Path:
        """Create ``path`` (and its parents) inside the root; the root itself is returned as is."""
        if Path(path).resolve() == self.root:
            return self.root
        path = self.check(path)
        path.mkdir(parents=True, exist_ok=True)
        self.check(path)  # a symlinked parent planted meanwhile is caught here
        return path

    @contextmanager
    def temp_file(self, folder: str | os.PathLike | None = None, *, prefix: str = ".tmp-",
                  suffix: str = ".partial") -> Iterator[tuple[int, Path]]:
        """An exclusively created temporary file (fd, path) in ``folder`` (default: the root); removed
        when the block raises, left for the caller to rename when it succeeds."""
        folder = self.mkdir(folder if folder is not None else self.root)
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=folder)  # O_EXCL | O_NOFOLLOW
        try:
            yield fd, Path(tmp)
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            Path(tmp).unlink(missing_ok=True)
            raise

    @contextmanager
    def temp_dir(self, folder: str | os.PathLike | None = None, *, prefix: str = ".tmp-") -> Iterator[Path]:
        """An exclusively created temporary folder; removed (with what is left in it) when the block ends."""
        folder = self.mkdir(folder if folder is not None else self.root)
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=folder))
        try:
            yield tmp
        finally:
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)

    def atomic(self, path: str | os.PathLike, *, fsync: bool = True, mode: int | None = None,
               prefix: str | None = None, suffix: str = ".partial") -> AtomicFile:
        """An :class:`AtomicFile` that will appear at ``path`` (inside the root) when committed."""
        return AtomicFile(self, path, fsync=fsync, mode=mode, prefix=prefix, suffix=suffix)

    def write_bytes(self, path: str | os.PathLike, data: bytes, *, fsync: bool = False,
                    mode: int | None = None) -> Path:
        """Write ``data`` to ``path`` atomically (:class:`AtomicFile`). A link planted at ``path`` is
        replaced, never followed (as :meth:`replace`): it cannot block the write."""
        with self.atomic(path, fsync=fsync, mode=mode) as out:
            out.file.write(data)
        return out.path

    def replace(self, src: str | os.PathLike, dst: str | os.PathLike) -> None:
        """Rename ``src`` over ``dst``; both must be inside the root. ``dst`` itself is not followed."""
        src, dst = self.check(src), self._check_link(dst)
        os.replace(src, dst)

    def symlink(self, target: str | os.PathLike, link: str | os.PathLike) -> None:
        """Create ``link`` (inside the root) pointing at ``target`` (anywhere: a link only lets us read)."""
        link = self._check_link(link)
        try:
            os.symlink(target, link)
        except OSError:  # no symlinks (some Windows setups): a hard link needs the same file system
            os.link(os.path.join(link.parent, target), link)  # a relative target is relative to the link

    def copy_file(self, src: str | os.PathLike, dst: str | os.PathLike, *, hardlink: bool = False) -> Path:
        """Put a copy of ``src`` (anywhere: it is only read) at ``dst`` (inside the root), atomically;
        with ``hardlink`` a hard link when the file system allows, else a copy."""
        dst = self._check_link(dst)
        with self.temp_dir(dst.parent, prefix=f".{dst.name}.") as folder:  # exclusive, private to us
            tmp = folder / "file"
            linked = False
            if hardlink:
                try:
                    os.link(src, tmp)
                    linked = True
                except OSError:  # another file system, or no hard links here
                    pass
            if not linked:
                with open(src, "rb") as source, open(tmp, "xb") as out:
                    shutil.copyfileobj(source, out, 8 << 20)
            self.replace(tmp, dst)
        return dst

    def remove_tree(self, path: str | os.PathLike) -> None:
        """Remove a folder (or file) inside the root. A symlink is removed itself, never followed."""
        path = self._check_link(path)
        if path.is_symlink() or path.is_file():
            path.unlink(missing_ok=True)
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)

    def unlink(self, path: str | os.PathLike) -> None:
        self._check_link(path).unlink(missing_ok=True)

    def _check_link(self, path: str | os.PathLike) -> Path:
        """For targets that are replaced or removed rather than followed: the *parent* must resolve
        inside the root and the last component must be a plain name (the entry itself may be a link)."""
        path = Path(path)
        if not path.is_absolute():
            path = self.root / path
        plain_name(path.name, "path component")
        parent = path.parent.resolve()
        if not (parent == self.root or parent.is_relative_to(self.root)):
            raise DDUFPathError(f"refusing to touch {path}: its folder resolves to {parent}, outside {self.root}")
        return parent / path.name


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename in it) to disk; a no-op where folders cannot be opened."""
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


class AtomicFile:
    """A file that appears at ``path`` whole or not at all: the one temp-file-then-rename writer.

    An exclusively created hidden temporary file beside ``path`` (``fd``, ``tmp``; or the buffered
    :attr:`file`); :meth:`commit` flushes it, fsyncs it (``fsync=True``), sets ``mode`` (less the umask;
    None keeps mkstemp's 0600, for private files), renames it over ``path`` through :meth:`Confined.replace`
    and fsyncs the folder; :meth:`abort` (or an exception in the ``with`` block, Ctrl-C included) closes
    and removes it. ``fsync=False`` keeps the atomic rename but skips flushing to disk, as ``cp`` does.

    Example:
        >>> with Confined(out_dir).atomic(out_dir / "model_index.json", mode=0o644) as out:
        ...     out.file.write(data)
    """

    def __init__(self, box: Confined, path: str | os.PathLike, *, fsync: bool = True, mode: int | None = None,
                 prefix: str | None = None, suffix: str = ".partial"):
        self.path = box._check_link(path)
        self._box, self._fsync, self._mode = box, fsync, mode
        folder = box.mkdir(self.path.parent)
        try:
            fd, tmp = tempfile.mkstemp(prefix=prefix or f".{self.path.name}.", suffix=suffix, dir=folder)
        except OSError as e:  # name the file asked for, never the temporary name beside it
            raise DDUFIOError(f"cannot write {self.path}: {e.strerror or e}") from None
        self.fd, self.tmp = fd, Path(tmp)
        self._file: BinaryIO | None = None
        self._finished = False

    @property
    def file(self) -> BinaryIO:
        """A buffered binary file over :attr:`fd` (flushed by :meth:`commit`)."""
        if self._file is None:
            self._file = os.fdopen(self.fd, "wb", closefd=False)
        return self._file

    def commit(self) -> Path:
        """Flush, fsync, close, rename over ``path`` (and fsync the folder); returns ``path``."""
        if self._finished:
            raise ValueError(f"{self.path}: this atomic write is already finished")
        try:
            self._close(sync=self._fsync)
            if self._mode is not None:
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(self.tmp, self._mode & ~umask)
            self._box.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        self._finished = True
        if self._fsync:
            fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        """Close and remove the temporary file (nothing appears at ``path``); safe to call twice."""
        if self._finished:
            return
        self._finished = True
        try:
            self._close(sync=False)
        except OSError:
            pass
        self.tmp.unlink(missing_ok=True)

    def _close(self, *, sync: bool) -> None:
        if self.fd < 0:
            return
        try:
            if self._file is not None:
                self._file.close()  # flushes; closefd=False leaves fd open
            if sync:
                os.fsync(self.fd)
        finally:
            fd, self.fd = self.fd, -1  # never closed twice (the number may be reused by then)
            os.close(fd)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()
