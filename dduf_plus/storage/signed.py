"""The one trust model of dduf_plus's hash memos: a remembered sha256 is believed only from a record signed with
the cache folder's own secret, and only while the file's stat key (size, mtime_ns, inode, device, ctime_ns) is the
one recorded with it.

Both memos use it: the ``.zst`` -> content key memo and entry records of :mod:`dduf_plus.storage.zst_cache`,
and the verified hashes of referenced files (:class:`dduf_plus.refs.cache.VerifiedHashes`). A record written by
anyone without the secret (a shared or restored cache, a planted file) is no record: the file is hashed again.

The secret is ``<folder>/.secret``: 32 random bytes, created here with mode 0600, and used only while it is a
regular file of that size that its owner alone can read (a planted, linked or group-readable one is ignored, and
then nothing is believed)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import DDUFPathError
from .confined import Confined
from .fd_io import open_regular

SECRET_NAME = ".secret"
SECRET_SIZE = 32
MAX_RECORD = 64 << 10  # one record; a memo file of many records passes its own bound to read()


class StatKey(NamedTuple):
    """What says a file is unchanged since its hash was taken. ``ctime_ns``: a file rewritten in place with its
    size kept and its mtime put back (``touch -r``, ``os.utime``) keeps size, mtime, inode and device, but every
    write (and ``utime`` itself) moves the inode's change time, which no user call can set back."""

    size: int
    mtime_ns: int
    inode: int
    device: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> StatKey:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns)


def stat_key(path: str | os.PathLike) -> StatKey:
    return StatKey.of(os.stat(path))


def read_secret(path: Path) -> bytes | None:
    """The secret at ``path``, only if it is a regular file of the right size that only its owner (us) can
    read: a file someone else planted (another owner, group- or world-readable, a link) is not one."""
    try:
        opened = open_regular(path, follow_links=False)  # a FIFO planted as the secret: None, never blocked on
    except OSError:
        return None
    if opened is None:
        return None
    fd, st = opened
    try:
        if st.st_size != SECRET_SIZE:
            return None
        if os.name == "posix" and (st.st_uid != os.getuid() or st.st_mode & 0o077):
            return None
        data = os.read(fd, SECRET_SIZE + 1)
        return data if len(data) == SECRET_SIZE else None
    except OSError:
        return None
    finally:
        os.close(fd)


def read_regular(path: Path, max_bytes: int) -> bytes | None:
    """At most ``max_bytes`` of ``path`` when it is a regular file, else None: a FIFO planted in a record's place
    must not block the open (``O_NONBLOCK``) nor the read (a plain ``open()`` waited for a writer for ever),
    and a device or folder is no record."""
    opened = open_regular(path)
    if opened is None:
        return None
    fd = opened[0]
    try:
        chunks, left = [], max_bytes
        while left > 0 and (block := os.read(fd, min(left, 1 << 20))):
            chunks.append(block)
            left -= len(block)
        return b"".join(chunks)
    finally:
        os.close(fd)


class Signer:
    """Signed JSON records in one folder, every write through ``box`` (:class:`~.confined.Confined`).

    ``writable=False`` creates nothing, not even the secret: without one, no record is believed."""

    def __init__(self, box: Confined, folder: Path, *, writable: bool, version: int):
        self.box, self.folder, self.writable, self.version = box, folder, writable, version
        path = folder / SECRET_NAME
        secret = read_secret(path)
        if secret is None and writable:
            try:
                box.mkdir(folder)
                box.write_bytes(path, os.urandom(SECRET_SIZE))  # mkstemp: mode 0600 from the start
            except OSError:  # a read-only cache: nothing is remembered, files are hashed again
                pass
            secret = read_secret(path)  # another process may have won the race: use what is there
        self.secret = secret

    def mac(self, record: dict[str, Any]) -> str:
        assert self.secret is not None
        body = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self.secret, body, hashlib.sha256).hexdigest()

    def read(self, path: Path, max_bytes: int = MAX_RECORD) -> dict[str, Any] | None:
        """A record this folder's secret signed, or None (missing, unreadable, too big, unsigned, forged, old)."""
        if self.secret is None:
            return None
        try:
            self.box.check(path)
            raw = read_regular(path, max_bytes + 1)
            record = json.loads(raw) if raw is not None and len(raw) <= max_bytes else None
        except (OSError, ValueError, RecursionError, DDUFPathError):  # RecursionError: JSON nested past the interpreter
            return None
        if not isinstance(record, dict):
            return None
        mac = record.pop("mac", None)
        if not isinstance(mac, str) or not hmac.compare_digest(mac, self.mac(record)):
            return None
        return record if record.get("v") == self.version else None

    def write(self, path: Path, record: dict[str, Any]) -> bool:
        """Sign and write ``record`` atomically; False when it could not be (read-only cache, no secret)."""
        if not self.writable or self.secret is None:
            return False
        record = {**record, "v": self.version}
        data = json.dumps({**record, "mac": self.mac(record)}, separators=(",", ":")).encode()
        try:
            self.box.mkdir(path.parent)
            self.box.write_bytes(path, data)
        except (OSError, DDUFPathError):
            return False
        return True
