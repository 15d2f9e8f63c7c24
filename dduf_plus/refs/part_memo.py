"""The part maps the model-folder search remembers (:mod:`.model_dirs`): which byte ranges of a file in another
layout (an LDM UNet, BFL's Flux, OpenCLIP, a full checkpoint's part) are which diffusers tensor, kept once the
part's tensors matched a reference, so that a later process finds the part without running a layout reader
(which imports diffusers' single-file converter: about 2.2 s per process, measured).

One small file per (file, its stat, the reference's layout digest, tensor count and byte total) in
``cache_dir("refs")/parts/``, signed with the hash memory's secret (:class:`~dduf_plus.storage.signed.Signer`,
written atomically), at most :data:`MAX_MAPS` of them and :data:`MAX_MAP_BYTES` each. A map is no proof: it is
read as hostile input (its budget, every field's type and bound; the file, stat and reference it names must be
the ones asked for) and the search accepts what it says only when the hash memory holds the reference's digest
for exactly those ranges of that unchanged file (:func:`.model_dirs.find_component`). The hash memory
(``verified.json``) stays a file of digests. Standard library only (no torch)."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from ..format import spec
from ..format.safetensors_header import TensorInfo
from ..storage.signed import StatKey
from .cache import dduf_cache_dir, verified_hashes

logger = logging.getLogger(__name__)

__all__ = ["FOLDER", "MAX_MAPS", "MAX_MAP_BYTES", "PartMap", "keep", "map_path", "recall"]

FOLDER = "parts"
KIND = "dduf-part-map-v1"  # a signed record of another kind (the hash memory's file) renamed here is no map
MAX_MAP_BYTES = 8 << 20  # read budget of one map (SDXL's LDM UNet, 1,680 tensors: about 0.3 MB)
MAX_MAPS = 256  # maps kept; the oldest are removed past this
MAX_TENSORS = 8192  # the layout reader converts at most 4,096 keys
MAX_RANGES = 64  # ranges of one tensor (the readers make 1 or 2)
MAX_DIMS = 8
MAX_NAME = 1024

Ranges = tuple[tuple[int, int], ...]


class PartMap(NamedTuple):
    """What a map says (the fields of :class:`.model_dirs.Part`; each tensor's (info, ranges, rows) those of
    :class:`.model_dirs.Source`)."""

    layout: str
    data_start: int
    tensors: dict[str, tuple[TensorInfo, Ranges, int]]


def _for(path: Path, key: StatKey, rec: Mapping[str, Any]) -> dict[str, Any]:
    """What a map is for: the file (real path), its stat, and the reference's layout digest, count and bytes."""
    return {"file": os.path.realpath(path), "stat": list(key), "for": [rec["layout"], rec["count"], rec["bytes"]]}


def map_path(path: Path, key: StatKey, rec: Mapping[str, Any]) -> Path:
    """Where the map of ``path`` at stat ``key`` for record ``rec`` is kept (a changed file: another name)."""
    name = hashlib.sha256(json.dumps(_for(path, key, rec), sort_keys=True).encode()).hexdigest()
    return dduf_cache_dir() / FOLDER / f"{name}.json"


def keep(path: Path, key: StatKey, rec: Mapping[str, Any], part: tuple[str, int, Mapping[str, tuple[TensorInfo,
                                                                                                   Ranges, int]]]) -> None:
    """Remember ``part`` (verified: the hash memory holds its digest at ``key``) of ``path`` for ``rec``; nothing
    when the cache is read-only or the map would be over its budget (the readers then run again next time)."""
    layout, data_start, tensors = part
    rows = [[n, s[0].dtype, list(s[0].shape), [list(r) for r in s[1]], s[2]] for n, s in sorted(tensors.items())]
    record = {"kind": KIND, **_for(path, key, rec), "layout": layout, "data_start": data_start, "tensors": rows}
    if len(json.dumps(record)) > MAX_MAP_BYTES - 4096:  # the mac and version beside
        return
    out = map_path(path, key, rec)
    if verified_hashes().signer.write(out, record):
        _prune(out.parent)


def _prune(folder: Path) -> None:
    """At most :data:`MAX_MAPS` maps: the oldest (by mtime) removed. A planted folder of millions of entries is
    not read whole."""
    signer = verified_hashes().signer
    try:
        with os.scandir(folder) as it:
            found = [(e.stat(follow_symlinks=False).st_mtime_ns, e.name) for e in itertools.islice(it, 4 * MAX_MAPS)]
    except OSError:
        return
    for _mtime, name in sorted(found)[:max(0, len(found) - MAX_MAPS)]:
        try:
            signer.box.unlink(folder / name)
        except OSError:
            pass


def recall(path: Path, key: StatKey, rec: Mapping[str, Any]) -> PartMap | None:
    """The map kept for ``path`` at stat ``key`` and record ``rec``, parsed as untrusted input: None when there is
    none, it is over budget, unsigned or forged, for another file, stat or reference, or malformed. What it says
    is checked by the caller (ranges in the file, and the digest remembered for exactly those ranges)."""
    try:
        data = verified_hashes().signer.read(map_path(path, key, rec), MAX_MAP_BYTES)
    except RecursionError:  # JSON nested past the interpreter's depth: no map
        return None
    if data is None or data.get("kind") != KIND or any(data.get(k) != v for k, v in _for(path, key, rec).items()):
        return None
    try:
        return _parsed(data)
    except (TypeError, ValueError, KeyError) as e:
        logger.debug("part map of %s ignored: %s", path, e)
        return None


def _int(value: Any, low: int = 0) -> int:
    if type(value) is not int or value < low:
        raise ValueError(f"{value!r} is not an integer >= {low}")
    return value


def _str(value: Any, most: int) -> str:
    if not isinstance(value, str) or len(value) > most:
        raise ValueError("a name that is not a short string")
    return value


def _parsed(data: Mapping[str, Any]) -> PartMap:
    """The map's part, every field's type and bound checked (what is in range is checked by the caller)."""
    layout, start, rows = _str(data["layout"], MAX_NAME), _int(data["data_start"], 8), data["tensors"]
    if not layout.isprintable():  # it is said in messages and logs
        raise ValueError("a layout name with control characters")
    if not isinstance(rows, list) or not 0 < len(rows) <= MAX_TENSORS:
        raise ValueError("no tensor list, or too many tensors")
    tensors: dict[str, tuple[TensorInfo, Ranges, int]] = {}
    for row in rows:
        if not isinstance(row, list) or len(row) != 5:
            raise ValueError("a malformed tensor")
        name, dtype, shape, spans, transposed = row
        name = _str(name, MAX_NAME)
        kind = spec.DTYPE_BY_TORCH[_str(dtype, 32)]
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not isinstance(spans, list) \
                or not 0 < len(spans) <= MAX_RANGES or name in tensors or kind.bits % 8:
            raise ValueError(f"{name}: a malformed shape or ranges, or named twice")
        dims = tuple(_int(d) for d in shape)
        nbytes = kind.bits // 8
        for d in dims:
            nbytes *= d
        ranges: list[tuple[int, int]] = []
        for span in spans:
            if not isinstance(span, list) or len(span) != 2:
                raise ValueError(f"{name}: a malformed range")
            ranges.append((_int(span[0]), _int(span[1])))
        tensors[name] = (TensorInfo(name, kind.torch, dims, 0, nbytes), tuple(ranges), _int(transposed))
    return PartMap(layout, start, tensors)
