"""Content identity of a pipeline component: is this copy the same component as BASE's, as its libraries read it?

Trainers re-serialize: ``save_pretrained`` adds ``_name_or_path`` and library versions to every config,
transformers 5 rewrites ``tokenizer_config.json`` and no longer writes the slow tokenizer's files, and weights
come back in another file layout (one file instead of shards, another tensor order). Byte identity then finds
nothing in common although only the denoiser changed. Here two copies are the same when, per kind of file:

* **weights** (every ``.safetensors`` file of the chosen variant, shards together): the same tensor names, each
  with the same dtype, shape and bytes, whatever the files, their order, padding or ``__metadata__``;
* **configs** (``config.json``, ``scheduler_config.json``, ``preprocessor_config.json`` and other ``.json``):
  equal as parsed, less the bookkeeping keys libraries add on save (:data:`BOOKKEEPING_KEYS`), read as the library
  reads them (:func:`as_read`: ``_use_default_values``, ``torch_dtype``); a key one side lacks is read as the value
  of the other only when it is the library's default (:func:`library_defaults`);
* **tokenizers**: ``tokenizer.json`` (vocabulary, merges, normalizer, added tokens) equal as parsed,
  ``tokenizer_config.json`` less the keys transformers adds on save (:data:`TOKENIZER_SAVE_KEYS`; the
  ``added_tokens_decoder`` it drops is in ``tokenizer.json``), the slow tokenizer's files (``vocab.json``,
  ``merges.txt``, ...) redundant where both sides have the same ``tokenizer.json``;
* **anything else** (``.txt``, ``.model``, templates): equal bytes.

torch-free (a pack against BASE imports no torch): tensors are compared on the mapped bytes, and the largest
absolute difference of the first differing tensor is decoded with the standard library."""

from __future__ import annotations

import json
import mmap
import os
import struct
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from ..errors import DDUFError
from ..format import spec
from ..format.json_budget import parse_json_entry
from ..format.pack import EntrySource, FileRegion
from ..format.safetensors_header import (
    SafetensorsHeader,
    TensorInfo,
    checked,
    parse_header,
    read_header_length,
    read_safetensors_header,
)
from ..format.weights import classify
from ..format.writer import open_source_file

BOOKKEEPING_KEYS = frozenset({"_name_or_path", "_diffusers_version", "_commit_hash", "transformers_version",
                              "_use_default_values"})
TOKENIZER_SAVE_KEYS = frozenset({"is_local", "local_files_only", "name_or_path", "tokenizer_file"})
SLOW_TOKENIZER_FILES = frozenset({"vocab.json", "merges.txt", "vocab.txt", "special_tokens_map.json",
                                  "added_tokens.json",
                                  # sentencepiece models (T5, Llama / Gemma, XLM-R): transformers 5 reads
                                  # tokenizer.json where it is there, and re-saves without them
                                  "spiece.model", "tokenizer.model", "sentencepiece.bpe.model"})
MAX_DIFF_VALUES = 1 << 24  # values decoded to report the largest difference of a differing tensor (time bound)
DIFF_CHUNK = 1 << 18  # values decoded at a time (memory bound: a few MB of Python floats per side)
_DECODE = {"float16": "e", "float32": "f", "float64": "d", "int8": "b", "uint8": "B", "int16": "h", "int32": "i",
           "int64": "q"}


class ComponentBytes:
    """One copy of a component's files as read-only buffers: files on disk mapped, or an archive's entries.

    ``where`` names the copy in messages. Use as a context manager: the buffers are released on exit."""

    def __init__(self, where: str, names: Iterable[str], opener: Callable[[str], memoryview],
                 close: Callable[[], None] | None = None):
        self.where = where
        self.names = sorted(names)
        self._opener, self._close = opener, close
        self._views: dict[str, memoryview] = {}

    @classmethod
    def from_paths(cls, where: str, paths: Mapping[str, Path | FileRegion]) -> ComponentBytes:
        """Files mapped; a :class:`FileRegion` (an entry of an archive being re-packed) as its slice of the map."""
        maps: list[mmap.mmap] = []

        def opener(name: str) -> memoryview:
            file = paths[name]
            path, start, length = (file.path, file.offset, file.length) if isinstance(file, FileRegion) else \
                (file, 0, None)
            with open(open_source_file(name, path)[0], "rb") as f:  # a regular file only, never waited on
                size = os.fstat(f.fileno()).st_size
                if size == 0 or length == 0:
                    return memoryview(b"")
                if length is not None and start + length > size:
                    raise DDUFError(f"{file}: the file ends inside the entry (it changed)")
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            maps.append(mapped)
            if length is None:
                return memoryview(mapped)
            with memoryview(mapped) as whole:  # the slice keeps the map's buffer; the whole view goes now
                return whole[start : start + length]

        def close() -> None:
            for mapped in maps:
                mapped.close()

        return cls(where, paths, opener, close)

    def buffer(self, name: str) -> memoryview:
        if name not in self._views:
            self._views[name] = self._opener(name)
        return self._views[name]

    def tensor_infos(self, files: Iterable[str]) -> dict[str, TensorInfo]:
        return {name: t.info for name, t in tensor_table(self, files).items()}

    def first_different(self, files: Iterable[str], base: Mapping[str, Located]) -> tuple[Located, Located] | None:
        mine = tensor_table(self, files)
        return next(((mine[n], base[n]) for n in sorted(mine) if not _same_bytes(mine[n], base[n])), None)

    def __enter__(self) -> ComponentBytes:
        return self

    def __exit__(self, *exc: object) -> None:
        for view in self._views.values():
            view.release()
        self._views.clear()
        if self._close is not None:
            self._close()


class Located(NamedTuple):
    """A tensor of a component: its record and where its bytes are."""

    info: TensorInfo
    buffer: memoryview
    start: int  # absolute offset of its bytes in ``buffer``


def tensor_table(copy: ComponentBytes, files: Iterable[str]) -> dict[str, Located]:
    """{tensor name: where it is} over the safetensors ``files`` of ``copy`` (checked headers: the copy may
    be hostile). A name in two files is refused: which one a loader takes is not defined."""
    table: dict[str, Located] = {}
    for name in sorted(files):
        buf = copy.buffer(name)
        entry = f"{copy.where}/{name}"

        def read_at(offset: int, length: int, buf: memoryview = buf) -> bytes:
            return bytes(buf[offset : offset + length])

        found, problems = read_safetensors_header(read_at, 0, len(buf), entry)
        header: SafetensorsHeader = checked(found, problems, entry, DDUFError)
        for tname, info in header.tensors.items():
            if tname in table:
                raise DDUFError(f"{entry}: tensor {tname} is also in another weight file of {copy.where}")
            table[tname] = Located(info, buf, header.data_start + info.begin)
    return table


def _same_bytes(a: Located, b: Located) -> bool:
    """Equal bytes, compared in place: as 8-byte words (memoryview's own comparison, no copy; ~8x faster than
    byte by byte), the tail as bytes."""
    n = a.info.nbytes
    words = n - n % 8
    left = a.buffer[a.start : a.start + n]
    right = b.buffer[b.start : b.start + n]
    try:
        return left[:words].cast("Q") == right[:words].cast("Q") and left[words:].tobytes() == right[words:].tobytes()
    finally:
        left.release()
        right.release()


def _values(t: Located, first: int, count: int) -> list[float] | None:
    """Values ``first`` .. ``first + count`` of ``t`` as Python numbers (bfloat16 widened to float32), or None
    for a dtype the standard library cannot decode (float8 and narrower)."""
    size = spec.DTYPE_BY_TORCH[t.info.dtype].bits // 8
    raw = t.buffer[t.start + first * size : t.start + (first + count) * size].tobytes()
    if t.info.dtype == "bfloat16":  # the high half of a float32: put two zero bytes below each value
        wide = bytearray(2 * len(raw))
        wide[2::4], wide[3::4] = raw[0::2], raw[1::2]
        return array("f", bytes(wide)).tolist()
    code = _DECODE.get(t.info.dtype)
    return list(struct.unpack(f"<{count}{code}", raw)) if code else None


def largest_difference(a: Located, b: Located) -> str:
    """'max abs difference X' between two same-dtype, same-shape tensors (over the first
    :data:`MAX_DIFF_VALUES` values, said so), or what can be said without decoding. Decoded
    :data:`DIFF_CHUNK` values at a time: the memory it takes is bounded whatever the tensor's size."""
    bits = spec.DTYPE_BY_TORCH[a.info.dtype].bits
    count = min(a.info.nbytes * 8 // bits if bits >= 8 else 0, MAX_DIFF_VALUES)
    if count == 0 or a.info.dtype not in _DECODE and a.info.dtype != "bfloat16":
        return f"{a.info.dtype} bytes differ"
    diff = 0.0
    for first in range(0, count, DIFF_CHUNK):
        step = min(DIFF_CHUNK, count - first)
        xs, ys = _values(a, first, step), _values(b, first, step)
        assert xs is not None and ys is not None  # a decodable dtype (checked above)
        diff = max(diff, max(map(abs, map(float.__sub__, map(float, xs), map(float, ys))), default=0.0))
    within = "" if count * bits // 8 == a.info.nbytes else f" in the first {count:,} values"
    return f"max abs difference {diff:.4g}{within}"


def infos_difference(mine: Mapping[str, TensorInfo], base: Mapping[str, TensorInfo]) -> str | None:
    """Why two tensor tables differ in names, dtypes or shapes (cheap: headers only), or None."""
    if set(mine) != set(base):
        only_here, only_there = sorted(set(mine) - set(base)), sorted(set(base) - set(mine))
        if only_here:
            return f"tensor {only_here[0]} is not in BASE" + (f" (and {len(only_here) - 1} more)" if len(only_here) > 1 else "")
        return f"BASE's tensor {only_there[0]} is not here" + (f" (and {len(only_there) - 1} more)" if len(only_there) > 1 else "")
    for name in sorted(mine):
        a, b = mine[name], base[name]
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return f"tensor {name}: {a.dtype} {list(a.shape)} here, {b.dtype} {list(b.shape)} in BASE"
    return None


def only_dtypes_differ(mine: Mapping[str, TensorInfo], base: Mapping[str, TensorInfo]) -> bool:
    """Same names and shapes, some dtype differs: another variant of BASE (fp16 of an fp32 BASE) may match."""
    return set(mine) == set(base) and all(mine[n].shape == base[n].shape for n in mine) \
        and any(mine[n].dtype != base[n].dtype for n in mine)


class ComponentCopy(Protocol):
    """One side of a comparison: its files, their bytes, its tensors."""

    where: str
    names: list[str]  # file names in the component folder

    def buffer(self, name: str) -> memoryview:
        """A non-weight file's bytes."""
        ...

    def tensor_infos(self, files: Iterable[str]) -> dict[str, TensorInfo]:
        """{tensor name: record} over the weight ``files``."""
        ...

    def first_different(self, files: Iterable[str], base: Mapping[str, Located]) -> tuple[Located, Located] | None:
        """(this side's tensor, ``base``'s) for the first tensor whose bytes differ, or None (same infos given)."""
        ...


# --- JSON files ---------------------------------------------------------------------------------------------
def _json(copy: ComponentCopy, name: str) -> Any:
    """The parsed file, within the budget of its kind (a BASE is untrusted input), or None."""
    value, code, _why = parse_json_entry(copy.buffer(name).tobytes(), f"component/{name}")
    return None if code is not None else value


def _first_key_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    for key in sorted(set(a) | set(b)):
        if key not in a:
            return f"key {key!r} only in BASE's"
        if key not in b:
            return f"key {key!r} not in BASE's"
        if a[key] != b[key]:
            return f"key {key!r}: {_short(a[key])} here, {_short(b[key])} in BASE"
    return None


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 40 else text[:37] + "..."


def json_difference(name: str, mine: Any, base: Any, ignored: frozenset[str] = BOOKKEEPING_KEYS,
                    defaults: Callable[[Mapping[str, Any]], Mapping[str, Any] | None] | None = None) -> str | None:
    """Why two parsed JSON files differ once ``ignored`` keys are dropped (``defaults(config)``: the library's
    default for keys a side may lack), or None."""
    if not isinstance(mine, dict) or not isinstance(base, dict):
        return None if mine == base and mine is not None else f"{name} differs"
    a = {k: v for k, v in mine.items() if k not in ignored}
    b = {k: v for k, v in base.items() if k not in ignored}
    why = _first_key_difference(a, b)
    if why is not None and defaults is not None and set(a) != set(b):
        known = defaults(a) or defaults(b)
        if known is not None:  # a key one side lacks counts as its default value
            a, b = {**known, **a}, {**known, **b}
            why = _first_key_difference(a, b)
    return None if why is None else f"{name}: {why}"


def as_read(name: str, config: Any, library: str | None) -> Any:
    """A config file as its library reads it, where a saved key changes what another one means: diffusers gives
    each key ``_use_default_values`` lists its class default, whatever value is written
    (``ConfigMixin.extract_init_dict``); transformers 5 reads transformers 4's ``torch_dtype`` as ``dtype`` where
    ``dtype`` is unset (``PreTrainedConfig.__post_init__``: a Hub BASE saved by transformers 4 and its fine-tune
    saved by transformers 5 write the same setting under the two names). Anything else as parsed."""
    if not isinstance(config, dict) or name not in spec.CONFIG_FILES:
        return config
    listed = config.get("_use_default_values")
    if library == "diffusers" and isinstance(listed, list):
        return {k: v for k, v in config.items() if k not in listed}
    if library == "transformers" and name == "config.json":
        return _dtype_as_read(config)
    return config


def _dtype_as_read(config: dict[str, Any]) -> dict[str, Any]:
    """``torch_dtype`` read as ``dtype`` where that is unset, in sub-configs too (``text_config``...)."""
    out = {k: _dtype_as_read(v) if isinstance(v, dict) else v for k, v in config.items() if k != "torch_dtype"}
    if config.get("torch_dtype") is not None and out.get("dtype") is None:
        out["dtype"] = config["torch_dtype"]
    return out


# transformers model classes that set config keys in ``__init__`` whatever config.json says: transformers 5's
# T5EncoderModel / MT5EncoderModel set them on the config they later save (transformers 4 on a copy), so a Hub
# BASE says ``true`` where its fine-tune says ``false``, for the same model
CLASS_SET_KEYS: Mapping[str, Mapping[str, Any]] = {
    "T5EncoderModel": {"use_cache": False, "is_encoder_decoder": False},
    "MT5EncoderModel": {"use_cache": False, "is_encoder_decoder": False},
}


def transformers_reading(config: Any, cls: str | None) -> dict[str, Any] | None:
    """A transformers ``config.json`` as the model gets it: through its config class (``from_dict`` then
    ``to_dict``: renamed keys, keys derived from others, transformers 5's T5 ``tie_word_embeddings`` read as
    ``scale_decoder_outputs``), with the keys the model class sets (:data:`CLASS_SET_KEYS`). None where
    transformers cannot read it (an unknown ``model_type``, a config its class refuses)."""
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str) or not _readable_sizes(config):
        return None
    try:
        from transformers import CONFIG_MAPPING

        if config["model_type"] not in CONFIG_MAPPING:
            return None
        read = CONFIG_MAPPING[config["model_type"]].from_dict(dict(config)).to_dict()
    except Exception:  # noqa: BLE001 - a config transformers cannot read: compared as written
        return None
    return {**_jsonable(read), **CLASS_SET_KEYS.get(cls or "", {})}


# Config classes build lists from some numbers (Gemma 3's and Qwen 3's ``layer_types``: one item per layer, 44 s
# and 1.5 GB for 10**7 layers). A BASE's config is untrusted: one with a number no real model has is compared
# as written (its component stored), never given to its config class.
MAX_READ_LAYERS = 1 << 12  # the deepest real models have ~130 layers
MAX_READ_INTEGER = 1 << 20  # vocabularies, positions and widths of real configs are below it


def _readable_sizes(config: dict[str, Any]) -> bool:
    """Whether every integer of ``config`` (nested too) is one a config class may be given: layer counts
    within :data:`MAX_READ_LAYERS`, any other within :data:`MAX_READ_INTEGER` in magnitude."""
    stack: list[tuple[str, Any]] = [("", config)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((key, v) for v in value)
        elif isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > (MAX_READ_LAYERS if "layer" in key.lower() else MAX_READ_INTEGER):
                return False
    return True


def _jsonable(value: Any) -> Any:
    """A default as a JSON file would hold it (tuples as lists)."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return repr(value)


def library_defaults(library: str | None, cls: str | None) -> Callable[[Mapping[str, Any]], Mapping[str, Any] | None]:
    """``defaults(config)``: what ``library.cls`` reads for a config key it lacks, or None when that is not known
    (a class the library does not have, a ``model_type`` transformers does not know). Imports the library only
    when called: configs that differ in values alone never need it."""

    def defaults(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
        try:
            if library == "diffusers" and cls and cls.isidentifier():
                return _diffusers_defaults(cls)
            if library == "transformers" and isinstance(config.get("model_type"), str):
                return _transformers_defaults(config["model_type"])
        except Exception:  # noqa: BLE001 - a library that cannot say: compare as written
            return None
        return None

    return defaults


def _diffusers_defaults(cls: str) -> Mapping[str, Any] | None:
    import inspect

    import diffusers

    found = getattr(diffusers, cls, None)
    if not (isinstance(found, type) and issubclass(found, diffusers.ConfigMixin)):
        return None
    parameters = inspect.signature(found.__init__).parameters.values()
    return {p.name: _jsonable(p.default) for p in parameters
            if p.default is not inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD}


def _transformers_defaults(model_type: str) -> Mapping[str, Any] | None:
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return None
    return {k: _jsonable(v) for k, v in CONFIG_MAPPING[model_type]().to_dict().items()}


# --- a whole component ----------------------------------------------------------------------------------------
def _weights(names: Iterable[str]) -> list[str]:
    return [n for n in names if (w := classify(n)) is not None and not w.is_index]


def _layout_only(name: str) -> bool:
    """A shard index: which file holds which tensor, not what the tensors are."""
    found = classify(name)
    return found is not None and found.is_index


class Difference(NamedTuple):
    """Why two copies of a component differ."""

    text: str  # the first difference: a tensor (name, largest difference), a file, a config key
    in_weights: bool  # the tensors differ (another weight variant of BASE may match; configs are shared)
    dtype_only: bool  # only the tensors' dtypes differ (an fp16 copy of an fp32 BASE)


def component_difference(mine: ComponentCopy, base: ComponentBytes, *, library: str | None = None,
                         cls: str | None = None) -> Difference | None:
    """Why ``mine`` is not the same component as ``base`` by content (module docstring), or None.

    Raises:
        DDUFError: a weight file of either copy is not a valid safetensors file."""
    weights_mine, weights_base = _weights(mine.names), _weights(base.names)
    if weights_mine or weights_base:
        theirs = tensor_table(base, weights_base)
        ours, their_infos = mine.tensor_infos(weights_mine), {n: t.info for n, t in theirs.items()}
        why = infos_difference(ours, their_infos)
        if why is not None:
            return Difference(why, True, only_dtypes_differ(ours, their_infos))
        found = mine.first_different(weights_mine, theirs)
        if found is not None:
            return Difference(f"tensor {found[0].info.name} differs ({largest_difference(*found)})", True, False)
    others_mine = {n for n in mine.names if n not in weights_mine and not _layout_only(n)}
    others_base = {n for n in base.names if n not in weights_base and not _layout_only(n)}
    both_tokenizers = "tokenizer.json" in others_mine & others_base
    tokenizer_why = json_difference("tokenizer.json", _json(mine, "tokenizer.json"), _json(base, "tokenizer.json")) \
        if both_tokenizers else None
    if tokenizer_why is not None:  # said first: the slow tokenizer's files then differ because of it
        return Difference(tokenizer_why, False, False)
    tokenizer_same = both_tokenizers
    if tokenizer_same:  # the slow tokenizer's files say again what tokenizer.json says
        others_mine -= SLOW_TOKENIZER_FILES
        others_base -= SLOW_TOKENIZER_FILES
    if others_mine != others_base:
        extra = sorted(others_mine - others_base)
        text = f"{extra[0]} is not in BASE's" if extra else f"BASE's {sorted(others_base - others_mine)[0]} is not here"
        return Difference(text, False, False)
    defaults = library_defaults(library, cls)
    for name in sorted(others_mine):
        why = _file_difference(name, mine, base, defaults, tokenizer_same, library, cls)
        if why is not None:
            return Difference(why, False, False)
    return None


def _file_difference(name: str, mine: ComponentCopy, base: ComponentBytes,
                     defaults: Callable[[Mapping[str, Any]], Mapping[str, Any] | None], tokenizer_same: bool,
                     library: str | None = None, cls: str | None = None) -> str | None:
    if not name.endswith(".json"):
        return None if mine.buffer(name) == base.buffer(name) else f"{name} differs"
    ignored = BOOKKEEPING_KEYS
    if name == "tokenizer_config.json":
        # transformers 5 adds these on save and drops added_tokens_decoder, which tokenizer.json holds as well
        ignored = ignored | TOKENIZER_SAVE_KEYS | ({"added_tokens_decoder"} if tokenizer_same else set())
    ours, theirs = _json(mine, name), _json(base, name)
    why = json_difference(name, as_read(name, ours, library), as_read(name, theirs, library), ignored,
                          defaults if name in spec.CONFIG_FILES else None)
    if why is not None and library == "transformers" and name == "config.json":
        # written by another transformers version: compared as the model reads each (only then imported)
        read_ours, read_theirs = transformers_reading(ours, cls), transformers_reading(theirs, cls)
        if read_ours is not None and read_theirs is not None and json_difference(name, read_ours, read_theirs) is None:
            return None
    return why


# --- a component not written yet: the entries a writer would store ---------------------------------------------
class _ExactReader:
    """Exact-length reads from a stream of byte pieces (a streamed safetensors file)."""

    def __init__(self, pieces: Iterator[Any]):
        self._pieces, self._pending = pieces, bytearray()

    def read(self, n: int) -> bytes:
        while len(self._pending) < n:
            piece = next(self._pieces, None)
            if piece is None:
                raise DDUFError(f"the stream ended {n - len(self._pending)} bytes early")
            self._pending += piece
        out = bytes(self._pending[:n])
        del self._pending[:n]
        return out


class SourcesCopy:
    """A component as the entries a writer would store (``save_dduf``'s: small files as bytes, weights streamed
    from the live tensors), compared with BASE without writing it or holding more than one tensor's bytes."""

    def __init__(self, where: str, sources: Iterable[EntrySource]):
        self.where = where
        self._by_name = {s.name.split("/", 1)[1]: s for s in sources}
        self.names = sorted(self._by_name)

    def _pieces(self, name: str) -> Iterator[Any]:
        src = self._by_name[name]
        if src.data is not None:
            yield src.data
        elif src.path is not None:
            with open(open_source_file(src.name, src.path)[0], "rb") as f:
                while block := f.read(16 << 20):
                    yield block
        elif src.region is not None:
            yield src.region.read_bytes()
        elif src.chunks is not None:
            yield from src.chunks()

    def buffer(self, name: str) -> memoryview:
        return memoryview(b"".join(bytes(p) for p in self._pieces(name)))

    def _header(self, name: str) -> SafetensorsHeader:
        src = self._by_name[name]
        if src.header is not None:
            return src.header
        reader = _ExactReader(self._pieces(name))
        prefix = reader.read(8)
        length = read_header_length(prefix)
        found, problems = parse_header(reader.read(length), length, src.nbytes, f"{self.where}/{name}")
        return checked(found, problems, f"{self.where}/{name}", DDUFError)

    def tensor_infos(self, files: Iterable[str]) -> dict[str, TensorInfo]:
        out: dict[str, TensorInfo] = {}
        for name in sorted(files):
            out.update(self._header(name).tensors)
        return out

    def first_different(self, files: Iterable[str], base: Mapping[str, Located]) -> tuple[Located, Located] | None:
        for name in sorted(files):
            header = self._header(name)
            reader = _ExactReader(self._pieces(name))
            reader.read(header.data_start)
            position = 0
            for info in sorted(header.tensors.values(), key=lambda t: t.begin):
                reader.read(info.begin - position)  # a gap a checked header does not have: nothing
                ours = Located(info, memoryview(reader.read(info.nbytes)), 0)
                position = info.end
                if not _same_bytes(ours, base[info.name]):
                    return ours, base[info.name]
        return None
