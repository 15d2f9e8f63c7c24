"""Fewer round trips for structural reads of a remote archive.

Opening an archive reads its end records, central directory, every local header, the small entries
(configs, tokenizer files) and every safetensors header: a few kilobytes each, but one request each over a
plain range source (54 requests to validate a 5 MB archive, ~1 s at 20 ms a round trip).
:class:`PrefetchSource` wraps a remote :class:`~dduf_plus.storage.source.ByteSource` and fetches them in
as few requests as the layout allows:

- the first read near the end of the file fetches the last :data:`TAIL_GUESS` bytes at once: end records,
  central directory and (in an archive written by dduf_plus) the index, which lies just before it; an
  http(s) source already brought the file's end with its opening request (a suffix range,
  ``storage/http_range.SUFFIX_BYTES``): those bytes are taken over, and the tail costs no request at all;
- :meth:`PrefetchSource.prefetch` takes the ranges the format floor is about to read (it plans them from
  the central directory and, when the tail holds one, the index: ``dduf_plus.format.open_plan``), merges
  those less than :data:`MERGE_GAP` apart and fetches each merged span with one request;
- every later read inside a fetched span is served from memory; any other read goes to the wrapped source
  unchanged (one exact range request), so a plan that is wrong (a hostile index) costs requests, never
  correctness: every byte a check looks at is still the file's own, read by the wrapped source with its
  budgets (bytes received, deadline) and refusals.

What it keeps is bounded (:data:`MAX_KEPT` bytes in all); past that, reads go through unchanged. It never
widens a read by more than :data:`MERGE_GAP` per gap, so it receives at most the planned bytes plus the
gaps it bridged (each gap shorter than one round trip's worth of transfer on a 100 Mbit/s link)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from ..errors import DDUFError
from .source import ByteSource

TAIL_GUESS = 256 << 10  # end records + central directory + index of most archives
MERGE_GAP = 256 << 10  # ranges closer than this are fetched as one (the gap costs less than a round trip)
MAX_KEPT = 64 << 20  # bytes held in memory in all
MIN_TAIL = 64 << 10  # the tail guess of a small file: end records and directory of a few hundred entries

__all__ = ["MAX_KEPT", "MERGE_GAP", "TAIL_GUESS", "PrefetchSource", "coalesce"]


def coalesce(ranges: Iterable[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges sorted and merged where less than ``gap`` bytes apart, as ``(start, end)``."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted((o, o + n) for o, n in ranges if n > 0):
        if merged and start - merged[-1][1] <= gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class PrefetchSource:
    """A ByteSource over ``inner`` that fetches the tail at once and planned ranges in merged requests.

    ``requests`` counts the reads sent to ``inner`` (each is one range request for an http(s) source)."""

    prefetching = True  # the format floor plans its reads for sources that say so (format/zipfmt.parse_layout)

    def __init__(self, inner: ByteSource, *, tail: int | None = None, gap: int | None = None, keep: int = MAX_KEPT):
        self.inner, self.name, self.size = inner, inner.name, inner.size
        # By default the bridged gaps and the tail guess stay a small part of a small file (at most 1/64 a gap,
        # 1/16 the tail): a structural read of a 1 MB archive does not fetch a third of it to save a round trip.
        self._tail = tail if tail is not None else min(TAIL_GUESS, max(MIN_TAIL, self.size // 16))
        self._gap = gap if gap is not None else min(MERGE_GAP, self.size // 64)
        self._keep = keep
        self._spans: list[tuple[int, bytes]] = []  # (start, bytes) fetched, in fetch order
        self._kept = 0
        self._tail_tried = False
        self._lock = threading.Lock()
        self.requests = 0
        kept = getattr(inner, "kept_tail", None)
        end = kept() if callable(kept) else None  # (offset, bytes) the opening request brought
        if end is not None and isinstance(end[1], bytes) and end[0] + len(end[1]) == self.size:
            self._spans.append((end[0], end[1]))
            self._kept = len(end[1])
            self._tail_tried = end[0] <= self.size - self._tail  # it holds the whole tail guess: nothing to fetch

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    def kept(self, offset: int, length: int) -> bytes | None:
        """``[offset, offset + length)`` if it lies in a fetched span (no I/O), else None."""
        with self._lock:
            for start, data in reversed(self._spans):
                if start <= offset and offset + length <= start + len(data):
                    return data[offset - start:offset - start + length]
        return None

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DDUFError(f"{self.name}: read of {length} bytes at {offset} is outside the file")
        found = self.kept(offset, length)
        if found is not None:
            return found
        if not self._tail_tried and offset + length > self.size - self._tail:
            self._tail_tried = True  # the end records are read first: take the directory and index with them
            start = max(0, self.size - self._tail)
            if start <= offset and self._fetch(start, self.size):
                found = self.kept(offset, length)
                if found is not None:
                    return found
        self.requests += 1
        return self.inner.read_at(offset, length)

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Fetch ``(offset, length)`` ranges not already here, merged (:func:`coalesce`): the requests sent.

        Ranges are clipped to the file; a span that would pass :data:`MAX_KEPT` is left to be read on demand.
        Raises what the wrapped source raises (an unreachable or misbehaving server)."""
        wanted = []
        for offset, length in ranges:
            offset, end = max(0, offset), min(self.size, offset + length)
            if end > offset and self.kept(offset, end - offset) is None:
                wanted.append((offset, end - offset))
        sent = 0
        for start, end in coalesce(wanted, self._gap):
            sent += self._fetch(start, end)
        return sent

    def _fetch(self, start: int, end: int) -> bool:
        """Fetch ``[start, end)`` and keep it, unless that would pass the memory bound."""
        with self._lock:
            if self._kept + (end - start) > self._keep:
                return False
            self._kept += end - start
        self.requests += 1
        try:
            data = self.inner.read_at(start, end - start)
        except BaseException:
            with self._lock:
                self._kept -= end - start
            raise
        with self._lock:
            self._spans.append((start, data))
        return True

    def close(self) -> None:
        with self._lock:
            self._spans, self._kept = [], 0
        self.inner.close()

    def __enter__(self) -> PrefetchSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
