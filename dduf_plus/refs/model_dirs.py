"""References found in the model folders apps already keep (ComfyUI's ``models/vae``, ``models/text_encoders``...)
by content, not by path or file hash.

A reference records (optional field ``tensors``, written by ``dduf pack``) a digest of the component's tensors
in diffusers' naming: per tensor, sorted by name, its name, dtype, shape and the sha256 of its bytes; and a layout
digest of the same without the bytes. The file's own sha256 does not survive a re-save (other metadata, other
order), the tensors' digest does. Searching (``load_dduf(model_dirs=...)``, ``DDUF_PLUS_MODEL_DIRS``,
``--model-dir``):

1. the folders are walked within budgets (depth, files; symlinked folders are not followed, a symlinked file
   only when it resolves to a regular file) for ``.safetensors`` files;
2. each header is read with the format layer's budgets, and only a file whose tensor count, byte total and
   layout digest fit the reference is hashed (tensor by tensor, by positioned reads: never a map, which a
   concurrent truncation turns into SIGBUS);
3. a verified file is remembered by (path, size, mtime, inode) in dduf_plus' hash memory, so a second load
   hashes nothing; a changed file is hashed again; a part a layout reader found is remembered with its map
   (:mod:`.part_memo`), so a second process runs no reader either;
4. a file whose header fits but whose bytes differ is skipped and said.

The match is used as it is, memory-mapped from the descriptor whose stat is the verified one (:class:`InPlace`,
also for a whole file in diffusers' names): a view folder holds the recorded config (its text is in the
record, checked against the recorded sha256). One command (a load, ``dduf complete``, ``dduf refs``) searches
once for all its references (:func:`search_session`: one walk, one header read per file, a budget). A file that is a pure rename of diffusers'
names (an LDM VAE, a CLIP under ``text_model.``) is found here by its header alone; any other original layout
(an LDM UNet, OpenCLIP, SD3's MMDiT, BFL's Flux, each component's part of a full checkpoint) is read by a
*layout reader* the torch floor registers (:func:`add_layout_reader`,
:mod:`dduf_plus.packing.model_dir_layouts`): it maps each diffusers tensor to byte ranges of the file (or a
transposed 2-D tensor), header only; the part is hashed from those ranges and remembered. Either is used in
place (:class:`InPlace`: the loader views the user's file at those ranges, nothing copied but the few tensors
whose bytes are not one range); a consumer that needs a real diffusers-named file (``dduf complete``, export)
calls :meth:`InPlace.copy`, which writes it once into dduf_plus' cache, hashing the bytes as it writes them.
Standard library only (no torch)."""

from __future__ import annotations

import contextvars
import hashlib
import itertools
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, NamedTuple

from ..errors import DDUFError, DDUFFormatError, DDUFIOError
from ..format import spec
from ..format.original_layout import diffusers_vae_names
from ..format.safetensors_header import SafetensorsHeader, TensorInfo, read_file_header
from ..format.weights import classify
from ..storage.confined import Confined
from ..storage.signed import StatKey
from . import part_memo
from .cache import dduf_cache_dir, sha256_file, stat_key, verified_hashes
from .shard_dirs import ShardReads, ShardSet, check_shard_folder
from .tensor_digest import (
    MAX_CONFIG,
    MEMBER,
    RECORD_KEY,
    SLICE,
    VERSION,
    FileReads,
    WeightFiles,
    digest_line,
    layout_digest,
    open_reads,
    recorded_weights,
    remembered,
    remembered_digest,
)

logger = logging.getLogger(__name__)

__all__ = ["ENV", "InPlace", "LayoutReader", "Match", "Part", "Rejected", "Search", "Source", "add_layout_reader",
           "diffusers_header", "find_component", "part_copy", "part_digest", "part_problem", "search_dirs",
           "search_session", "verified_digest"]

ENV = "DDUF_PLUS_MODEL_DIRS"
MAX_DEPTH = 8  # ComfyUI: models/<kind>/<maker>/<file>: a few levels
MAX_FILES = 20_000  # directory entries looked at, over all folders
# Candidate files weighed against a reference, over one command (every reference of a load together): an archive
# of 200 references into model folders weighed every file 200 times (a walk, a header read, the layout readers).
MAX_CHECKS = 50_000
MAX_HELD_TENSORS = 200_000  # tensor records of the headers one search keeps (about 60 MB; SDXL's checkpoint: 2,515)
WHOLE_FILE = "diffusers"  # the layout of a file found for a sharded reference: read as it is


class Rejected(NamedTuple):
    path: str
    why: str


class Source(NamedTuple):
    """One diffusers tensor of a file in another layout: its name, dtype and shape (``info``: begin 0, end its
    byte count), and where its bytes lie in the file's data section: ``ranges`` concatenated in order, or with
    ``rows`` > 0 the one range as a [rows, n] matrix whose transpose the tensor is."""

    info: TensorInfo
    ranges: tuple[tuple[int, int], ...]
    rows: int = 0


class Part(NamedTuple):
    """A component found in a file by a layout reader: what it is (for messages) and its diffusers tensors."""

    layout: str  # "LDM UNet under model.diffusion_model.", ...
    data_start: int  # the file's data section
    tensors: dict[str, Source]


# A layout reader: (the file's header, the reference's config, its tensor count, its byte total) -> the parts
# it sees in the file (checked here against the record), or why a part that could have fit does not map.
LayoutReader = Callable[[SafetensorsHeader, Mapping[str, Any], int, int], Iterable["Part | str"]]
_READERS: list[LayoutReader] = []


def add_layout_reader(reader: LayoutReader) -> None:
    """Register a reader of original layouts (the torch floor's: refs/ imports no torch). Idempotent."""
    if reader not in _READERS:
        _READERS.append(reader)


class InPlace(NamedTuple):
    """A match in another layout, used where it lies: the user's file, the part of it that holds the
    component's diffusers tensors, and the digest those tensors were verified against."""

    path: Path
    part: Part
    digest: str
    weights: str  # the recorded weights file name the part stands for
    key: StatKey  # the file's stat when it was matched: a loader refuses it changed since

    def copy(self) -> Path:
        """The part as a real file in diffusers' names (``dduf complete`` and export copy or read one): a file
        already in diffusers' names (one file found for a sharded reference) is its own copy."""
        if self.part.layout == WHOLE_FILE:
            if not self.unchanged():
                raise DDUFFormatError(f"{self.path}: changed since its tensors were verified; nothing was written")
            return self.path
        return part_copy(self.path, self.part, self.digest)

    def unchanged(self) -> bool:
        try:
            return stat_key(self.path) == self.key
        except OSError:
            return False


class Match(NamedTuple):
    files: dict[str, Path]  # recorded file name -> file on disk (the match, and the config written to the cache)
    source: str
    rejected: list[Rejected]
    # where the loader maps the tensors from (every match has one): ``files`` then holds the config,
    # and the file itself only when it is in diffusers' names as one file (what ``dduf complete`` copies)
    in_place: InPlace | None = None
    keys: dict[str, StatKey] | None = None  # a folder of shards: each file's stat when it was verified


def search_dirs(given: Iterable[str | os.PathLike] | None = None) -> list[Path]:
    """The model folders to search: ``given`` then ``DDUF_PLUS_MODEL_DIRS`` (``os.pathsep``-separated)."""
    out: list[Path] = []
    env = os.environ.get(ENV, "")
    for d in [*(given or ()), *(p for p in env.split(os.pathsep) if p.strip())]:
        path = Path(os.fspath(d)).expanduser()
        if path not in out:
            out.append(path)
    return out


# --- parts of files in other layouts (a layout reader's :class:`Part`) ----------------------------------------
# A tensor the file holds transposed is read whole into memory: OpenCLIP-bigG's text projection, the largest a
# layout reader makes, is 6.5 MB; a hostile header's [n, n] across a sparse 100 GB file was a 100 GB buffer.
MAX_TRANSPOSED = 256 << 20
_FORMATS: dict[int, Literal["B", "H", "I", "Q"]] = {1: "B", 2: "H", 4: "I", 8: "Q"}  # element sizes a transpose moves (as unsigned integers: bytes only)


def _itemsize(dtype: str) -> int:
    bits = spec.DTYPE_BY_TORCH[dtype].bits
    if bits % 8 or bits // 8 not in _FORMATS:
        raise DDUFFormatError(f"{dtype}: packed sub-byte values cannot be read from another layout")
    return bits // 8


def part_problem(part: Part, data_size: int) -> str | None:
    """Why a reader's part cannot be read from a data section of ``data_size`` bytes (a hostile file or a
    reader's bug), or None: every range inside the data section, the ranges of each tensor adding up to its
    shape and dtype, a transpose one 2-D range."""
    for name, src in part.tensors.items():
        info = src.info
        n = 1
        for d in info.shape:
            n *= d
        try:
            want = n * _itemsize(info.dtype)
        except (KeyError, DDUFFormatError) as e:
            return f"{name}: {e}"
        if any(not 0 <= b <= e <= data_size for b, e in src.ranges) or sum(e - b for b, e in src.ranges) != want:
            return f"{name}: its byte ranges {list(src.ranges)[:4]} do not lie in the file or do not make {want} bytes"
        if info.nbytes != want or src.rows < 0 or (src.rows and (len(src.ranges) != 1 or len(info.shape) != 2
                                                               or info.shape[1] != src.rows)):
            return f"{name}: a malformed transpose or size"
        if src.rows and want > MAX_TRANSPOSED:  # gathered in memory whole (hashing, copying, the loader's copy)
            return f"{name}: a transposed tensor of {want} bytes (at most {MAX_TRANSPOSED} are gathered in memory)"
    return None


def _source_chunks(view: FileReads, start: int, src: Source) -> Iterator[memoryview | bytes]:
    """The bytes of one diffusers tensor, in slices (a transposed tensor: a block of its rows at a time)."""
    if src.rows:
        (b, e), = src.ranges
        fmt = _FORMATS[_itemsize(src.info.dtype)]
        flat, rows = view[start + b:start + e].cast(fmt), src.rows
        cols = len(flat) // rows  # the file's matrix is [rows, cols]; the tensor's row j is its column j
        try:  # Python steps: min(rows, cols) per slice (0.9.0: one per column; [1, 10**8]: 10**8 steps)
            if rows > cols:
                for j in range(cols):
                    yield flat[j::cols].tobytes()
                return
            step = max(1, SLICE // (rows * flat.itemsize))  # columns per block
            for j0 in range(0, cols, step):
                n = min(step, cols - j0)
                block = memoryview(bytearray(n * rows * flat.itemsize)).cast(fmt)
                for i in range(rows):  # block[k * rows + i] = flat[i * cols + j0 + k]
                    block[i::rows] = flat[i * cols + j0:i * cols + j0 + n]
                yield block
        finally:
            flat.release()
        return
    for b, e in src.ranges:
        for pos in range(b, e, SLICE):
            yield view[start + pos:start + min(e, pos + SLICE)]


def part_digest(path: Path, part: Part) -> str:
    """:func:`tensors_digest` of a part: every diffusers tensor hashed from its ranges (the same digest a file in
    diffusers' names holding those tensors has)."""
    h = hashlib.sha256(f"dduf-tensors-v{VERSION}\n".encode())
    with open_reads(path) as view:
        for name in sorted(part.tensors):
            src = part.tensors[name]
            t = hashlib.sha256()
            for chunk in _source_chunks(view, part.data_start, src):
                t.update(chunk)
                if isinstance(chunk, memoryview):
                    chunk.release()
            h.update(digest_line(src.info) + t.digest())
    return h.hexdigest()


def _hashing(path: Path, part: Part) -> Callable[[], str]:
    return lambda: part_digest(path, part)


def _part_member(part: Part) -> str:
    """The hash memory's key for a part: what it is and exactly where each tensor's bytes come from."""
    h = hashlib.sha256()
    for name in sorted(part.tensors):
        src = part.tensors[name]
        h.update(f"{digest_line(src.info).decode()}{src.ranges}{src.rows}\n".encode())
    return f"{MEMBER}-part-{h.hexdigest()[:32]}"


# --- the search ------------------------------------------------------------------------------------------------
def _record(reference: Mapping[str, Any]) -> dict[str, Any] | str:
    """The reference's ``tensors`` record, checked (it comes from an untrusted archive), or why not usable."""
    rec = reference.get(RECORD_KEY)
    if rec is None:
        return "the reference records no tensor digest (an archive packed before model folders were searched)"
    ok = (isinstance(rec, dict) and rec.get("version") == VERSION and isinstance(rec.get("count"), int)
          and isinstance(rec.get("bytes"), int) and isinstance(rec.get("config"), str)
          and len(rec["config"]) <= MAX_CONFIG
          and all(isinstance(rec.get(k), str) and len(rec[k]) == 64 for k in ("sha256", "layout")))
    return rec if ok else "the reference's tensor digest record is malformed"


def _walk(dirs: Sequence[Path]) -> Iterator[Path]:
    """``.safetensors`` files under ``dirs``, breadth first, within :data:`MAX_DEPTH` and :data:`MAX_FILES`."""
    seen = 0
    queue = [(d, 0) for d in dirs]
    while queue:
        folder, depth = queue.pop(0)
        try:  # never more entries than the budget has left (a folder of millions is not read whole)
            with os.scandir(folder) as it:
                entries = sorted(itertools.islice(it, MAX_FILES - seen + 1), key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            seen += 1
            if seen > MAX_FILES:
                logger.info("model folders: stopped after %d entries (the search budget)", MAX_FILES)
                return
            try:
                folder_here = e.is_dir(follow_symlinks=False)
                candidate = not folder_here and e.name.endswith(".safetensors") and e.is_file(follow_symlinks=True)
            except OSError:  # a link to itself (ELOOP), a target in an unreadable folder: not a candidate
                continue
            if folder_here and depth < MAX_DEPTH:
                queue.append((Path(e.path), depth + 1))
            elif candidate:
                yield Path(e.path)


def _recorded_weights(reference: Mapping[str, Any]) -> tuple[WeightFiles, str] | None:
    files = reference.get("files")
    if not isinstance(files, dict):
        return None
    found = recorded_weights(files)
    config = files.get("config.json")
    if found is None or not isinstance(config, dict) or not isinstance(config.get("sha256"), str):
        return None
    return found, config["sha256"]


class Search:
    """One command's model-folder search (a load, ``dduf complete``, ``dduf refs``), shared by all its references:
    each folder list walked once, each file's header read once (while its stat holds), each (file, record)
    weighed once, and at most :data:`MAX_CHECKS` weighings in all. Counts, never the clock."""

    def __init__(self) -> None:
        self.listings: dict[tuple[Path, ...], list[Path]] = {}
        self.headers: dict[Path, tuple[StatKey, SafetensorsHeader | str]] = {}
        self.checked: dict[tuple[Path, StatKey, str], tuple[str, SafetensorsHeader | Part] | str] = {}
        self.checks = 0
        self.held = 0  # tensors of the headers kept
        self.shards = ShardReads(self.header)  # folders of shards: each index parsed once per command

    def walk(self, dirs: Sequence[Path]) -> list[Path]:
        key = tuple(dirs)
        if key not in self.listings:
            self.listings[key] = list(_walk(dirs))
        return self.listings[key]

    def header(self, path: Path, key: StatKey) -> SafetensorsHeader | str:
        """The file's header (read once while its stat is ``key``), or why it is not a readable one."""
        known = self.headers.get(path)
        if known is None or known[0] != key:
            try:
                known = key, read_file_header(path, path.name, DDUFFormatError)
            except (OSError, DDUFError) as e:
                known = key, f"not a readable safetensors file ({str(e).splitlines()[0][:120]})"
            held = len(known[1].tensors) if isinstance(known[1], SafetensorsHeader) else 0
            if self.held + held <= MAX_HELD_TENSORS:  # past it, headers are read again (memory stays bounded)
                self.headers[path] = known
                self.held += held
        return known[1]

    def spent(self) -> bool:
        self.checks += 1
        return self.checks > MAX_CHECKS


_SEARCH: contextvars.ContextVar[Search | None] = contextvars.ContextVar("dduf_plus_model_dir_search", default=None)


@contextmanager
def search_session() -> Iterator[Search]:
    """One :class:`Search` for every :func:`find_component` inside (the outer one when nested): a command with
    many references walks and reads the folders once, within one budget."""
    current = _SEARCH.get()
    if current is not None:
        yield current
        return
    token = _SEARCH.set(Search())
    try:
        yield _SEARCH.get() or Search()
    finally:
        _SEARCH.reset(token)


def _spent_message(dirs: Sequence[Path]) -> str:
    logger.warning("model folders %s: the search stopped after %d candidate checks for this command's references "
                   "(its budget); the rest of them are not looked for there", ", ".join(map(str, dirs)), MAX_CHECKS)
    return (f"not searched: this command's model-folder search is over its budget ({MAX_CHECKS} candidate checks "
            "for all its references together; an archive with that many references into model folders is not "
            "searched further)")


def find_component(name: str, reference: Mapping[str, Any], dirs: Sequence[Path]) -> Match | str:
    """A file in ``dirs`` holding exactly the referenced tensors, or why none (with the rejected candidates).
    A sharded reference is matched by a folder of shards holding its tensors, however cut (:mod:`.shard_dirs`),
    or by one file holding all of them: read in place, as the one file the shards' name stands for
    (:attr:`WeightFiles.loaded_as`)."""
    rec = _record(reference)
    recorded = _recorded_weights(reference)
    if isinstance(rec, str):
        return rec
    if recorded is None:
        return "the reference is not one weights file (or shards and their index) and a config"
    weights, config_sha = recorded
    config = rec["config"].encode("utf-8")
    if hashlib.sha256(config).hexdigest() != config_sha:
        return "the recorded config text does not match the recorded config.json sha256"
    rejected: list[Rejected] = []
    search = _SEARCH.get() or Search()
    shard_folders: set[Path] = set()  # a sharded reference: each folder of shards checked as one, once
    for path in search.walk(dirs):
        if search.spent():
            return _spent_message(dirs)
        if weights.shard_index is not None and _is_shard(path) and path.parent not in shard_folders:
            shard_folders.add(path.parent)
            shards = check_shard_folder(path.parent, rec, search.shards)
            if isinstance(shards, ShardSet):
                return Match({**shards.files, "config.json": _config_file(config, config_sha)},
                             f"{path.parent} (shards)", rejected, keys=shards.keys)
            if shards:
                rejected.append(Rejected(str(path.parent), shards))
        try:  # the stat before the check is the one the match is verified at: changed since, refused later
            before = stat_key(path)
            why = _weighed(search, path, before, rec, config_sha)
            if isinstance(why, tuple) and stat_key(path) != before:
                why = "not readable (it changed while it was searched)"
        except (OSError, DDUFIOError) as e:  # gone, unreadable or changed since it was listed: a candidate less
            why = f"not readable ({str(e).splitlines()[0][:200]})"
        if isinstance(why, tuple):
            return _matched(path, before, why, weights, rec, _config_file(config, config_sha), rejected)
        if why:
            rejected.append(Rejected(str(path), why))
    reasons = "; ".join(f"{r.path}: {r.why}" for r in rejected[:5]) + ("; ..." if len(rejected) > 5 else "")
    return f"no file in {', '.join(map(str, dirs))} holds its tensors" + (f" (rejected: {reasons})" if reasons else "")


def _weighed(search: Search, path: Path, key: StatKey, rec: Mapping[str, Any],
             config_sha: str) -> tuple[str, SafetensorsHeader | Part] | str:
    """:func:`_check` of ``path`` at stat ``key`` for ``rec`` (whose config text has sha256 ``config_sha``: the
    memo keeps 64 characters, not the text), once per command: another reference recording the same tensors
    gets the same answer."""
    memo = (path, key, f"{rec['sha256']}{rec['layout']}{rec['count']},{rec['bytes']}:{config_sha}")
    if memo not in search.checked:
        search.checked[memo] = _check(path, rec, search.header(path, key))
    return search.checked[memo]


def _matched(path: Path, key: StatKey, found: tuple[str, SafetensorsHeader | Part], weights: WeightFiles,
             rec: Mapping[str, Any], config_file: Path, rejected: list[Rejected]) -> Match:
    """The match of ``path`` (verified at stat ``key``), always with its :class:`InPlace`: a loader maps exactly
    the file that was verified, never a path that may have been replaced since (0.10.0 mapped a whole file in
    diffusers' names by its path)."""
    layout, named = found
    part = named if isinstance(named, Part) else _renamed_part(layout or WHOLE_FILE, named)
    in_place = InPlace(path, part, rec["sha256"], weights.loaded_as, key)
    if not layout and isinstance(named, SafetensorsHeader) and weights.shard_index is None:
        return Match({weights.loaded_as: path, "config.json": config_file}, str(path), rejected, in_place)
    return Match({"config.json": config_file}, f"{path} ({part.layout} layout, read in place)", rejected, in_place)


_DIFFER = "its header fits but its tensors' bytes differ (skipped)"


def _is_shard(path: Path) -> bool:
    w = classify(path.name)
    return w is not None and w.sharded and not w.is_index


def _check(path: Path, rec: Mapping[str, Any], header: SafetensorsHeader | str) -> tuple[str, SafetensorsHeader | Part] | str:
    """(layout, the file's header in diffusers' naming, or the part of it a layout reader maps) when ``path``
    (whose ``header`` it is, or why it has none) holds the recorded tensors; "" when it is plainly another model
    (not said); else why it was rejected."""
    if isinstance(header, str):
        return header
    why = ""
    if len(header.tensors) == rec["count"] and sum(t.nbytes for t in header.tensors.values()) == rec["bytes"]:
        for layout, named in _layouts(header):  # the torch-free fast path: the names alone
            if layout_digest(named.tensors.values()) != rec["layout"]:
                continue
            if remembered_digest(path, named, layout) != rec["sha256"]:
                logger.warning("model folder file %s: its header fits the reference but its tensors' bytes differ: "
                               "skipped", path)
                return _DIFFER
            return layout, named
        why = "same size, other tensor names, dtypes or shapes (another layout or model)"
    found = _read_parts(path, header, rec)
    return found if isinstance(found, tuple) or found else why


def _read_parts(path: Path, header: SafetensorsHeader, rec: Mapping[str, Any]) -> tuple[str, Part] | str:
    """The registered layout readers' parts of the file, checked against the record: the header first (names,
    dtypes, shapes, ranges), then the bytes, hashed from the ranges (remembered per part)."""
    if not _READERS:
        return ""
    try:
        config = json.loads(rec["config"])
    except ValueError:
        return "the reference's config text is not JSON"
    if not isinstance(config, dict):
        return "the reference's config text is not a JSON object"
    why = ""
    try:
        key = stat_key(path)
    except OSError as e:
        return f"not readable ({e})"
    data_size = key.size - header.data_start
    known = _remembered_part(path, key, header, rec, data_size)
    if known is not None:  # found before: no reader runs (nothing of diffusers imported), nothing hashed
        return known.layout, known
    for reader in _READERS:
        try:
            parts = list(reader(header, config, rec["count"], rec["bytes"]))
        except DDUFError as e:  # a reader says what it refuses as a DDUFError
            parts = [str(e).splitlines()[0]]
        except Exception as e:  # a reader's bug on a hostile file: a rejected candidate, never a crash
            logger.debug("layout reader %r failed on %s", reader, path, exc_info=True)
            parts = [f"the layout reader failed ({type(e).__name__}: {str(e)[:200]})"]
        for part in parts:
            if isinstance(part, str):
                why = why or part
                continue
            bad = part_problem(part, data_size)
            if bad is not None:
                why = why or f"{part.layout}: {bad}"
                continue
            infos = [src.info for src in part.tensors.values()]
            if len(infos) != rec["count"] or layout_digest(infos) != rec["layout"]:
                why = why or f"{part.layout}: other tensor names, dtypes or shapes than the reference's"
                continue
            if remembered(path, _part_member(part), _hashing(path, part)) != rec["sha256"]:
                logger.warning("model folder file %s: its %s fits the reference but its tensors' bytes differ: "
                               "skipped", path, part.layout)
                return f"its {part.layout}: {_DIFFER}"
            _keep_part(path, key, rec, part)
            return part.layout, part
    return why


def _remembered_part(path: Path, key: StatKey, header: SafetensorsHeader, rec: Mapping[str, Any],
                     data_size: int) -> Part | None:
    """The part a layout reader found in ``path`` for ``rec`` before, from its remembered map
    (:mod:`.part_memo`), when it still holds: the file unchanged (``key``), the map's ranges inside the data
    section and making the recorded layout, and the hash memory holding the recorded digest for exactly those
    ranges of this file. Else None (the readers run): a map is untrusted, the digest memo is what vouches."""
    found = part_memo.recall(path, key, rec)
    if found is None or found.data_start != header.data_start:
        return None
    part = Part(found.layout, found.data_start, {n: Source(*t) for n, t in found.tensors.items()})
    infos = [src.info for src in part.tensors.values()]
    if part_problem(part, data_size) is not None or len(infos) != rec["count"] or layout_digest(infos) != rec["layout"]:
        return None
    return part if verified_hashes().lookup(path, _part_member(part)) == rec["sha256"] else None


def _keep_part(path: Path, key: StatKey, rec: Mapping[str, Any], part: Part) -> None:
    """Remember where ``part``'s tensors lie (its map) once the hash memory holds its digest at ``key``: a file
    changed while it was hashed (its digest not remembered) keeps no map."""
    try:
        if verified_hashes().lookup(path, _part_member(part)) == rec["sha256"] and stat_key(path) == key:
            part_memo.keep(path, key, rec, part)
    except OSError:  # gone since: nothing to remember
        pass


_VAE_PREFIXES = ("first_stage_model.", "vae.")


def _layouts(header: SafetensorsHeader) -> Iterator[tuple[str, SafetensorsHeader]]:
    """The file's tensors named as diffusers names them, in each layout they may be in: as they are, an LDM VAE
    (bare, or all under ``first_stage_model.`` / ``vae.``), a CLIP under ``text_model.``; renamed by the names
    alone (the same bytes)."""
    yield "", header
    keys = header.tensors
    prefix = next((p for p in _VAE_PREFIXES if all(k.startswith(p) for k in keys)), "")
    names = diffusers_vae_names({k.removeprefix(prefix): t.shape for k, t in keys.items()})
    if names is not None:
        renamed = {}
        for k, t in keys.items():
            name, shape = names[k.removeprefix(prefix)]
            renamed[name] = t._replace(name=name, shape=shape)
        yield "ldm-vae", header._replace(tensors=renamed)
    # transformers' CLIP as released (and in ComfyUI's clip_l / clip_g files): under ``text_model.``, which
    # transformers >= 5.6 saves without
    text = [k for k in keys if k != "text_projection.weight"]
    if text and all(k.startswith("text_model.") for k in text):
        flat = {k.removeprefix("text_model."): t._replace(name=k.removeprefix("text_model.")) for k, t in keys.items()}
        yield "text_model", header._replace(tensors=flat)


def _config_file(config: bytes, sha256: str) -> Path:
    """The recorded config text as a file in dduf_plus' cache (named by its sha256; written once)."""
    cache = Confined(dduf_cache_dir())
    cache.mkdir(cache.path("model-dirs"))
    path = cache.path("model-dirs", f"{sha256}.json")
    if path.is_symlink() or not path.is_file() or sha256_file(path) != sha256:
        cache.write_bytes(path, config)
    return path


def _renamed_part(layout: str, named: SafetensorsHeader) -> Part:
    """A file whose tensors are diffusers' renamed (an LDM VAE): a part whose every tensor is one range."""
    tensors = {t.name: Source(t._replace(begin=0, end=t.nbytes), ((t.begin, t.end),)) for t in named.tensors.values()}
    return Part(layout, named.data_start, tensors)


def verified_digest(path: Path) -> str | None:
    """The tensors' digest remembered for ``path`` (a file as :func:`find_component` matched it, in diffusers'
    names) while the file is unchanged since it was hashed, else None: ``dduf complete`` checks by this that
    the file it copied is still the one verified, without hashing it again."""
    return verified_hashes().lookup(path, MEMBER)


def diffusers_header(part: Part) -> tuple[bytes, SafetensorsHeader]:
    """The header of ``part`` as a file in diffusers' names (its raw bytes, length prefix included, and parsed):
    what :func:`part_copy` writes, and what a loader viewing the part in place answers for the virtual file.
    Widest elements first: every tensor then starts aligned to its element size (the header is padded to 8)."""
    # by bits, not _itemsize: a whole file in diffusers' names may hold packed sub-byte tensors (float4 pairs)
    order = sorted(part.tensors.values(), key=lambda s: (-spec.DTYPE_BY_TORCH[s.info.dtype].bits, s.info.name))
    records: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    infos: dict[str, TensorInfo] = {}
    position = 0
    for src in order:
        info = src.info._replace(begin=position, end=position + src.info.nbytes)
        records[info.name] = {"dtype": spec.DTYPE_BY_TORCH[info.dtype].safetensors, "shape": list(info.shape),
                              "data_offsets": [info.begin, info.end]}
        infos[info.name] = info
        position = info.end
    raw = json.dumps(records, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, SafetensorsHeader(len(raw), infos, {"format": "pt"})


def part_copy(path: Path, part: Part, digest: str) -> Path:
    """``part`` of ``path`` written once into dduf_plus' cache as a file in diffusers' names (named by the
    tensors' digest, remembered; one tensor's slices at a time, never the part in memory). The bytes are hashed
    as they are written, in the same pass: a file changed since it was verified is refused, nothing kept."""
    cache = Confined(dduf_cache_dir())
    cache.mkdir(cache.path("model-dirs"))
    out = cache.path("model-dirs", f"{digest}.safetensors")
    if not out.is_symlink() and out.is_file() and verified_hashes().lookup(out, MEMBER) == digest:
        return out
    raw, header = diffusers_header(part)
    per: dict[str, bytes] = {}
    with open_reads(path) as view, cache.atomic(out) as f:
        f.file.write(raw)
        for info in sorted(header.tensors.values(), key=lambda t: t.begin):
            src, t = part.tensors[info.name], hashlib.sha256()
            for chunk in _source_chunks(view, part.data_start, src):
                t.update(chunk)
                f.file.write(chunk)
                if isinstance(chunk, memoryview):
                    chunk.release()
            per[info.name] = t.digest()
        h = hashlib.sha256(f"dduf-tensors-v{VERSION}\n".encode())
        for name in sorted(per):
            h.update(digest_line(part.tensors[name].info) + per[name])
        if h.hexdigest() != digest:  # raised inside the ``with``: the partial file is removed
            raise DDUFFormatError(f"{path}: changed since its {part.layout} was verified (its tensors' bytes differ "
                                  "now); nothing was written")
    verified_hashes().remember(out, digest, MEMBER)  # what was written is what was hashed: no second pass
    return out
