"""Budgets on tokenizer files and on the numbers of config-only components, checked on their bytes before a
library sees them: by ``validate`` (rules D014, D015) and by ``load_dduf`` (the same functions, the same
codes), so an archive cannot make transformers, tokenizers or sentencepiece build gigabytes.

Why. A tokenizer's files go to libraries that build a table per token: a 61 MB ``special_tokens_map.json``
(4.3 M added tokens), a 56 MB ``spiece.model`` (3 M pieces) or a 50 MB ``tokenizer.json`` (2.5 M tokens)
loaded in 1.4-1.9 GB and up to minutes, and every one was reported valid. A scheduler allocates in
proportion to some of its numbers: ``num_train_timesteps: 1e8`` written as a float passed the integer cap
and took 1.9 GB from a 1.4 MB archive.

The caps (docs/security.md, "Tokenizer and config budgets"), far above real tokenizers:

- **vocabulary / pieces** (:data:`MAX_VOCAB`, 1,048,576): real ones hold 32 k (T5, Llama 2) to 262 k (Gemma
  3) tokens. Counted in ``tokenizer.json`` and ``vocab.json`` as the largest JSON container, in
  ``vocab.txt`` as lines, in a SentencePiece ``.model`` as the pieces of its protobuf (walked field by
  field with a budget; sentencepiece is never imported here).
- **merges** (:data:`MAX_MERGES`, 1,048,576): CLIP has 48,894, Llama 3 280,147; ``merges.txt`` lines, and the
  largest container of ``tokenizer.json``.
- **added tokens** (:data:`MAX_ADDED_TOKENS`, 65,536): T5 has 100 extra ids, Gemma 3 about 6,000. Counted as
  the JSON objects of ``tokenizer.json`` / ``tokenizer_config.json`` (each added token is one), the largest
  container and the values of ``special_tokens_map.json`` / ``added_tokens.json``, and the number
  ``extra_ids`` of ``tokenizer_config.json`` (T5's tokenizers add that many).
- every tokenizer file at most :data:`MAX_TOKENIZER_FILE` (64 MiB, what the loader copies to its cache).
- **numbers of config-only components** (:data:`MAX_CONFIG_NUMBER`, 1,048,576 in magnitude): every finite
  JSON number, integers and floats alike (``1e8`` is a float); ``true``/``false`` are not numbers here, and
  ``-Infinity`` (which diffusers writes for DPM-Solver's ``lambda_min_clipped``) sizes nothing.
  ``validate`` applies it to ``scheduler_config.json`` and ``guider_config.json``; the loader to every
  component it builds as a known weightless kind (schedulers, guiders, image processors).

All counting is C-speed passes over the bytes (``translate``, ``count``, ``split``, a regular expression),
except the protobuf walk: at most :data:`MAX_VOCAB` + 1 pieces and :data:`OTHER_FIELDS` other fields, ~0.3 s
at worst, milliseconds for real files. JSON that is over its D013 budget (``json_budget``) is left to that rule."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import Any

from .findings import Finding, finding
from .json_budget import json_budget_problem, parse_json_entry

MAX_VOCAB = 1 << 20
MAX_MERGES = 1 << 20
MAX_ADDED_TOKENS = 1 << 16
MAX_TOKENIZER_FILE = 64 << 20
MAX_CONFIG_NUMBER = 1 << 20
# Objects of tokenizer.json besides added tokens: the normalizer / pre-tokenizer / post-processor / decoder
# settings (a few dozen in real files, a Sequence of a few hundred at most).
OTHER_OBJECTS = 4096

TOKENIZER_JSON = ("tokenizer.json", "vocab.json", "added_tokens.json", "special_tokens_map.json",
                  "tokenizer_config.json")
TOKENIZER_TEXT = ("merges.txt", "vocab.txt")
WEIGHTLESS_CONFIGS = ("scheduler_config.json", "guider_config.json")

# The JSON skeleton this module needs: brackets and commas outside strings (json_budget.skeleton keeps colons
# instead). Innermost containers are then runs of commas between two brackets.
_NOT_SHAPE = bytes(b for b in range(256) if b not in b'"[]{},')
_INNERMOST = re.compile(rb"[\[{],*[\]}]")
_MAX_PASSES = 65  # json_budget's depth cap (64) is checked first
# Top-level fields of a SentencePiece ModelProto besides its pieces: trainer, normalizer and denormalizer specs,
# self-test data (one each in real files). Bounds the slow path of the walk.
OTHER_FIELDS = 1024


def applies(entry: str) -> bool:
    """Whether ``entry`` ("tokenizer/spiece.model") is a tokenizer file this module budgets."""
    basename = entry.rsplit("/", 1)[-1]
    return basename in TOKENIZER_JSON or basename in TOKENIZER_TEXT or basename.endswith(".model")


def tokenizer_problem(entry: str, raw: bytes) -> tuple[str, str] | None:
    """``(code, why)`` when the tokenizer file ``entry`` is over a budget: ``D013`` when its JSON is over the
    archive JSON budget (:func:`~dduf_plus.format.json_budget.json_budget_problem`), ``D014`` over a tokenizer
    cap; None when within (or not a tokenizer file). Bytes that are not JSON or protobuf at all are left to the
    library (it refuses them itself, cheaply), except a ``.model`` that is not a readable protobuf (D014)."""
    basename = entry.rsplit("/", 1)[-1]
    if not applies(entry):
        return None
    if len(raw) > MAX_TOKENIZER_FILE:
        return "D014", f"{len(raw)} bytes is more than the {MAX_TOKENIZER_FILE} a tokenizer file may hold"
    if basename in TOKENIZER_JSON:
        over = json_budget_problem(raw, entry)
        if over is not None:
            return over
        why = _json_problem(basename, bytes(raw))
    elif basename in TOKENIZER_TEXT:
        cap, what = (MAX_MERGES, "merges") if basename == "merges.txt" else (MAX_VOCAB, "tokens")
        lines = raw.count(b"\n") + (1 if raw and not raw.endswith(b"\n") else 0)
        why = f"holds {lines} lines ({what}), more than the {cap} allowed" if lines > cap + 1 else None
    else:
        why = sentencepiece_problem(raw, MAX_VOCAB)
    return None if why is None else ("D014", why)


def _json_problem(basename: str, raw: bytes) -> str | None:
    """The D014 caps of one tokenizer JSON file, from its skeleton (see :func:`json_shape`)."""
    if basename == "tokenizer_config.json" and b'"extra_ids"' in raw:
        why = _extra_ids_problem(raw)
        if why is not None:
            return why
    largest, objects = json_shape(raw)
    if basename in ("special_tokens_map.json", "added_tokens.json"):
        cap, what = MAX_ADDED_TOKENS, "added or special tokens"
    elif basename == "tokenizer_config.json":
        cap, what = MAX_ADDED_TOKENS, "added tokens (or other entries)"
    else:
        cap, what = max(MAX_VOCAB, MAX_MERGES), "tokens or merges"
    if largest > cap:
        return f"a list or object of it holds {largest} entries ({what}), more than the {cap} allowed"
    if basename != "vocab.json" and objects > MAX_ADDED_TOKENS + OTHER_OBJECTS:
        return (f"holds {objects} JSON objects (each added token is one), more than the "
                f"{MAX_ADDED_TOKENS + OTHER_OBJECTS} allowed ({MAX_ADDED_TOKENS} added tokens)")
    return None


def _extra_ids_problem(raw: bytes) -> str | None:
    """T5's and ByT5's tokenizers add ``extra_ids`` tokens (``<extra_id_0>``...) built from that number, not
    from the file's size: ``2**31`` took 7.7 GB and 30 s before transformers gave up. Counted as added tokens."""
    value, code, _why = parse_json_entry(raw, "tokenizer/tokenizer_config.json")
    count = value.get("extra_ids") if code is None and isinstance(value, dict) else None
    if count is None or isinstance(count, bool) or not isinstance(count, (int, float)):
        return None  # absent, not a number (the library refuses it), or not JSON (D007 / D013 say so)
    if not 0 <= count <= MAX_ADDED_TOKENS:
        return (f"extra_ids {count!r} would add {count!r} tokens; between 0 and {MAX_ADDED_TOKENS} added tokens "
                "are allowed")
    return None


def json_shape(raw: bytes) -> tuple[int, int]:
    """``(largest, objects)``: an upper bound on the entries of the largest JSON array or object in ``raw`` (its
    commas + 1), and the number of objects. Strings are dropped first (as in ``json_budget.skeleton``); then,
    pass after pass, the innermost containers (a bracket, commas, a bracket) are measured and removed, so a
    container's own commas become one run once its children are gone. C-speed passes, as many as the depth."""
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = raw.translate(None, _NOT_SHAPE)
    if b'"' in marks:
        marks = marks.replace(b'""', b"")
        marks = b"".join(marks.split(b'"')[::2])
    objects = marks.count(b"{")
    largest = 0
    for _ in range(_MAX_PASSES):
        found = _INNERMOST.findall(marks)
        if not found:
            break
        largest = max(largest, len(max(found, key=len)) - 1)
        marks = _INNERMOST.sub(b"", marks)
    return largest, objects


def sentencepiece_problem(raw: bytes, limit: int = MAX_VOCAB) -> str | None:
    """Why a SentencePiece ``.model`` (a ``ModelProto``: ``repeated SentencePiece pieces = 1`` and a few
    length-delimited specs) may not be handed to sentencepiece: more than ``limit`` pieces, more than
    :data:`OTHER_FIELDS` other top-level fields, or not a readable protobuf. Walks the top-level fields without
    decoding them (a Python loop: pieces with lengths under 16 KiB take the inline path)."""
    pieces, others, pos, size = 0, 0, 0, len(raw)
    try:
        while pos < size:
            if raw[pos] == 0x0A and raw[pos + 1] < 0x80:  # a piece of under 128 bytes
                pos += 2 + raw[pos + 1]
                pieces += 1
            elif raw[pos] == 0x0A and raw[pos + 2] < 0x80:  # under 16 KiB
                pos += 3 + (raw[pos + 1] & 0x7F) + (raw[pos + 2] << 7)
                pieces += 1
            else:
                why = _skip_field(raw, pos)
                if isinstance(why, str):
                    return why
                pos, piece = why
                pieces += piece
                others += not piece
                if others > OTHER_FIELDS:
                    return f"holds more than {OTHER_FIELDS} top-level protobuf fields besides its pieces"
            if pieces > limit:
                return f"holds more than {limit} pieces (its vocabulary); at most {limit} are allowed"
    except IndexError:
        pos = size + 1
    if pos > size:
        return f"is not a SentencePiece model (a protobuf field runs past the end, {size} bytes)"
    return None


def _skip_field(raw: bytes, pos: int) -> tuple[int, bool] | str:
    """The position after the top-level field at ``pos`` and whether it is a piece (field 1), or why it is not
    protobuf."""
    key, pos = _varint(raw, pos)
    field, wire = key >> 3, key & 7
    if wire == 2:
        length, pos = _varint(raw, pos)
        return pos + length, field == 1
    if wire == 0:
        return _varint(raw, pos)[1], False
    if wire in (1, 5):
        return pos + (8 if wire == 1 else 4), False
    return f"is not a SentencePiece model (protobuf wire type {wire} at byte {pos})"


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint longer than 10 bytes")


def config_number_problem(config: Any, limit: int = MAX_CONFIG_NUMBER) -> str | None:
    """Why a config-only component's config (a scheduler's) may not be handed to its class: a number (an
    integer or a float: ``1e8`` is a float; booleans are not numbers here) over ``limit`` in magnitude.
    ``Infinity`` and ``NaN`` pass: diffusers writes them itself (DPM-Solver's ``lambda_min_clipped: -Infinity``)
    and no allocation can be sized by one (``int(inf)`` raises). Walks the parsed value without recursion."""
    stack: list[tuple[str, Any]] = [("", config)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{key}.{k}" if key else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{key}[{i}]", v) for i, v in enumerate(value))
        elif type(value) is int and abs(value) > limit:
            return f"{key} = {value} is out of range (at most {limit} in magnitude for a config-only component)"
        elif type(value) is float and math.isfinite(value) and abs(value) > limit:
            return f"{key} = {value!r} is out of range (at most {limit} in magnitude for a config-only component)"
    return None


def budget_findings(entries: Iterable[tuple[str, int]], read: Callable[[str], bytes]) -> list[Finding]:
    """D014 for tokenizer files over a budget (D013 where their JSON is over the archive JSON budget), D015 for
    weightless configs holding a number out of range. ``entries``: (name, length) of every entry; ``read``
    gives an entry's bytes (tokenizer files are read whole: they are what the loader reads anyway). A config
    that does not parse is left to D007/D013."""
    out: list[Finding] = []
    for name, length in entries:
        basename = name.rsplit("/", 1)[-1]
        if "/" in name and basename in WEIGHTLESS_CONFIGS and length <= MAX_TOKENIZER_FILE:
            value, code, _why = parse_json_entry(read(name), name)
            why = config_number_problem(value) if code is None else None
            if why is not None:
                out.append(finding("D015", name, why))
        if "/" not in name or not applies(name):
            continue
        if length > MAX_TOKENIZER_FILE:
            out.append(finding("D014", name, f"{length} bytes is more than the {MAX_TOKENIZER_FILE} a tokenizer "
                                             "file may hold"))
            continue
        problem = tokenizer_problem(name, read(name))
        if problem is not None:
            out.append(finding(problem[0], name, problem[1]))
    return out
