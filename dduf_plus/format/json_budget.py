"""Bounds on untrusted JSON, checked on its bytes before a parser sees them.

A JSON parser's memory grows with the number of values it builds (an empty object costs 64 bytes, so a
60 MB ``[{},{},...]`` becomes 1.6 GB) and a recursive parser's stack with the nesting depth. Both are
bounded here with a few C-speed passes over the bytes (``count``, ``translate``, ``split``), no recursion
and no Python code per character: ~0.2 s for 50 MB at worst, a few ms for real files."""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple

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
