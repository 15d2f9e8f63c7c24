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

from ..errors import DDUFError
from ..format.pack import FileRegion, LocalFile
from ..format.safetensors_header import SafetensorsHeader
from ..format.weights import classify
from ..refs import cache as _cache
from ..refs.model_dirs import MAX_CONFIG, RECORD_KEY, VERSION, layout_digest, tensor_record, tensors_digest
from ..refs.resolve import Spec
from .reference_source import hash_local_files

logger = logging.getLogger(__name__)

__all__ = ["reference_tensors", "archive_tensor_record"]

CONFIG = "config.json"
_MEMBER = f"tensors-v{VERSION}"  # beside an archive entry's name in the hash memory (its sha256 is the entry's)


def _weights_name(files: Mapping[str, Any]) -> str | None:
    """The one safetensors weights file a record is made for (as :func:`tensor_record` picks it), else None."""
    weights = [f for f in files if f.endswith(".safetensors") and classify(f) is not None]
    return weights[0] if len(weights) == 1 and CONFIG in files else None


def reference_tensors(src: Spec | None, sub: str, files: Mapping[str, Any], revision: str | None,
                      local: Mapping[str, LocalFile] | None = None) -> dict[str, Any]:
    """``{"tensors": record}`` for a reference to ``src``'s ``sub`` recording ``files``, or {} where there is
    nothing to record (no single safetensors file and config, a source whose bytes are not at hand and no
    local copy with the recorded bytes). Never raises for a source that cannot be read: the reference then
    resolves as before, by its files' sha256 only."""
    if src is None or _weights_name(files) is None:
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
    except (OSError, DDUFError) as e:  # the reference still resolves by its files' hashes
        logger.info("%s: no tensor digest recorded (%s)", sub, str(e).splitlines()[0][:200])
        return {}
    return _local_record(files, local) if local else {}


def _hf_cache_record(repo: str, revision: str | None, sub: str, files: Mapping[str, Any]) -> dict[str, Any]:
    """From the snapshot of ``repo`` at ``revision`` in the Hugging Face cache, when its files are there (they are
    what pack compared with; nothing is downloaded for this)."""
    weights = _weights_name(files)
    for cache in _cache.hf_cache_dirs(None):
        snap = _cache.snapshot_dir(cache, repo, revision)
        folder = snap / sub if snap is not None else None
        if folder is not None and weights and (folder / weights).is_file() and (folder / CONFIG).is_file():
            return tensor_record(folder, files)
    return {}


def _local_record(files: Mapping[str, Any], local: Mapping[str, LocalFile]) -> dict[str, Any]:
    """From the local copy when it holds the recorded bytes (sha256 as the reference records them: the files the
    pack found identical to the source's; their hashes are remembered, so nothing is hashed twice)."""
    weights = _weights_name(files)
    if weights is None or weights not in local or CONFIG not in local:
        return {}
    mine = {f: local[f] for f in (weights, CONFIG)}
    got = hash_local_files(mine)
    if any(not files[f].get("sha256") or got[f]["sha256"] != files[f]["sha256"] for f in mine):
        return {}
    w, c = mine[weights], mine[CONFIG]
    if isinstance(w, Path) and isinstance(c, Path):
        return tensor_record(w.parent, files) if c == w.parent / CONFIG else {}
    if isinstance(w, FileRegion) and isinstance(c, FileRegion) and w.path == c.path:
        return _entry_record(w.path, w.member, c.read_bytes(), files)
    return {}


def archive_tensor_record(path: Path, sub: str, files: Mapping[str, Any]) -> dict[str, Any]:
    """From a ``.dduf`` archive's ``sub/`` entries: its safetensors header (parsed and checked when the archive
    was opened) and its tensors hashed from the mapped file."""
    from ..format.archive import DDUFArchive

    weights = _weights_name(files)
    if weights is None:
        return {}
    with DDUFArchive(path) as archive:
        config = archive.read_bytes(f"{sub}/{CONFIG}") if archive.entry(f"{sub}/{CONFIG}").length <= MAX_CONFIG else b""
    return _entry_record(path, f"{sub}/{weights}", config, files) if config else {}


def _entry_record(path: Path, entry: str, config: bytes, files: Mapping[str, Any]) -> dict[str, Any]:
    """The record of weights entry ``entry`` of archive ``path`` and the component's config bytes ``config``
    (which must be the recorded config.json: the record carries its text for the search to rebuild it)."""
    from ..format.archive import DDUFArchive

    recorded = files.get(CONFIG, {}).get("sha256")
    if len(config) > MAX_CONFIG or (recorded and hashlib.sha256(config).hexdigest() != recorded):
        return {}
    try:
        text = config.decode("utf-8")
    except UnicodeDecodeError:
        return {}
    with DDUFArchive(path) as archive:
        header = archive.headers.get(entry)
        if header is None:
            return {}
        at = archive.entry(entry).offset
    return {RECORD_KEY: {"version": VERSION, "sha256": _entry_digest(path, entry, header, at),
                         "layout": layout_digest(header.tensors.values()), "count": len(header.tensors),
                         "bytes": sum(t.nbytes for t in header.tensors.values()), "config": text}}


def _entry_digest(path: Path, entry: str, header: SafetensorsHeader, at: int) -> str:
    """:func:`tensors_digest` of the safetensors file stored at byte ``at`` of ``path``, remembered per (archive,
    entry, stat)."""
    memo, member = _cache.verified_hashes(), f"{entry}#{_MEMBER}"
    known = memo.lookup(path, member)
    if known is not None:
        return known
    before = _cache.stat_key(path)
    # tensors_digest reads tensor t at header.data_start + t.begin of the file it is given: an entry at byte
    # ``at`` of the archive is that same file shifted by ``at`` (data_start is 8 + header_length)
    shifted = header._replace(header_length=at + header.header_length)
    digest = tensors_digest([(path, shifted)])
    if _cache.stat_key(path) == before:  # an archive written while it was read is not remembered
        memo.remember(path, digest, member, key=before)
    return digest
