"""What a fetch (:mod:`.transfer`) asks for next: the missing bytes of an archive cut into ``chunk_size``
pieces, what opening the archive reads first (:func:`dduf_plus.format.open_plan.open_ranges`, the one
planner, neighbours merged as a remote source's prefetch merges them), then the rest in archive order or in
the loader's build order (:meth:`PieceQueue.prioritize`); the last pieces cut smaller, so that the pieces in
flight at the end finish close together. Not thread-safe: the fetch holds its lock around every call."""

from __future__ import annotations

from collections import deque

from ..format.open_plan import open_ranges
from ..storage.prefetch_source import MERGE_GAP, coalesce
from .intervals import Intervals
from .tail import Tail

TAIL_SPLIT = 4  # the last pieces are chunk_size / TAIL_SPLIT bytes (see PieceQueue.next)
TAIL_PIECE_MIN = 1 << 20


def metadata_spans(tail: Tail) -> list[tuple[int, int]]:
    """What opening the archive reads, as ``(start, end)`` spans, neighbours closer than :data:`MERGE_GAP`
    merged into one request."""
    planned = open_ranges(tail.records, tail.cd_offset, tail.file_records(), small_entries=True)
    return coalesce(planned, MERGE_GAP)


class PieceQueue:
    """The ``(start, end)`` pieces still to fetch, in the order they are handed out."""

    def __init__(self, chunk_size: int, concurrency: int):
        self.chunk_size, self.concurrency = chunk_size, concurrency
        self._pieces: deque[tuple[int, int]] = deque()

    def __len__(self) -> int:
        return len(self._pieces)

    def plan(self, tail: Tail, done: Intervals) -> None:
        """Queue what is missing of the archive before ``tail.start``: metadata first, then the rest in archive
        order, in ``chunk_size`` pieces."""
        missing = Intervals([(0, tail.start)]).minus(done)
        metadata = Intervals(metadata_spans(tail)).intersect(missing)
        for span in (metadata, missing.minus(metadata)):
            for start, end in span:
                for at in range(start, end, self.chunk_size):
                    self._pieces.append((at, min(end, at + self.chunk_size)))

    def next(self) -> tuple[int, int]:
        """The next piece to fetch. The last ``concurrency`` pieces are cut smaller: pieces in flight finish
        together, and what arrived behind the first of them is hashed after the last byte came (a backlog of
        ``concurrency * chunk_size`` bytes at the end); smaller ones leave little behind."""
        start, end = self._pieces.popleft()
        small = max(self.chunk_size // TAIL_SPLIT, TAIL_PIECE_MIN)
        if end - start > small and sum(b - a for a, b in self._pieces) < self.concurrency * (end - start):
            self._pieces.appendleft((start + small, end))
            end = start + small
        return start, end

    def prioritize(self, ranked: list[tuple[int, int, int]], last: int) -> None:
        """Hand out first the pieces overlapping the lowest-ranked ``(start, end, rank)`` spans (the loader's
        build order); pieces overlapping none come after them, ranked ``last``; archive order within a rank."""
        def key(piece: tuple[int, int]) -> tuple[int, int]:
            return min((r for a, b, r in ranked if a < piece[1] and piece[0] < b), default=last), piece[0]

        self._pieces = deque(sorted(self._pieces, key=key))
