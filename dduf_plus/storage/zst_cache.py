"""The content-keyed cache of decompressed ``.dduf.zst`` archives, and the private copy ``dduf validate``
decompresses into.

Layout under ``<cache>/zst/`` (``<cache>``: :func:`cache_root`)::

    <K>.dduf        the plain archive decompressed from a .zst whose sha256 is K (= its Hub LFS oid)
    <K>.json        its record: K, the archive's size and sha256, its stat key when written
    seen/<P>.json   the .zst at real path P (hashed): its stat key and K, so an unchanged file is hashed once
    .secret         32 random bytes (mode 0600, created here): every record is HMAC-signed with it

Nothing here trusts a name or a size. K is always the sha256 of the ``.zst``'s bytes, computed here or
read from a signed memo whose stat key (size, mtime_ns, inode, device) is the file's now. An entry is
served only with a signed record for K whose stat key is the entry's (or, when the stat changed, whose
sha256 the entry still hashes to). Anything else (no record, a record or memo planted by someone without
the secret, a modified entry) means: decompress again, atomically over it. Every write and removal goes
through :class:`~dduf_plus.storage.confined.Confined`.

Validation never writes here: :func:`validation_archive` decompresses into a private temporary folder
that is removed after the verdict (also on errors and Ctrl-C), unless a verified entry already exists."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import DDUFError, DDUFPathError, io_error
from .cache_dirs import cache_root
from .confined import Confined
from .signed import Signer, StatKey
from .zst import (
    CACHE_ENV,
    BudgetLike,
    DecompressionBudget,
    MiB,
    decompress_into,
    decompression_budget,
    is_zst,
    open_input,
    zstd_module,
)

logger = logging.getLogger(__name__)

RECORD_VERSION = 2  # version 1 (unsigned memos, no entry records) is ignored: entries are rewritten once
HASH_CHUNK = 8 * MiB


def content_key(path: str | os.PathLike) -> str:
    """The cache key of a ``.zst`` file: the sha256 of its bytes (= its Hub LFS oid), always computed
    from the bytes: a file's name (``blobs/<sha256>``) is never taken for its digest."""
    fd, size = open_input(Path(path))
    try:
        return _sha256_fd(fd, size)
    finally:
        os.close(fd)


def _sha256_fd(fd: int, size: int) -> str:
    """sha256 of the first ``size`` bytes of ``fd``, read into one reused buffer (constant memory: an
    mmap would count the whole file in the process's resident set)."""
    digest = hashlib.sha256()
    buffer = bytearray(HASH_CHUNK)
    view = memoryview(buffer)
    offset = 0
    while offset < size:
        n = os.preadv(fd, [view[: min(HASH_CHUNK, size - offset)]], offset)
        if n <= 0:
            raise DDUFError(f"file shrank while hashing it (at {offset} of {size} bytes)")
        digest.update(view[:n])  # hashlib releases the GIL on big updates
        offset += n
    return digest.hexdigest()


def _stat_key(st: os.stat_result) -> dict[str, int]:
    # a record without ctime_ns (written before 0.11.1) never matches: its entry is rehashed once, then re-recorded
    return dict(zip(("size", "mtime_ns", "ino", "dev", "ctime_ns"), StatKey.of(st), strict=True))


def _is_key(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


class _Cache:
    """One ``<cache>/zst`` folder: signed records, verified entries. ``writable=False`` (validation)
    creates nothing, not even the secret: without one there are no hits."""

    def __init__(self, root: Path, *, writable: bool):
        self.box = Confined(root, create=writable)
        self.writable = writable
        self.folder = self.box.root / "zst"
        self.signer = Signer(self.box, self.folder, writable=writable, version=RECORD_VERSION)

    def _read(self, path: Path) -> dict[str, Any] | None:
        return self.signer.read(path)

    def _write(self, path: Path, record: dict[str, Any]) -> None:
        if not self.signer.write(path, record):  # a read-only cache still serves verified entries
            logger.debug("cannot record %s", path)

    # --- the .zst -> key memo ------------------------------------------------------------------------
    def _memo_path(self, src: Path) -> Path:
        name = hashlib.sha256(str(src).encode("utf-8", "surrogateescape")).hexdigest()
        return self.folder / "seen" / f"{name}.json"

    def remembered_key(self, src: Path, st: os.stat_result) -> str | None:
        memo = self._read(self._memo_path(src))
        if memo is None or memo.get("path") != str(src) or not _is_key(memo.get("key")):
            return None
        return memo["key"] if all(memo.get(k) == v for k, v in _stat_key(st).items()) else None

    def remember_key(self, src: Path, st: os.stat_result, key: str) -> None:
        self._write(self._memo_path(src), {"path": str(src), **_stat_key(st), "key": key})

    # --- entries -------------------------------------------------------------------------------------
    def entry(self, key: str) -> Path:
        return self.folder / f"{key}.dduf"

    def _record_path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def verified_entry(self, key: str) -> Path | None:
        """The entry for ``key`` if its signed record vouches for its content: same stat key, or (stat
        changed: a copied or touched cache) rehashed to the recorded sha256, which is then re-recorded."""
        record = self._read(self._record_path(key))
        if record is None or record.get("zst_sha256") != key or not _is_key(record.get("sha256")):
            return None
        path = self.entry(key)
        try:
            self.box.check(path)
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0))
        except (OSError, DDUFPathError):
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != record.get("size"):
                return None
            now = _stat_key(st)
            if all(record.get(k) == v for k, v in now.items()):
                return path
            logger.info("the zst cache entry %s changed on disk since it was written: checking its sha256", path)
            if _sha256_fd(fd, st.st_size) != record["sha256"]:
                logger.warning("the zst cache entry %s does not hold what was decompressed there: replacing it", path)
                return None
        finally:
            os.close(fd)
        self._write(self._record_path(key), {**record, **now})
        return path

    def store(self, src: Path, key: str, *, budget: DecompressionBudget, threads: int, quiet: bool) -> Path:
        """Decompress ``src`` into a temporary file here, record its sha256, rename it over the entry."""
        final = self.entry(key)
        # mode 0644: mkstemp makes 0600, an archive is not a secret
        with self.box.atomic(final, mode=0o644, prefix=f".{key}.") as out:
            decompress_into(src, out.fd, self.folder, budget=budget, threads=threads, quiet=quiet, desc=final.name)
            st = os.fstat(out.fd)
            digest = _sha256_fd(out.fd, st.st_size)  # hot in the page cache
        # the rename moved the entry's ctime: its stat key is taken from the renamed file, the inode hashed above
        now = os.stat(final, follow_symlinks=False)
        if (now.st_ino, now.st_dev, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns):
            self._write(self._record_path(key), {"zst_sha256": key, "sha256": digest, **_stat_key(now)})
        return final


def _source(path: str | os.PathLike) -> tuple[Path, os.stat_result]:
    src = Path(path).resolve()
    try:
        st = os.stat(src)
    except OSError as e:
        raise io_error(f"cannot open {path}: {e.strerror}", e, path) from None
    if not stat.S_ISREG(st.st_mode):
        raise DDUFError(f"{path}: not a regular file")
    return src, st


def _key_of(cache: _Cache, src: Path, st: os.stat_result) -> str:
    """The sha256 of the .zst: from the signed memo while its stat key holds, else hashed (and
    remembered, unless the file changed while it was read)."""
    known = cache.remembered_key(src, st)
    if known is not None:
        return known
    key = content_key(src)
    try:
        unchanged = _stat_key(os.stat(src)) == _stat_key(st)
    except OSError:
        unchanged = False
    if unchanged:
        cache.remember_key(src, st, key)
    return key


def cached_decompress(
    path: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    threads: int = -1,
    quiet: bool = True,
    max_decompressed: BudgetLike = None,
) -> Path:
    """Decompress a ``.dduf.zst`` once and return the plain archive's path in the cache.

    The entry is ``<cache>/zst/<sha256 of the .zst>.dduf``: two copies of the same file share one entry
    and a changed file gets a new one. The key of each path is remembered (signed) with the file's stat
    key, so an unchanged file is hashed once; a hit is served only when the entry's signed record vouches
    for its content (see the module docstring). ``cache_dir`` defaults to :func:`cache_root`; decompression
    is bounded like :func:`~dduf_plus.storage.zst.decompress` (``max_decompressed``). Delete the folder to
    reclaim space; concurrent processes at worst decompress twice.

    Example:
        >>> archive_path = cached_decompress("sd15.dduf.zst")   # first call: hashes and decompresses
        >>> archive_path = cached_decompress("sd15.dduf.zst")   # later calls: two stats, two small JSON reads

    Raises:
        DDUFFormatError / DDUFIntegrityError / DecompressionBudgetError: as :func:`~dduf_plus.storage.zst.decompress`.
        DDUFError: the file is missing, or the cache cannot be written.
    """
    zstd_module()
    src, st = _source(path)
    budget = decompression_budget(max_decompressed)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    try:
        cache = _Cache(root, writable=True)
        key = _key_of(cache, src, st)
        hit = cache.verified_entry(key)
        if hit is not None:
            return hit
        logger.info("decompressing %s into the cache (%s)", src, cache.entry(key))
        return cache.store(src, key, budget=budget, threads=threads, quiet=quiet)
    except OSError as e:
        raise DDUFError(f"{path}: cannot decompress into the zst cache under {root} ({e.strerror or e}); "
                        f"set ${CACHE_ENV} to a writable folder") from None


@contextmanager
def validation_archive(path: str | os.PathLike, *, max_decompressed: BudgetLike = None) -> Iterator[Path]:
    """The plain archive behind ``path`` for ``dduf validate``, for the duration of the block.

    A ``.zst`` is decompressed (every frame's checksum and size verified, within the budget) into a
    private temporary folder (``$TMPDIR``) that is removed when the block ends, whatever happens: an
    upload that is invalid, over budget or interrupted leaves nothing behind, and the persistent cache
    is never written. Only an entry the cache already holds *and verifies* for this unchanged file is
    used in place. Any other path is yielded as is.

    Raises:
        DDUFFormatError: truncated stream, bad magic, inconsistent frames (validate: Z021).
        DDUFIntegrityError: a frame's content checksum does not match (validate: Z021).
        DecompressionBudgetError: over the budget or the free disk space (validate: Z022).
    """
    if not is_zst(path):
        yield Path(path)
        return
    zstd_module()
    src, st = _source(path)
    budget = decompression_budget(max_decompressed)
    try:
        cache = _Cache(cache_root(), writable=False)
        key = cache.remembered_key(src, st)
        hit = cache.verified_entry(key) if key is not None else None
    except (OSError, DDUFError):
        hit = None
    if hit is not None:
        yield hit
        return
    box = Confined(tempfile.gettempdir())
    with box.temp_dir(prefix="dduf-validate-") as folder:
        with box.temp_file(folder, prefix="archive-", suffix=".dduf") as (fd, out):
            decompress_into(src, fd, folder, budget=budget, name=os.fspath(path))
            os.close(fd)
        yield out
