"""Components referenced inside a hosted archive (``--ref vae=https://host/base.dduf``, ``hf://org/repo/x.dduf``).

The hosted archive is opened from its tail when its index agrees with its central directory (one request:
:mod:`dduf_plus.remote.indexed`, which checks each entry's local and safetensors header as its bytes arrive).
Only that component's entries are fetched, by range reads through :mod:`dduf_plus.storage.source` (its
deadlines, byte budgets and same-origin redirects); each is checked against the sha256 (or git blob id) the
*referencing* archive records, since the hosted archive's own index is only its writer's claim, and kept in
``cache_dir("remote")/entries/<content id>``. A second load finds every file there by content and makes no
request. Writes stay inside that folder (:class:`~dduf_plus.storage.confined.Confined`) and are atomic."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DDUFError, DDUFIntegrityError, DDUFReferenceError
from ..storage.cache_dirs import cache_dir
from ..storage.confined import Confined, plain_name
from . import cache as _cache

if TYPE_CHECKING:  # pragma: no cover
    from ..format.archive import DDUFArchive

logger = logging.getLogger("dduf_plus.refs.hosted")

CHUNK = 8 << 20


def entries_dir() -> Path:
    return cache_dir("remote") / "entries"


def content_id(record: Mapping[str, Any]) -> str | None:
    """The name a recorded file has in the cache: its sha256, else its git blob id."""
    value = record.get("sha256") or record.get("git_sha1")
    return str(value) if value else None


def cached_files(recorded: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, Path], list[str]]:
    """({filename: cached path}, [filenames not cached]) by content id and size (hashes are checked by the caller)."""
    folder = entries_dir()
    found: dict[str, Path] = {}
    missing: list[str] = []
    for fname, rec in sorted(recorded.items()):
        cid = content_id(rec)
        path = folder / plain_name(cid, "content id") if cid else None
        if path is not None and path.is_file() and path.stat().st_size == rec.get("size", path.stat().st_size):
            found[fname] = path
        else:
            missing.append(fname)
    return found, missing


def fetch_component(url: str, member: str, component: str, recorded: Mapping[str, Mapping[str, Any]],
                    files: list[str], *, token: str | bool | None = None) -> dict[str, Path]:
    """Fetch ``files`` of ``member`` in the archive at ``url`` into the entries cache, each verified against
    ``recorded``. Returns {filename: cached path}.

    Raises:
        DDUFIntegrityError: an entry's bytes are not the recorded ones (size or hash); nothing is kept.
        DDUFReferenceError: the hosted archive has no such component or entry.
        DDUFIOError: the URL cannot be read (see :mod:`dduf_plus.storage.source`).
    """
    from ..remote.indexed import open_indexed

    options: dict[str, Any] = {"token": token} if token not in (None, False) and url.startswith("hf://") else {}
    out: dict[str, Path] = {}
    with open_indexed(url, **options) as archive:  # from its tail when its index agrees (one request)
        if member not in archive.components or not archive.components[member].files:
            raise DDUFReferenceError(f"component {component!r}: {url} stores no component {member!r}")
        for fname in files:
            out[fname] = _fetch_entry(archive, url, member, component, fname, recorded[fname])
    return out


def _fetch_entry(archive: DDUFArchive, url: str, member: str, component: str, fname: str,
                 rec: Mapping[str, Any]) -> Path:
    name = f"{member}/{fname}"
    where = f"component {component!r}, file {fname} (entry {name} of {url})"
    if name not in archive:
        raise DDUFReferenceError(f"{where}: the hosted archive has no such entry")
    entry = archive.entry(name)
    if rec.get("size") is not None and entry.length != rec["size"]:
        raise DDUFIntegrityError(f"{where}: {entry.length} bytes, the reference records {rec['size']}; refused")
    cid = plain_name(content_id(rec), "content id")
    store = Confined(entries_dir())
    sha, git = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % entry.length)
    final = store.path(cid)
    # the one atomic writer: appears at ``final`` only when every check below passes (mode: mkstemp's 0600
    # as before; fsync off: a cache entry is re-verified by content, a lost one is fetched again)
    with store.atomic(final, fsync=False) as out:
        for offset in range(0, entry.length, CHUNK):
            data = archive.read_bytes(name, offset, min(CHUNK, entry.length - offset))
            sha.update(data)
            git.update(data)
            out.file.write(data)
        got_sha, got_git = sha.hexdigest(), git.hexdigest()
        if rec.get("sha256") and got_sha != rec["sha256"]:
            raise DDUFIntegrityError(f"{where}: sha256 {got_sha} differs from the recorded {rec['sha256']}; "
                                     "refused (the hosted archive changed, or was tampered with)")
        if not rec.get("sha256") and rec.get("git_sha1") and got_git != rec["git_sha1"]:
            raise DDUFIntegrityError(f"{where}: git blob sha1 {got_git} differs from the recorded "
                                     f"{rec['git_sha1']}; refused")
    _cache.verified_hashes().remember(final, got_sha)  # hashed as it arrived: the check does not read it again
    logger.info("%s: fetched %d bytes", where, entry.length)
    return final


def hosted_member_records(url: str, member: str, *, token: str | bool | None = None
                          ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]] | None:
    """({filename: {size, sha256}}, model_index) of ``member`` in a hosted archive, from its index (range
    reads of the directory only); an entry the index does not hash is hashed by fetching it. None if absent."""
    from ..remote.indexed import open_indexed

    options: dict[str, Any] = {"token": token} if token not in (None, False) and url.startswith("hf://") else {}
    with open_indexed(url, **options) as archive:  # from its tail when its index agrees (one request)
        comp = archive.components.get(member)
        if comp is None or not comp.files:
            return None
        records: dict[str, dict[str, Any]] = {}
        for fname in comp.files:
            entry = archive.entry(f"{member}/{fname}")
            sha = entry.sha256
            if sha is None:
                sha = hashlib.sha256(archive.read_bytes(entry.name)).hexdigest()
            records[fname] = {"size": entry.length, "sha256": sha}
        try:
            model_index = dict(archive.model_index)
        except (DDUFError, TypeError, ValueError):
            model_index = {}
        return records, model_index
