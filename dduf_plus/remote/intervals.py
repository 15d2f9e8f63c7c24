"""Sets of byte ranges ``[start, end)``, kept sorted and merged: what a fetch has, what it still needs."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator


class Intervals:
    """Disjoint, sorted, merged half-open ranges."""

    def __init__(self, spans: Iterable[tuple[int, int]] = ()):
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in sorted(spans):
            self.add(start, end)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(list(zip(self._starts, self._ends, strict=True)))

    def spans(self) -> list[list[int]]:
        return [[a, b] for a, b in zip(self._starts, self._ends, strict=True)]

    def total(self) -> int:
        return sum(b - a for a, b in zip(self._starts, self._ends, strict=True))

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        i = bisect_right(self._ends, start - 1)  # first range that ends at or after start
        j = bisect_right(self._starts, end)  # ranges before j start at or before end
        if i < j:
            start, end = min(start, self._starts[i]), max(end, self._ends[j - 1])
        self._starts[i:j], self._ends[i:j] = [start], [end]

    def remove(self, start: int, end: int) -> None:
        kept = [(a, b) for a, b in self if b <= start or a >= end]
        kept += [(a, start) for a, b in self if a < start < b] + [(end, b) for a, b in self if a < end < b]
        self._starts, self._ends = [], []
        for a, b in sorted(kept):
            self.add(a, b)

    def reach(self, at: int) -> int:
        """The end of the range holding byte ``at``; ``at`` itself when none does."""
        i = bisect_right(self._starts, at) - 1
        return self._ends[i] if i >= 0 and self._ends[i] > at else at

    def covers(self, start: int, end: int) -> bool:
        return end <= start or self.reach(start) >= end

    def minus(self, other: Intervals) -> Intervals:
        out = Intervals(self)
        for a, b in other:
            out.remove(a, b)
        return out

    def intersect(self, other: Intervals) -> Intervals:
        return self.minus(self.minus(other))
