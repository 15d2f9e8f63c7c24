"""Writes beneath one folder held open by descriptor, the way ``openat2(RESOLVE_IN_ROOT)`` would make them.

:class:`~dduf_plus.storage.confined.Confined` checks a path (links resolved) and then acts on it: another local
user who can write into the folder could swap a component folder for a link leading out in between the two
system calls. Here nothing is acted on by path: the root is opened once, and every folder beneath it is reached
one name at a time with ``O_NOFOLLOW`` relative to its parent's descriptor. A link met on the way is read
(``readlinkat``) and its target walked the same way from the root, so a link inside the folder still works (the
user's layout) while one leading out is refused whenever it appears. Files are created exclusively beside their
target and renamed over it within the same folder descriptor (``renameat``: the target itself, a link or not,
is replaced, never followed).

Standard library only. Where the platform lacks descriptor-relative calls (Windows), :data:`AVAILABLE` is False
and callers use :class:`~dduf_plus.storage.confined.Confined`."""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from ..errors import DDUFIOError, DDUFPathError

AVAILABLE = {os.open, os.mkdir, os.stat, os.readlink, os.rename, os.unlink} <= os.supports_dir_fd
MAX_LINK_HOPS = 40  # as the kernel's own limit on links followed in one lookup
MAX_CREATE_RACES = 100  # a folder removed again each time it is made: give up rather than loop for ever
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FOLDER_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | _CLOEXEC


class Beneath:
    """A folder (created if missing) held open; :meth:`atomic` writes and :meth:`lexists` looks beneath it only.

    Example:
        >>> with Beneath(out_dir) as out, out.atomic("unet/config.json", mode=0o644) as fd:
        ...     write_all(fd, data)
    """

    def __init__(self, root: str | os.PathLike) -> None:
        path = Path(root).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
        except OSError as e:
            raise DDUFIOError(f"cannot use {path} as the output folder: {e.strerror or e}") from None
        self.root = path
        self._bases = {str(path.absolute()), str(path.resolve())}  # absolute link targets into the root

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> Beneath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lexists(self, name: str) -> bool:
        """Whether ``name`` (``/``-separated, relative to the root) exists, a link counted as itself."""
        folder, base = self._split(name)
        fd = self.folder(folder, create=False)
        if fd is None:
            return False
        try:
            os.stat(base, dir_fd=fd, follow_symlinks=False)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False
        finally:
            os.close(fd)

    def folder(self, parts: tuple[str, ...], *, create: bool) -> int | None:
        """A new descriptor of the folder ``parts`` beneath the root (made with its parents when ``create``; None
        when missing otherwise). Raises :class:`DDUFPathError` for a link on the way that leads out of the root
        and for a file where a folder must be."""
        stack, shown = [os.dup(self._fd)], [str(self.root)]  # the folders walked, from the root down
        todo, hops, races = list(parts), 0, 0
        try:
            while todo:
                part = todo.pop(0)
                if part in ("", "."):
                    continue
                if part == "..":
                    if len(stack) == 1:
                        raise DDUFPathError(f"refusing to write beneath {self.root}: {'/'.join(shown)} leads "
                                            f"above it")
                    os.close(stack.pop())
                    shown.pop()
                    continue
                opened = self._step(stack[-1], part, create)
                if opened is None:
                    return None
                if isinstance(opened, str):  # a link: walk its target instead (from the root if absolute)
                    hops += 1
                    if hops > MAX_LINK_HOPS:
                        raise DDUFPathError(f"refusing to write beneath {self.root}: more than {MAX_LINK_HOPS} "
                                            f"links at {'/'.join(shown)}/{part}")
                    todo = self._link_parts(stack, shown, part, opened) + todo
                    continue
                if opened == -1:  # made it, or lost a race: look again
                    races += 1
                    if races > MAX_CREATE_RACES:
                        raise DDUFIOError(f"cannot create {'/'.join(shown)}/{part}: it keeps disappearing")
                    todo.insert(0, part)
                    continue
                stack.append(opened)
                shown.append(part)
            return stack.pop()
        finally:
            for fd in stack:
                os.close(fd)

    def _step(self, parent: int, part: str, create: bool) -> int | str | None:
        """Open folder ``part`` of ``parent`` without following a link: its descriptor; the link's target (a
        str); -1 when it was missing and has just been made; None when missing and ``create`` is False."""
        try:
            return os.open(part, _FOLDER_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            try:
                os.mkdir(part, 0o777, dir_fd=parent)
            except FileExistsError:
                pass
            return -1
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                raise DDUFIOError(f"cannot open {part} beneath {self.root}: {e.strerror or e}") from None
        try:
            return os.readlink(part, dir_fd=parent)
        except OSError:  # not a link: a file (or a FIFO, a socket) where a folder must be
            raise DDUFPathError(f"refusing to write beneath {self.root}: {part} is not a folder") from None

    def _link_parts(self, stack: list[int], shown: list[str], part: str, target: str) -> list[str]:
        """The names to walk for a link ``part`` → ``target``; an absolute target restarts from the root (and
        must lie in it), a relative one continues from the link's folder."""
        if not os.path.isabs(target):
            return target.split("/")
        for base in self._bases:
            if target == base or target.startswith(base.rstrip("/") + "/"):
                while len(stack) > 1:
                    os.close(stack.pop())
                    shown.pop()
                return target[len(base):].split("/")
        where = "/".join([*shown, part])
        raise DDUFPathError(f"refusing to write beneath {self.root}: {where} is a link to {target}, outside "
                            f"{self.root}")

    @contextmanager
    def atomic(self, name: str, *, mode: int = 0o644) -> Iterator[int]:
        """A new file's descriptor, renamed over ``name`` when the block ends without error (removed otherwise):
        created exclusively (``O_EXCL | O_NOFOLLOW``) in the target's folder, ``mode`` less the umask."""
        folder, base = self._split(name)
        dir_fd = self.folder(folder, create=True)
        assert dir_fd is not None  # created
        try:
            tmp, fd = self._temp(dir_fd, base, name)
            try:
                yield fd
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(fd, mode & ~umask)
                os.close(fd)
                fd = -1
                try:
                    os.rename(tmp, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                except OSError as e:  # a folder in the file's place, a read-only mount...: name the file
                    raise DDUFIOError(f"cannot write {self.root / name}: {e.strerror or e}") from None
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                try:
                    os.unlink(tmp, dir_fd=dir_fd)
                except OSError:
                    pass
                raise
        finally:
            os.close(dir_fd)

    def _temp(self, dir_fd: int, base: str, name: str) -> tuple[str, int]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | _CLOEXEC
        for _ in range(MAX_CREATE_RACES):
            tmp = f".{base}.{secrets.token_hex(4)}.partial"
            try:
                return tmp, os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            except FileExistsError:
                continue
            except OSError as e:
                raise DDUFIOError(f"cannot write {self.root / name}: {e.strerror or e}") from None
        raise DDUFIOError(f"cannot write {self.root / name}: no free temporary name beside it")

    @staticmethod
    def _split(name: str) -> tuple[tuple[str, ...], str]:
        parts = PurePosixPath(name).parts
        return parts[:-1], parts[-1]
