"""What a reference records of a component's tensors (its ``tensors`` field, written by ``dduf pack``) and how
it is computed, for the model-folder search (:mod:`.model_dirs`) and the packer (:mod:`dduf_plus.packing.tensor_records`).

The digest: per tensor, sorted by name, its name, dtype, shape and the sha256 of its bytes, over every file of
the component (one file, or shards and their index): the same for the same tensors in any file layout, order or
metadata, which a file's own sha256 is not after a re-save; the layout digest is the same without the bytes (what
a header alone is checked for). Files are read by positioned reads (:class:`FileReads`), never a map, which a
concurrent truncation turns into SIGBUS; each digest is kept in dduf_plus' hash memory by (path, stat), so a
file is hashed once. A shard index comes from an untrusted folder or archive: :func:`check_shard_index`.
Standard library only (no torch)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import DDUFFormatError, DDUFIOError, DDUFPackError
from ..format.json_budget import SHARD_INDEX_JSON_BUDGET, parse_json_entry
from ..format.safetensors_header import SafetensorsHeader, TensorInfo, read_file_header
from ..format.weights import classify, shard_map
from ..storage.confined import name_problem
from ..storage.fd_io import open_regular
from ..storage.signed import read_regular
from .cache import stat_key, verified_hashes

__all__ = ["MAX_CONFIG", "MEMBER", "RECORD_KEY", "SLICE", "VERSION", "FileReads", "WeightFiles", "check_shard_index",
           "digest_line", "layout_digest", "make_record", "open_reads", "recorded_weights", "remembered",
           "remembered_digest", "remembered_shards_digest", "tensor_record", "tensors_digest"]

RECORD_KEY = "tensors"  # the reference's field
VERSION = 1
MAX_CONFIG = 256 << 10  # the recorded config text
MEMBER = f"tensors-v{VERSION}"  # the hash memory's key for a file's tensor digest (beside its sha256)
SLICE = 4 << 20  # read and hashed per slice: one buffer, cache-sized (256 MB: 1.13x the old map's time, not 1.6x)


def digest_line(info: TensorInfo) -> bytes:
    return f"{info.name}\0{info.dtype}\0{','.join(map(str, info.shape))}\0".encode()


def layout_digest(tensors: Iterable[TensorInfo]) -> str:
    """sha256 over the tensors' (name, dtype, shape), sorted by name: what a header alone can be checked for."""
    h = hashlib.sha256(f"dduf-tensors-layout-v{VERSION}\n".encode())
    for info in sorted(tensors, key=lambda t: t.name):
        h.update(digest_line(info))
    return h.hexdigest()


def _tensor_sha(view: FileReads, start: int, info: TensorInfo) -> bytes:
    h = hashlib.sha256()
    begin, end = start + info.begin, start + info.end
    for pos in range(begin, end, SLICE):
        h.update(view[pos:min(end, pos + SLICE)])
    return h.digest()


def tensors_digest(files: Sequence[tuple[Path, SafetensorsHeader]]) -> str:
    """sha256 over every tensor's (name, dtype, shape, sha256 of its bytes), sorted by name, of ``files``
    (a component's shards): the same for the same tensors in any file layout, order or metadata."""
    per: dict[str, tuple[TensorInfo, bytes]] = {}
    for path, header in files:
        with open_reads(path) as view:
            for info in header.tensors.values():
                per[info.name] = (info, _tensor_sha(view, header.data_start, info))
    h = hashlib.sha256(f"dduf-tensors-v{VERSION}\n".encode())
    for name in sorted(per):
        info, digest = per[name]
        h.update(digest_line(info) + digest)
    return h.hexdigest()


class WeightFiles(NamedTuple):
    """The safetensors weights a reference records: one file, or shards and their index."""

    shards: tuple[str, ...]  # sorted; the one file when ``shard_index`` is None
    shard_index: str | None = None  # the shards' index file

    @property
    def loaded_as(self) -> str:
        """The one file the component is read as when found in one file: the shards' name without their
        numbers (``diffusion_pytorch_model.safetensors`` for ``diffusion_pytorch_model-0000N-of-00003...``)."""
        w = classify(self.shard_index) if self.shard_index is not None else None
        if w is None:
            return self.shards[0]
        return f"{w.stem}.{w.variant}.safetensors" if w.variant else f"{w.stem}.safetensors"


def recorded_weights(files: Iterable[object]) -> WeightFiles | None:
    """The weights among a reference's ``files`` (names): one safetensors file, or shards of one stem and variant
    with their one index; None for anything else (several variants, a stray index, no weights, a name that is
    not a plain file name: they come from untrusted listings and archives)."""
    weights = [(f, w) for f in files if isinstance(f, str) and (w := classify(f)) is not None]
    if len({w.variant for _f, w in weights}) != 1 or any(name_problem(f) is not None for f, _w in weights):
        return None
    indexes = [f for f, w in weights if w.is_index]
    tensors = tuple(sorted(f for f, w in weights if not w.is_index))
    if not indexes:
        return WeightFiles(tensors) if len(tensors) == 1 else None
    stems = {w.stem for _f, w in weights}
    if len(indexes) != 1 or not tensors or len(stems) != 1 or not all(w.sharded for _f, w in weights):
        return None
    found = WeightFiles(tensors, indexes[0])
    return found if name_problem(found.loaded_as) is None else None


def _shard_error(where: str, index: str, why: str, code: str = "D011") -> DDUFPackError:
    return DDUFPackError(f"{where}: shard index {index!r} {why} ({code})", code=code)


def check_shard_index(where: str, index: str, raw: bytes, headers: Mapping[str, SafetensorsHeader]) -> None:
    """Refuse (:class:`DDUFPackError`, D011 / D013) a shard index that does not say exactly where each of the
    shards' tensors lies: over its JSON budget, no ``weight_map``, naming a file that is not one of ``headers``'
    shards (a path, a missing shard), a shard it does not name, a tensor in two shards or in another shard than
    it says, a tensor no shard holds. ``where`` names the component (the index and shards are untrusted)."""
    value, code, why = parse_json_entry(raw, index, budget=SHARD_INDEX_JSON_BUDGET)
    if code is not None:
        raise _shard_error(where, index, str(why), code)
    weight_map = shard_map(value)
    if weight_map is None:
        raise _shard_error(where, index, "has no 'weight_map' object of file names")
    named = set()
    for shard in weight_map.values():
        if shard not in headers:
            shown = ", ".join(sorted(headers)[:4]) + (", ..." if len(headers) > 4 else "")
            raise _shard_error(where, index, f"names {shard!r}, which is not one of the component's shards ({shown})")
        named.add(shard)
    if set(headers) - named:
        raise _shard_error(where, index, f"does not name {sorted(set(headers) - named)[0]!r}, a shard beside it")
    seen: dict[str, str] = {}
    for shard in sorted(headers):
        for tensor in headers[shard].tensors:
            if tensor in seen:
                raise _shard_error(where, index, f"is beside tensor {tensor!r} in two shards ({seen[tensor]}, {shard})")
            if weight_map.get(tensor) != shard:
                raise _shard_error(where, index, f"puts tensor {tensor!r} in {weight_map.get(tensor)!r}; it is in "
                                                 f"{shard}")
            seen[tensor] = shard
    if len(seen) != len(weight_map):
        missing = sorted(set(weight_map) - set(seen))[0]
        raise _shard_error(where, index, f"names tensor {missing!r}, which no shard holds")


def make_record(digest: str, headers: Iterable[SafetensorsHeader], config: str) -> dict[str, Any]:
    """``{"tensors": record}`` of a component whose (every shard's) headers are ``headers``."""
    infos = [t for header in headers for t in header.tensors.values()]
    return {RECORD_KEY: {"version": VERSION, "sha256": digest, "layout": layout_digest(infos), "count": len(infos),
                         "bytes": sum(t.nbytes for t in infos), "config": config}}


def tensor_record(folder: Path, files: Mapping[str, Any]) -> dict[str, Any]:
    """The ``tensors`` field of a reference to the component in ``folder`` recording ``files``: {} when it has
    no safetensors weights (one file, or shards and their index) or its config is not small text (nothing to
    match then). A hostile shard index is refused (:func:`check_shard_index`)."""
    found = recorded_weights(files)
    if found is None or "config.json" not in files:
        return {}
    raw = b""
    try:  # read_regular: a FIFO in a file's place (swapped in after the listing) blocked the read for ever
        if found.shard_index is not None:
            index = read_regular(folder / found.shard_index, SHARD_INDEX_JSON_BUDGET.bytes + 1)
            if index is None:
                raise _shard_error(str(folder), found.shard_index, "is not a regular file")
            if len(index) > SHARD_INDEX_JSON_BUDGET.bytes:
                raise _shard_error(str(folder), found.shard_index, "is over its JSON budget", "D013")
            raw = index
        headers = {s: read_file_header(folder / s, s, DDUFFormatError) for s in found.shards}
        config = read_regular(folder / "config.json", MAX_CONFIG + 1)
        if config is None or len(config) > MAX_CONFIG:
            return {}
        text = config.decode("utf-8")
    except (OSError, UnicodeDecodeError, DDUFFormatError):
        return {}
    if found.shard_index is not None:
        check_shard_index(str(folder), found.shard_index, raw, headers)
    digest = remembered_shards_digest([(folder / s, headers[s]) for s in found.shards])
    return make_record(digest, headers.values(), text)


def remembered_shards_digest(files: Sequence[tuple[Path, SafetensorsHeader]]) -> str:
    """:func:`tensors_digest` of a component's files (one, or its shards), from dduf_plus' hash memory when
    every file is unchanged since: kept under the first file, keyed by every file's path and stat."""
    if len(files) == 1:
        return remembered_digest(*files[0])
    h = hashlib.sha256()
    for path, _header in files:
        h.update(f"{os.path.abspath(path)}\0{tuple(stat_key(path))}\n".encode())
    return remembered(files[0][0], f"{MEMBER}-shards-{h.hexdigest()[:32]}", lambda: tensors_digest(files))


def remembered_digest(path: Path, header: SafetensorsHeader, layout: str = "") -> str:
    """:func:`tensors_digest` of one file, from dduf_plus' hash memory when the file is unchanged since (a pack
    against the same BASE, a model folder searched again: nothing hashed)."""
    member = MEMBER + (f"-{layout}" if layout else "")
    return remembered(path, member, lambda: tensors_digest([(path, header)]))


def remembered(path: Path, member: str, compute: Callable[[], str]) -> str:
    """``compute()``'s digest of ``path`` under ``member``, from dduf_plus' hash memory (its one trust rule)."""
    return verified_hashes().remembered(path, compute, member)


class FileReads:
    """A file's bytes by positioned reads (``reads[a:b]``, valid until the next read), for hashing and copying:
    never a map, whose pages past a concurrent truncation kill the process (SIGBUS); a short read is an error
    naming the file. Slices up to :data:`SLICE` reuse one buffer (no page faults on fresh memory per slice)."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd, self.buffer = path, fd, bytearray()

    def __getitem__(self, span: slice) -> memoryview:
        want = span.stop - span.start
        if want > len(self.buffer):
            self.buffer = bytearray(want) if want > SLICE else bytearray(SLICE)
        view, got = memoryview(self.buffer)[:want], 0
        while got < want and (n := os.preadv(self.fd, [view[got:]], span.start + got)):
            got += n
        if got < want:
            raise DDUFIOError(f"{self.path}: the file changed while it was read (it ends before byte {span.stop})")
        return view


@contextmanager
def open_reads(path: Path) -> Iterator[FileReads]:
    """``path`` opened for :class:`FileReads`: without blocking (a FIFO put in its place) and only a regular file."""
    opened = open_regular(path)
    if opened is None:
        raise DDUFIOError(f"{path}: not a regular file")
    fd = opened[0]
    try:
        yield FileReads(path, fd)
    finally:
        os.close(fd)
