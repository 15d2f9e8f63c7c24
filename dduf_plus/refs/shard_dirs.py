"""A sharded component found in an app's model folder as the folder of shards it is: ComfyUI's ``models/diffusers``
keeps whole diffusers pipelines, where a Flux transformer or a T5 encoder is several shards and their index.

The folder is checked as one component: its shard index (untrusted: :func:`~.tensor_digest.check_shard_index`)
names exactly its shards, their tensors' count, bytes and layout fit the reference's record, and the digest over
all of them (remembered per shard set by path and stat, :func:`~.tensor_digest.remembered_shards_digest`) is the
recorded one. The shards may be cut differently from the referenced ones (another ``max_shard_size``): the
content is what is compared, and the folder's own index says where each tensor lies. Standard library only."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import DDUFError, DDUFFormatError
from ..format.json_budget import SHARD_INDEX_JSON_BUDGET, parse_json_entry
from ..format.safetensors_header import SafetensorsHeader, read_file_header
from ..format.weights import classify, shard_map
from ..storage.confined import name_problem
from ..storage.signed import StatKey, read_regular, stat_key
from .tensor_digest import check_shard_index, layout_digest, remembered_shards_digest

logger = logging.getLogger(__name__)

__all__ = ["MAX_ENTRIES", "MAX_SHARDS", "ShardReads", "ShardSet", "check_shard_folder"]

MAX_SHARDS = 256  # shards of one component (diffusers' 10 GB default: a 2.5 TB model)
MAX_ENTRIES = 4096  # names looked at in one folder
MAX_INDEXES = 4  # shard indexes tried in one folder (one per variant, in practice)
MAX_HELD_INDEX_BYTES = 64 << 20  # index bytes one command keeps (past it, indexes are read again: memory bounded)


class ShardReads:
    """One command's reads of folders of shards (:class:`.model_dirs.Search` holds one): each index read and
    parsed, and each shard header read (through ``header``, the search's own), once while its stat holds, however
    many references are looked for (200 sharded references: not 200 parses of every index in the folders)."""

    def __init__(self, header: Callable[[Path, StatKey], SafetensorsHeader | str] | None = None):
        self._header = header
        self._indexes: dict[tuple[Path, StatKey], tuple[bytes, Any] | str] = {}
        self._held = 0

    def index(self, path: Path, key: StatKey) -> tuple[bytes, Any]:
        """The index's bytes and parsed value (read while its stat is ``key``); its error raised again."""
        known = self._indexes.get((path, key))
        if known is None:
            try:
                raw = _read_index(path)
                known = raw, _json(raw, path.name)
            except DDUFError as e:
                known = str(e)
            if isinstance(known, str) or self._held + len(known[0]) <= MAX_HELD_INDEX_BYTES:
                self._indexes[(path, key)] = known
                self._held += 0 if isinstance(known, str) else len(known[0])
        if isinstance(known, str):
            raise DDUFFormatError(known)
        return known

    def header(self, path: Path, key: StatKey) -> SafetensorsHeader:
        found = self._header(path, key) if self._header is not None else read_file_header(path, path.name,
                                                                                          DDUFFormatError)
        if isinstance(found, str):
            raise DDUFFormatError(found)
        return found


class ShardSet(NamedTuple):
    """A folder's shard index and shards holding the recorded tensors: {file name: path}, and each file's stat
    when it was verified (a loader refuses a file whose opened descriptor has another: replaced since)."""

    files: dict[str, Path]
    keys: dict[str, StatKey]


def check_shard_folder(folder: Path, rec: Mapping[str, Any], reads: ShardReads | None = None) -> ShardSet | str:
    """The shard index and shards in ``folder`` that hold exactly the recorded tensors; "" when the folder
    plainly holds another model (not said); else why it was rejected. ``reads``: the command's (each index and
    header read once for all its references)."""
    reads = reads or ShardReads()
    try:
        with os.scandir(folder) as it:
            names = sorted(e.name for e in itertools.islice(it, MAX_ENTRIES))
    except OSError as e:
        return f"not readable ({e})"
    why = ""
    indexes = [n for n in names if (w := classify(n)) is not None and w.is_index]
    for index in indexes[:MAX_INDEXES]:
        try:
            found = _shard_set(folder, index, set(names), rec, reads)
        except (OSError, DDUFError) as e:  # unreadable, hostile index or header: a candidate less, said
            found = f"{index}: {str(e).splitlines()[0][:200]}"
        if isinstance(found, ShardSet):
            return found
        why = why or found
    return why


def _shard_set(folder: Path, index: str, names: set[str], rec: Mapping[str, Any], reads: ShardReads) -> ShardSet | str:
    before = {index: stat_key(folder / index)}  # the stats the set is verified at: taken before it is read
    raw, value = reads.index(folder / index, before[index])
    weight_map = shard_map(value)
    if weight_map is None:
        return f"{index}: no 'weight_map' object of file names"
    if len(weight_map) != rec["count"]:
        return ""  # another model: told by its index alone (one entry per tensor), no shard opened
    shards = sorted(set(weight_map.values()))
    if len(shards) > MAX_SHARDS:
        return f"{index}: names {len(shards)} shards, more than {MAX_SHARDS}"
    for shard in shards:
        if name_problem(shard) is not None or shard not in names:
            return f"{index}: names {shard[:200]!r}, which is not a file beside it"
        # a shard of this index's stem and variant (as a reference's shards are): not x.bin, another index or
        # another variant's file, which a completed archive would hold under a name loaders select otherwise
        w, of = classify(shard), classify(index)
        if w is None or of is None or w.is_index or not w.sharded or (w.stem, w.variant) != (of.stem, of.variant):
            return f"{index}: names {shard[:200]!r}, which is not one of its shards (STEM-0000N-of-0000M.safetensors)"
    before.update((shard, stat_key(folder / shard)) for shard in shards)
    headers, seen = {}, 0
    for shard in shards:  # stop at the first shard past the recorded count: never every header of a hostile set
        headers[shard] = reads.header(folder / shard, before[shard])
        seen += len(headers[shard].tensors)
        if seen > rec["count"]:
            return ""
    infos = [t for h in headers.values() for t in h.tensors.values()]
    if len(infos) != rec["count"] or sum(t.nbytes for t in infos) != rec["bytes"]:
        return ""  # another model
    if layout_digest(infos) != rec["layout"]:
        return "same size, other tensor names, dtypes or shapes (another layout or model)"
    check_shard_index(str(folder), index, raw, headers)
    if remembered_shards_digest([(folder / s, headers[s]) for s in shards]) != rec["sha256"]:
        logger.warning("model folder %s: its shards fit the reference but their tensors' bytes differ: skipped", folder)
        return "its shards' header fits but their tensors' bytes differ (skipped)"
    files: dict[str, Path] = {index: folder / index, **{s: folder / s for s in shards}}
    if any(stat_key(path) != before[name] for name, path in files.items()):
        return "not readable (it changed while it was searched)"
    return ShardSet(files, before)


def _read_index(path: Path) -> bytes:
    """The index's bytes within its budget; a FIFO or device in its place is refused without blocking."""
    raw = read_regular(path, SHARD_INDEX_JSON_BUDGET.bytes + 1)
    if raw is None:
        raise DDUFFormatError(f"not a regular file (a FIFO, a device, a folder): {path}")
    if len(raw) > SHARD_INDEX_JSON_BUDGET.bytes:
        raise DDUFFormatError(f"over its JSON budget ({SHARD_INDEX_JSON_BUDGET.bytes} bytes) (D013)", code="D013")
    return raw


def _json(raw: bytes, index: str) -> Any:
    value, code, why = parse_json_entry(raw, index, budget=SHARD_INDEX_JSON_BUDGET)
    if code is not None:
        raise DDUFFormatError(f"{why} ({code})", code=code)
    return value

