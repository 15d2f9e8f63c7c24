"""Content identity on this machine: hashing with a stat-keyed memory of verified files, and the
Hugging Face cache layout (``models--org--name/{blobs,snapshots,refs}``).

Standard library at import time (``dduf refs`` and ``dduf validate`` stay fast): paths come from the same
environment variables huggingface_hub reads, evaluated at call time (so tests and long-running processes can
change them); the git blob hash is huggingface_hub's, imported on first use."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..storage import cache_dirs
from ..storage.cache_dirs import hf_hub_cache
from ..storage.confined import Confined
from ..storage.signed import Signer, StatKey, stat_key

logger = logging.getLogger(__name__)

# The Hub stores these in Git LFS by default (its .gitattributes template) and every file over 10 MB:
# the cache blob of an LFS file is named by its sha256, that of a regular file by its git blob sha1.
LFS_EXTENSIONS = (".safetensors", ".model", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
LFS_SIZE = 10 * 1000 * 1000
CHUNK = 8 << 20
VERIFIED_FILE = "verified.json"
VERIFIED_VERSION = 3  # 3: signed (storage/signed.py); 2: unsigned, 1: no device in the stat key (both ignored)
MAX_VERIFIED = 50_000  # oldest entries are dropped past this: the memory must stay a small file
MAX_VERIFIED_BYTES = 32 << 20  # what reading it may take (50,000 entries of a long path and a digest)


def hf_cache_dirs(cache_dir: str | os.PathLike | None = None) -> list[Path]:
    """The caches to search: ``cache_dir`` first when given, then the default one."""
    out: list[Path] = []
    for d in ([Path(cache_dir).expanduser()] if cache_dir else []) + [hf_hub_cache()]:
        if d not in out:
            out.append(d)
    return out


def dduf_cache_dir() -> Path:
    """Where dduf_plus.refs keeps verified hashes and views of cache blobs: ``cache_dir("refs")``."""
    return cache_dirs.cache_dir("refs")


def repo_folder_name(repo_id: str, repo_type: str = "model") -> str:
    """``org/name`` -> ``models--org--name``, as ``huggingface_hub.file_download.repo_folder_name``. Not
    imported from there: that module pulls in huggingface_hub's HTTP stack (about 1 s here, measured), on
    the offline cache lookups of ``dduf refs``; tests/test_hf_cache_layouts.py checks the two agree."""
    return "--".join([f"{repo_type}s", *repo_id.split("/")])


def is_lfs_by_default(filename: str, size: int) -> bool:
    return filename.endswith(LFS_EXTENSIONS) or size >= LFS_SIZE


def is_commit(revision: str | None) -> bool:
    return revision is not None and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)


# --- hashing -----------------------------------------------------------------------------------------
def sha256_file(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        if hasattr(hashlib, "file_digest"):  # 3.11+: readinto a reused buffer, GIL released
            return hashlib.file_digest(f, "sha256").hexdigest()
        h = hashlib.sha256()
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
        return h.hexdigest()


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob: what the Hub reports (and the cache names blobs) for non-LFS files.
    huggingface_hub's own (``utils.sha.git_hash``; a light module, imported on first use)."""
    from huggingface_hub.utils.sha import git_hash

    return git_hash(data)


def git_blob_sha1_file(path: str | os.PathLike) -> str:
    return git_blob_sha1(Path(path).read_bytes())


class VerifiedHashes:
    """sha256 of files already hashed here, keyed by real path and remembered while (size, mtime_ns,
    inode, device) stay the same: a second load of a partial archive hashes nothing.

    Entries are also keyed ``<archive>#<entry>`` for members of other .dduf archives. The JSON file is
    signed with its folder's secret (:mod:`dduf_plus.storage.signed`, the trust model of every hash memo: a file
    written by anyone else is ignored), rewritten atomically (through
    :class:`~dduf_plus.storage.confined.Confined`, rooted at its folder) and merged with what other processes
    wrote meanwhile."""

    def __init__(self, path: Path | None = None):
        self.path = path or dduf_cache_dir() / VERIFIED_FILE
        self._lock = threading.Lock()
        self._entries: dict[str, list[Any]] | None = None
        self._dirty: dict[str, list[Any]] = {}
        self._signer: Signer | None = None

    @property
    def signer(self) -> Signer:
        if self._signer is None:  # on first use: constructing the memo creates nothing
            box = Confined(self.path.parent)
            self._signer = Signer(box, box.root, writable=True, version=VERIFIED_VERSION)
        return self._signer

    def _load(self) -> dict[str, list[Any]]:
        try:
            data = self.signer.read(self.path, MAX_VERIFIED_BYTES)
        except OSError:  # its folder cannot be made: nothing remembered
            return {}
        entries = data.get("entries") if data is not None else None
        return entries if isinstance(entries, dict) else {}

    @property
    def entries(self) -> dict[str, list[Any]]:
        if self._entries is None:
            self._entries = self._load()
        return self._entries

    @staticmethod
    def _key(path: str | os.PathLike, member: str | None) -> str:
        real = os.path.realpath(path)
        return f"{real}#{member}" if member else real

    def lookup(self, path: str | os.PathLike, member: str | None = None) -> str | None:
        """The remembered sha256 of ``path`` (or of ``member`` of archive ``path``) if it is unchanged."""
        try:
            key = stat_key(path)
        except OSError:
            return None
        with self._lock:
            rec = self.entries.get(self._key(path, member))
        # a record of another length (0.11's had no ctime) is no record: the file is hashed again
        if isinstance(rec, list) and len(rec) == len(key) + 1 and StatKey(*rec[:-1]) == key \
                and isinstance(rec[-1], str):
            return rec[-1]
        return None

    def remember(self, path: str | os.PathLike, sha256: str, member: str | None = None,
                 key: StatKey | None = None) -> None:
        try:
            key = key or stat_key(path)
        except OSError:
            return
        rec = [*key, sha256]
        with self._lock:
            self.entries[self._key(path, member)] = rec
            self._dirty[self._key(path, member)] = rec
        self.save()

    def sha256(self, path: str | os.PathLike) -> str:
        """sha256 of a file, hashing it only if it changed (or was never seen) since it was last hashed."""
        return self.remembered(path, lambda: sha256_file(path))

    def remembered(self, path: str | os.PathLike, compute: Callable[[], str], member: str | None = None, *,
                   since: StatKey | None = None) -> str:
        """The digest remembered for ``path`` (or ``member`` of archive ``path``) while the file is unchanged,
        else ``compute()``, remembered only if the file's stat is still what it was before (``since``: when the
        bytes were mapped or opened earlier): a file written while it was read is never remembered. The one
        trust rule of the memo, for every digest kept in it."""
        known = self.lookup(path, member)
        if known is not None:
            return known
        before = since or stat_key(path)
        digest = compute()
        if stat_key(path) == before:
            self.remember(path, digest, member, key=before)
        return digest

    def save(self) -> None:
        with self._lock:
            if not self._dirty:
                return
            merged = self._load()
            merged.update(self._dirty)
            if len(merged) > MAX_VERIFIED:
                merged = dict(list(merged.items())[-MAX_VERIFIED:])
            try:
                saved = self.signer.write(self.path, {"entries": merged})
            except OSError:
                saved = False
            if not saved:  # a read-only home must not break loading: we just hash again next time
                logger.debug("cannot save verified hashes to %s", self.path)
                return
            self._entries = merged
            self._dirty.clear()


_VERIFIED: dict[Path, VerifiedHashes] = {}


def verified_hashes() -> VerifiedHashes:
    """The process-wide memory of verified hashes for the current DDUF_PLUS_CACHE."""
    path = dduf_cache_dir() / VERIFIED_FILE
    if path not in _VERIFIED:
        _VERIFIED[path] = VerifiedHashes(path)
    return _VERIFIED[path]


# --- the Hugging Face cache layout ---------------------------------------------------------------------
def repo_cache(cache: Path, repo_id: str) -> Path:
    return cache / repo_folder_name(repo_id)


def snapshot_dir(cache: Path, repo_id: str, revision: str | None) -> Path | None:
    """The snapshot folder of ``repo_id`` at ``revision`` (a commit, or a ref such as main), if cached."""
    root = repo_cache(cache, repo_id)
    revision = revision or "main"
    if is_commit(revision):
        commit = revision
    else:
        try:
            commit = (root / "refs" / revision).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
    snap = root / "snapshots" / commit
    return snap if snap.is_dir() else None


def blob_index(caches: Iterable[Path]) -> dict[str, Path]:
    """{blob name: path} over every ``models--*/blobs`` of the given caches. Only directory listings:
    blob names are the Hub's sha256 (LFS files) or git sha1 (regular files), nothing is hashed."""
    out: dict[str, Path] = {}
    for cache in caches:
        try:
            repos = [e for e in os.scandir(cache) if e.is_dir() and e.name.startswith("models--")]
        except OSError:
            continue
        for repo in sorted(repos, key=lambda e: e.name):
            try:
                with os.scandir(os.path.join(repo.path, "blobs")) as blobs:
                    for blob in blobs:
                        # "<etag>.incomplete" (an interrupted download) never matches a hash
                        if "." not in blob.name and blob.name not in out:
                            out[blob.name] = Path(blob.path)
            except OSError:
                continue
    return out


_SHA1_OR_SHA256 = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")


def blob_name_of(path: Path, repo: Path | None = None) -> str | None:
    """For a snapshot file that is a symlink into ``<repo>/blobs/`` (``repo``: the ``models--*`` folder;
    without it any folder named ``blobs``), the blob's name: the Hub's sha256 or git sha1. None for
    anything else: a real file (a cache written without symlinks), a link elsewhere, a name that is not a
    hash. A name is trusted only there, in the repo's own blob store."""
    try:
        target = Path(os.path.realpath(path))
        blobs = Path(os.path.realpath(repo / "blobs")) if repo is not None else None
    except OSError:
        return None
    if blobs is not None and target.parent != blobs:
        return None
    if target.parent.name != "blobs" or not _SHA1_OR_SHA256.match(target.name):
        return None
    return target.name


LINK_MODES = ("copy", "hardlink", "none")


def add_to_hf_cache(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    cache_dir: str | os.PathLike | None = None,
    commit: str | None = None,
    ref: str = "main",
    files: Mapping[str, str | os.PathLike] | None = None,
    link: str = "copy",
) -> Path:
    """Put a local pipeline folder into a Hugging Face cache as ``repo_id`` (an air-gapped machine, a
    test, a benchmark): blobs named like the Hub names them, snapshot symlinks, ``refs/<ref>``.

    ``files`` maps repo paths to local files (default: every file under ``folder``); ``link`` is
    ``"copy"`` or ``"hardlink"`` (how blobs are made; a hard link falls back to a copy across file
    systems), or ``"none"``: real files in ``snapshots/`` and no blobs, what huggingface_hub writes on a
    machine without symlinks (Windows without developer mode, some containers). Every write goes through
    :class:`~dduf_plus.storage.confined.Confined` rooted at the cache. Returns the snapshot folder.

    Example:
        >>> add_to_hf_cache("sd15-local", "stable-diffusion-v1-5/stable-diffusion-v1-5", link="hardlink")
    """
    if link not in LINK_MODES:
        raise ValueError(f"link={link!r}: expected one of {', '.join(LINK_MODES)}")
    box = Confined(Path(cache_dir) if cache_dir else hf_hub_cache())
    repo = repo_folder_name(repo_id)
    if files is None:
        base = Path(folder)
        files = {p.relative_to(base).as_posix(): p for p in sorted(base.rglob("*")) if p.is_file()}
    commit = commit or hashlib.sha1(repr(sorted((k, os.fspath(v)) for k, v in files.items())).encode()).hexdigest()
    snap = box.mkdir(box.path(repo, "snapshots", commit))
    for rel, src in files.items():
        src = Path(src)
        target = box.path(repo, "snapshots", commit, *rel.split("/"))
        box.mkdir(target.parent)
        box.unlink(target)  # a link or file from an earlier call (never followed)
        if link == "none":
            box.copy_file(src, target)
            continue
        size = src.stat().st_size
        name = sha256_file(src) if is_lfs_by_default(rel, size) else git_blob_sha1_file(src)
        blob = box.path(repo, "blobs", name)
        if not blob.exists():
            box.copy_file(src, blob, hardlink=link == "hardlink")
        box.symlink(os.path.relpath(blob, target.parent), target)
    box.write_bytes(box.path(repo, "refs", *ref.split("/")), commit.encode())
    return snap
