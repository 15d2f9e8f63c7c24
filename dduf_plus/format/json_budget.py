"""Bounds on untrusted JSON, checked on its bytes before a parser sees them, and the one reader of an
archive's JSON (:func:`read_json`) that ``validate``, ``DDUFArchive`` and ``load_dduf`` all use, so the
loader refuses exactly what validation refuses, with the same rule code (D013 over budget, D007 or the
caller's code when it does not parse).

A JSON parser's memory grows with the number of values it builds (an empty object costs 64 bytes, so a
60 MB ``[{},{},...]`` becomes 1.6 GB) and a recursive parser's stack with the nesting depth. Both are
bounded here with a few C-speed passes over the bytes (``count``, ``translate``, ``split``), no recursion
and no Python code per character: ~0.2 s for 50 MB at worst, a few ms for real files.

Budgets per kind of entry (:func:`budget_for`): model_index.json, the dduf_plus index and component configs
as :func:`dduf_plus.format.spec.json_budget` says; small settings files (``generation_config.json``,
``quanto_qmap.json``) as configs; sharded-weight indexes 16 MiB / 262,144 values; every other JSON entry
(tokenizer.json, vocab.json, ...) 64 MiB / 4 M values. Every entry: nesting depth at most
``spec.MAX_JSON_DEPTH``, number literals at most :data:`MAX_NUMBER_CHARS` characters and finite (``1e400``
and ``10**5000`` are refused: no JSON writer produces them, and an unbounded literal costs a parser
super-linear time). Decided and accepted as Python's parser does: ``NaN`` / ``Infinity`` (``json.dumps``, which
diffusers and transformers write configs with, emits them), duplicate keys (the last wins, in the validator
and the loader alike). Strings get no cap of their own: the entry's byte cap bounds them (a parsed string
costs at most 4 bytes per byte of JSON)."""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any, NamedTuple

from ..errors import DDUFFormatError
from . import spec

# Keep quotes, brackets and colons; openers become +1, closers -1 and colons 0 as signed bytes, so that a
# running sum over what lies outside strings (itertools.accumulate over a memoryview cast to "b": C code)
# is the nesting depth, and the zeros count the object members.
_MARKS = bytes.maketrans(b"[{]}:", b"\x01\x01\xff\xff\x00")
_NOT_MARKS = bytes(b for b in range(256) if b not in b'"[]{}:')


class JsonProblem(NamedTuple):
    kind: str  # which budget: "size", "values" or "depth"
    message: str


def value_bound(raw: bytes) -> int:
    """An upper bound on the number of JSON values in ``raw``: every value but the first of its container
    follows a comma, and each container adds its own first one. Commas and brackets inside strings count too,
    so real text only ever makes the bound larger than the truth, never smaller."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1


def skeleton(raw: bytes) -> bytes:
    """The brackets and colons of ``raw`` that lie outside strings: openers as 0x01, closers as 0xff, colons
    (one per object member in valid JSON) as 0x00.

    Escapes are removed first (an escaped backslash, then an escaped quote), so every quote left delimits a
    string and the text between odd and even quotes can be dropped. C passes over the bytes only."""
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = raw.translate(_MARKS, _NOT_MARKS)
    if b'"' in marks:
        # Dropping two adjacent quotes keeps every later quote's parity and every mark on its side: most
        # strings hold no bracket or colon and vanish here in C, so the split below sees only a few quotes.
        marks = marks.replace(b'""', b"")
        marks = b"".join(marks.split(b'"')[::2])
    return marks


def depth_of(marks: bytes, limit: int) -> int:
    """How deep the containers of a :func:`skeleton` nest: ``limit + 1`` when deeper than ``limit``, else at
    most ``limit`` (exact, or the count of openers when that is already no more). Brackets that do not pair
    up are left for the parser to report; this bounds how deep a recursive parser can get before it does.
    Cost: ~30 ns per mark, and there are fewer than the values :func:`value_bound` counts."""
    openers = marks.count(b"\x01")
    if openers <= limit:
        return openers
    if b"\x01" * (limit + 1) in marks:
        return limit + 1  # the common bomb, found by one search
    return min(limit + 1, max(0, max(accumulate(memoryview(marks).cast("b")), default=0)))


def nesting_depth(raw: bytes, limit: int) -> int:
    """:func:`depth_of` the :func:`skeleton` of ``raw``."""
    return depth_of(skeleton(raw), limit)


def check_json(raw: bytes, *, max_bytes: int | None, max_values: int | None, max_depth: int) -> JsonProblem | None:
    """Why ``raw`` may not be handed to a JSON parser, or None. Values are checked before depth: their bound is
    the cheaper one, and it also bounds the work of the depth passes."""
    if max_bytes is not None and len(raw) > max_bytes:
        return JsonProblem("size", f"{len(raw)} bytes is more than the {max_bytes} allowed")
    if max_values is not None:
        values = value_bound(raw)
        if values > max_values:
            return JsonProblem("values", f"holds up to {values} JSON values (commas and brackets), more than "
                                         f"the {max_values} allowed")
    if nesting_depth(raw, max_depth) > max_depth:
        return JsonProblem("depth", f"nests deeper than the {max_depth} levels allowed")
    return None


# --- the one reader of archive JSON ---------------------------------------------------------------------
# Shard indexes (``*.safetensors.index.json``): a weight_map entry per tensor (2 values), at most
# spec.MAX_TENSORS_PER_ARCHIVE tensors worth having; real ones are 30-100 KB (an 8B LLM: 291 tensors, 30 KB).
SHARD_INDEX_JSON_BUDGET = spec.JsonBudget(16 << 20, 1 << 18)
# Other JSON entries (tokenizer.json, vocab.json, added_tokens.json, ...): Gemma 3's tokenizer.json, the
# largest real one known, is 33 MB with ~2 M values; at the cap a parse costs ~1-2 s and ~300-400 MB.
DATA_JSON_BUDGET = spec.JsonBudget(64 << 20, 1 << 22)
# Small settings files the loader parses itself, budgeted as configs.
SETTINGS_FILES = ("generation_config.json", "quanto_qmap.json")
# A double's repr is at most 24 characters, a uint64 20 digits: 100 leaves room for any real number.
MAX_NUMBER_CHARS = 100
# Pre-filter, so the exact check (a Python call per number) runs only where a number could be over the
# budget: a literal of more than MAX_NUMBER_CHARS characters holds a run of at least this many digits (it
# has at most 3 digit runs: integer, fraction, exponent), and a float can overflow only with a 3-digit exponent.
_DIGIT_RUN = b"0" * ((MAX_NUMBER_CHARS - 3) // 3 + 1)
_NUMBER_MARKS = bytes(48 if 48 <= b <= 57 else 101 if b in b"eE" else 32 for b in range(256))


class _NumberOverBudget(Exception):
    """Raised from the parser's number hooks; not a ValueError, so it is not taken for a syntax error."""


def budget_for(entry: str) -> spec.JsonBudget:
    """The D013 size and value budget of the archive JSON entry ``entry`` ("unet/config.json")."""
    known = spec.json_budget(entry)
    if known is not None:
        return known
    basename = entry.rsplit("/", 1)[-1]
    if basename in SETTINGS_FILES:
        return spec.CONFIG_JSON_BUDGET
    if ".safetensors.index" in basename:
        return SHARD_INDEX_JSON_BUDGET
    return DATA_JSON_BUDGET


def over_size(length: int, entry: str, budget: spec.JsonBudget | None = None) -> str | None:
    """Why an entry of ``length`` bytes is over its byte budget (D013) before anything is read; None if not."""
    limit = (budget or budget_for(entry)).bytes
    return f"{length} bytes is more than the {limit} allowed" if length > limit else None


def json_problem(raw: bytes, entry: str, budget: spec.JsonBudget | None = None) -> str | None:
    """Why the bytes of ``entry`` may not be parsed (D013: size, values, depth), or None. Numbers are checked
    while parsing (:func:`parse_json_entry`)."""
    budget = budget or budget_for(entry)
    problem = check_json(bytes(raw), max_bytes=budget.bytes, max_values=budget.values, max_depth=spec.MAX_JSON_DEPTH)
    return None if problem is None else problem.message


def parse_json_entry(raw: bytes, entry: str, *, parse_code: str = "D007",
                     budget: spec.JsonBudget | None = None) -> tuple[Any, str | None, str | None]:
    """``(value, None, None)``, or ``(None, code, why)``: ``D013`` over the budget of its kind (bytes, values,
    depth, numbers), ``parse_code`` when it is not JSON. Never raises for bad bytes."""
    problem = json_problem(raw, entry, budget)
    if problem is not None:
        return None, "D013", problem
    try:
        value = _loads(bytes(raw))
    except _NumberOverBudget as e:
        return None, "D013", str(e)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        return None, parse_code, f"does not parse as JSON: {e}"
    lone = lone_surrogate(value) if may_hold_lone_surrogate(bytes(raw)) else None
    return (value, None, None) if lone is None else (None, parse_code, lone)


def read_json(raw: bytes, entry: str, *, where: str | None = None, parse_code: str = "D007",
              budget: spec.JsonBudget | None = None) -> Any:
    """The parsed value of the archive JSON entry ``entry`` (its name in the archive, "unet/config.json": it
    picks the budget, :func:`budget_for`), or :class:`~dduf_plus.errors.DDUFFormatError` with ``code`` set
    (``D013`` over budget, ``parse_code`` not JSON) and a message naming ``where`` (the archive, a folder),
    the rule and the entry. ``budget`` overrides the kind's budget. Use it for every JSON an archive or a
    reference supplies, so validation and loading agree; for bytes not read yet, check :func:`over_size`
    on the entry's length first.

    Example:
        >>> read_json(b'{"a": 1}', "unet/config.json")
        {'a': 1}
    """
    value, code, why = parse_json_entry(raw, entry, parse_code=parse_code, budget=budget)
    if code is not None:
        raise DDUFFormatError(f"{where + ': ' if where else ''}{code} [{entry}]: {why}", code=code)
    return value


def json_budget_problem(raw: bytes, entry: str, budget: spec.JsonBudget | None = None) -> tuple[str, str] | None:
    """``("D013", why)`` when ``entry``'s bytes are over its budget (``("D007", why)`` when a string holds a lone
    surrogate, :func:`lone_surrogate`), else None, *without parsing them* in the common case: for JSON a
    library parses itself (a tokenizer.json handed to transformers). Numbers are
    checked exactly (by a parse) only where the byte pre-filter finds one that could be over budget; bytes
    that are not JSON at all are left to the library."""
    problem = json_problem(raw, entry, budget)
    if problem is not None:
        return "D013", problem
    suspect_numbers, suspect_text = _numbers_suspect(bytes(raw)), may_hold_lone_surrogate(bytes(raw))
    if not (suspect_numbers or suspect_text):
        return None
    try:
        value = json.loads(bytes(raw), parse_int=_checked_int if suspect_numbers else None,
                           parse_float=_checked_float if suspect_numbers else None)
    except _NumberOverBudget as e:
        return "D013", str(e)
    except (ValueError, RecursionError):
        return None
    lone = lone_surrogate(value) if suspect_text else None
    return None if lone is None else ("D007", lone)


# A \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or the reverse: half of a UTF-16 pair. Searched
# on the bytes (C speed); a match (or an escaped backslash before "ud800") is confirmed on the parsed value, so
# an escaped pair (an emoji, as Python's json.dumps writes it) costs no parse.
_LONE_SURROGATE_ESCAPE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def may_hold_lone_surrogate(raw: bytes) -> bool:
    """Whether the JSON bytes ``raw`` may spell a lone UTF-16 surrogate (confirm with :func:`lone_surrogate`)."""
    return b"\\u" in raw and _LONE_SURROGATE_ESCAPE.search(raw) is not None


def lone_surrogate(value: Any) -> str | None:
    """Why a parsed JSON ``value`` is refused when a key or string holds half a UTF-16 surrogate pair
    (``"\\udc80"``), else None. JSON's grammar spells them, but no UTF-8 file can hold one (RFC 8259 8.2: the
    behaviour is unpredictable): Rust readers (``safetensors``, ``tokenizers``, serde_json) refuse the text,
    Python keeps it until something encodes it. Walked with a list, not recursion (deep values are legal)."""
    stack = [value]
    while stack:
        item = stack.pop()
        texts: Any = ()
        if isinstance(item, dict):
            texts = item.keys()
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            texts = (item,)
        for text in texts:
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    return f"{text[:60]!r} holds a lone UTF-16 surrogate escape, which no UTF-8 reader can decode"
    return None


def _numbers_suspect(raw: bytes) -> bool:
    """Whether a number literal in ``raw`` could be over budget (a long digit run, a 3-digit exponent)."""
    marks = raw.translate(_NUMBER_MARKS, b"+-")  # signs dropped: "1e+400" and "1e400" are both "0e000"
    return _DIGIT_RUN in marks or b"e000" in marks


def _loads(raw: bytes) -> Any:
    """``json.loads``, with the number hooks only where a number could be over budget (rare: C speed otherwise).
    UTF-8 only, no BOM (RFC 8259): ``json.loads(bytes)`` would also take UTF-16/32 and a BOM, which diffusers
    and transformers (``open(..., encoding="utf-8")`` then ``json.loads``) refuse: a ValueError here."""
    text = raw.decode("utf-8")
    if not _numbers_suspect(raw):
        return json.loads(text)
    return json.loads(text, parse_int=_checked_int, parse_float=_checked_float)


def _checked_int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise _NumberOverBudget(f"a number of {len(text)} digits; at most {MAX_NUMBER_CHARS} characters are allowed")
    return int(text)


def _checked_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise _NumberOverBudget(f"a number of {len(text)} characters; at most {MAX_NUMBER_CHARS} are allowed")
    value = float(text)
    if math.isinf(value):
        raise _NumberOverBudget(f"the number {text[:40]} is out of the range of a double")
    return value
