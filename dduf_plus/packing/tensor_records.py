"""The ``tensors`` record of a reference (:mod:`dduf_plus.refs.model_dirs`: how app model folders find a component
by content) for every kind of source a pack compares with: a folder, a Hugging Face cache snapshot (``--base
org/repo`` with the repo in the cache), a ``.dduf`` archive (the component's entries, hashed from the mapped
file) and, where the source's bytes are not on this machine (a Hub repo compared by file hashes, a hosted
archive), the local copy the pack found byte-identical to it.

Only bytes whose sha256 the reference records (or that are the source's own files the records were read from)
are hashed, once per file: the digest is remembered in dduf_plus' hash memory by (path, stat), per archive entry
for archives, so packing again against the same BASE hashes nothing. No torch here."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import DDUFError, DDUFPackError
from ..format.json_budget import SHARD_INDEX_JSON_BUDGET
from ..format.pack import FileRegion, LocalFile
from ..format.safetensors_header import SafetensorsHeader
from ..refs import cache as _cache
from ..refs.resolve import Spec
from ..refs.tensor_digest import (
    MAX_CONFIG,
    MEMBER,
    WeightFiles,
    check_shard_index,
    make_record,
    recorded_weights,
    remembered,
    tensor_record,
    tensors_digest,
)
from .reference_source import hash_local_files

logger = logging.getLogger(__name__)

__all__ = ["reference_tensors", "archive_tensor_record"]

CONFIG = "config.json"


def _weights(files: Mapping[str, Any]) -> WeightFiles | None:
    """The safetensors weights a record is made for (one file, or shards and their index: as
    :func:`tensor_record` picks them), else None."""
    return recorded_weights(files) if CONFIG in files else None


def reference_tensors(src: Spec | None, sub: str, files: Mapping[str, Any], revision: str | None,
                      local: Mapping[str, LocalFile] | None = None) -> dict[str, Any]:
    """``{"tensors": record}`` for a reference to ``src``'s ``sub`` recording ``files``, or {} where there is
    nothing to record (no safetensors weights and config, a source whose bytes are not at hand and no
    local copy with the recorded bytes). Never raises for a source that cannot be read: the reference then
    resolves as before, by its files' sha256 only. A hostile shard index (D011, D013) is refused:
    :class:`DDUFPackError`."""
    if src is None or _weights(files) is None:
        return {}
    try:
        if src.kind == "folder":
            return tensor_record(Path(src.location) / sub, files)
        if src.kind == "hub":
            found = _hf_cache_record(src.location, src.revision or revision, sub, files)
            if found:
                return found
        if src.kind == "dduf":
            return archive_tensor_record(Path(src.location), sub, files)
    except DDUFPackError:  # the BASE's shard index says other shards than it has: never recorded silently
        raise
    except (OSError, DDUFError) as e:  # the reference still resolves by its files' hashes
        logger.info("%s: no tensor digest recorded (%s)", sub, str(e).splitlines()[0][:200])
        return {}
    return _local_record(files, local) if local else {}


def _hf_cache_record(repo: str, revision: str | None, sub: str, files: Mapping[str, Any]) -> dict[str, Any]:
    """From the snapshot of ``repo`` at ``revision`` in the Hugging Face cache, when its files are there (they are
    what pack compared with; nothing is downloaded for this)."""
    found = _weights(files)
    for cache in _cache.hf_cache_dirs(None):
        snap = _cache.snapshot_dir(cache, repo, revision)
        folder = snap / sub if snap is not None else None
        if folder is not None and found and all((folder / f).is_file() for f in (*found.shards, found.shard_index, CONFIG)
                                                 if f is not None):
            return tensor_record(folder, files)
    return {}


def _local_record(files: Mapping[str, Any], local: Mapping[str, LocalFile]) -> dict[str, Any]:
    """From the local copy when it holds the recorded bytes (sha256 as the reference records them: the files the
    pack found identical to the source's; their hashes are remembered, so nothing is hashed twice)."""
    found = _weights(files)
    if found is None:
        return {}
    names = [*found.shards, *([found.shard_index] if found.shard_index else []), CONFIG]
    if any(f not in local for f in names):
        return {}
    mine = {f: local[f] for f in names}
    got = hash_local_files(mine)
    if any(not files[f].get("sha256") or got[f]["sha256"] != files[f]["sha256"] for f in mine):
        return {}
    c = mine[CONFIG]
    if all(isinstance(w, Path) for w in mine.values()) and isinstance(c, Path):
        return tensor_record(c.parent, files) if all(w == c.parent / f for f, w in mine.items()) else {}
    if all(isinstance(w, FileRegion) for w in mine.values()) and isinstance(c, FileRegion):
        sub = c.member.rpartition("/")[0]
        same = all(isinstance(w, FileRegion) and w.path == c.path and w.member == f"{sub}/{f}" for f, w in mine.items())
        return _entry_record(c.path, sub, c.read_bytes(), files) if same else {}
    return {}


def archive_tensor_record(path: Path, sub: str, files: Mapping[str, Any]) -> dict[str, Any]:
    """From a ``.dduf`` archive's ``sub/`` entries: its safetensors headers (parsed and checked when the archive
    was opened) and its tensors hashed from the mapped file."""
    from ..format.archive import DDUFArchive

    if _weights(files) is None:
        return {}
    with DDUFArchive(path) as archive:
        config = archive.read_bytes(f"{sub}/{CONFIG}") if archive.entry(f"{sub}/{CONFIG}").length <= MAX_CONFIG else b""
    return _entry_record(path, sub, config, files) if config else {}


def _entry_record(path: Path, sub: str, config: bytes, files: Mapping[str, Any]) -> dict[str, Any]:
    """The record of the weights entries (one, or shards and their index) of ``sub/`` in archive ``path`` and
    the component's config bytes ``config`` (which must be the recorded config.json: the record carries its
    text for the search to rebuild it)."""
    from ..format.archive import DDUFArchive

    found = _weights(files)
    recorded = files.get(CONFIG, {}).get("sha256")
    if found is None or len(config) > MAX_CONFIG or (recorded and hashlib.sha256(config).hexdigest() != recorded):
        return {}
    try:
        text = config.decode("utf-8")
    except UnicodeDecodeError:
        return {}
    with DDUFArchive(path) as archive:
        headers = {s: archive.headers.get(f"{sub}/{s}") for s in found.shards}
        if any(h is None for h in headers.values()):
            return {}
        at = {s: archive.entry(f"{sub}/{s}").offset for s in found.shards}
        if found.shard_index is not None:
            entry = f"{sub}/{found.shard_index}"
            if entry not in archive.entries:
                return {}
            if archive.entry(entry).length > SHARD_INDEX_JSON_BUDGET.bytes:
                raise DDUFPackError(f"{path}: {entry} is over its JSON budget (D013)", code="D013")
            check_shard_index(f"{path}: {sub}", found.shard_index, archive.read_bytes(entry),
                              {s: h for s, h in headers.items() if h is not None})
    checked = {s: h for s, h in headers.items() if h is not None}
    return make_record(_entry_digest(path, sub, found, checked, at), checked.values(), text)


def _entry_digest(path: Path, sub: str, found: WeightFiles, headers: Mapping[str, SafetensorsHeader],
                  at: Mapping[str, int]) -> str:
    """:func:`tensors_digest` of the safetensors files (one, or shards) stored at bytes ``at`` of ``path``,
    remembered per (archive, entry, stat)."""
    member = f"{sub}/{found.shard_index or found.shards[0]}#{MEMBER}"
    # tensors_digest reads tensor t at header.data_start + t.begin of the file it is given: an entry at byte
    # ``at`` of the archive is that same file shifted by ``at`` (data_start is 8 + header_length)
    shifted = [(path, h._replace(header_length=at[s] + h.header_length)) for s, h in sorted(headers.items())]
    return remembered(path, member, lambda: tensors_digest(shifted))
