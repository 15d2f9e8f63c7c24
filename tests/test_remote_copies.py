"""What the client does with each fetched byte (:attr:`RemoteFetch.stats`, a counting hook): every entry is
hashed exactly once, every received byte is written once from a small reused buffer (cache-sized blocks, not
whole pieces), arrived bytes are hashed in place (no read-back copy) where the file can be mapped, the last
pieces are cut smaller, and a failing write is a DDUFIOError naming the file. Counts and sizes, never clocks."""

from __future__ import annotations

import errno
import hashlib
import sys
import threading
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from servers import FileServer, served_archive  # noqa: E402

from dduf_plus.errors import DDUFIOError  # noqa: E402
from dduf_plus.remote import fetch as fetch_module  # noqa: E402
from dduf_plus.remote import pieces, readers, transfer  # noqa: E402
from dduf_plus.storage import fd_io  # noqa: E402

CHUNK = 64 << 10
BLOCK = 16 << 10


@pytest.fixture
def served(packed, tmp_path, monkeypatch) -> Path:
    folder = served_archive(Path(packed["tiny-sd"]), tmp_path, monkeypatch)
    # blocks smaller than a piece, so that a piece is streamed through the buffer in several writes
    monkeypatch.setattr(readers, "RECEIVE_BLOCK", BLOCK)
    monkeypatch.setattr(transfer, "RECEIVE_BLOCK", BLOCK)
    return folder


def fetched(url: str, **options) -> fetch_module.RemoteFetch:
    opened = fetch_module.open_remote(url, {"chunk_size": CHUNK, "timeout": 2.0, **options}, in_memory=False)
    assert isinstance(opened, fetch_module.RemoteFetch)
    opened.finish()
    return opened


def entry_bytes(path: Path) -> int:
    with zipfile.ZipFile(path) as z:
        return sum(info.file_size for info in z.infolist())


def test_every_entry_is_hashed_once_and_every_byte_written_once_in_small_blocks(served):
    local = served / "tiny-sd.dduf"
    with FileServer(served) as srv:
        done = fetched(srv.url("tiny-sd.dduf"))
    stats = done.stats
    assert stats.hashed == entry_bytes(local)  # each entry's bytes once: no second pass for the cache
    assert stats.read_back == 0  # hashed in place through the mapping, not copied back out of the file
    assert 0 < stats.received <= local.stat().st_size and stats.received == done.fetched_bytes
    assert stats.written == stats.received  # one write per received byte
    assert stats.largest_write == BLOCK  # streamed through the small buffer, not a whole 64 KiB piece at once
    assert done.final is not None and done.final.read_bytes() == local.read_bytes()


def test_without_a_mapping_arrived_bytes_are_read_back_and_still_checked(served, monkeypatch):
    monkeypatch.setattr(transfer, "map_for_reading", lambda fd, size: None)
    local = served / "tiny-sd.dduf"
    with FileServer(served) as srv:
        done = fetched(srv.url("tiny-sd.dduf"), concurrency=8)
    assert done.stats.hashed == entry_bytes(local)
    assert 0 < done.stats.read_back <= done.stats.hashed  # pieces that arrived ahead of the hash, copied back
    with zipfile.ZipFile(local) as z:
        want = {i.filename: hashlib.sha256(z.read(i)).hexdigest() for i in z.infolist()}
    assert done.entry_sha256() == want


def test_the_last_pieces_are_cut_smaller(served, monkeypatch):
    monkeypatch.setattr(pieces, "TAIL_PIECE_MIN", BLOCK)  # chunk 64 KiB / 4 = 16 KiB tail pieces
    small = CHUNK // pieces.TAIL_SPLIT
    with FileServer(served) as srv:
        done = fetched(srv.url("tiny-sd.dduf"), concurrency=4)
    lengths = [length for _, _, _, length in done.timeline]
    assert lengths.count(small) >= 4
    # only the end of the queue is cut: at most one piece per worker's worth of chunk_size pieces
    assert sum(n for n in lengths if n == small) <= 4 * CHUNK + CHUNK
    assert sum(n for n in lengths if n == CHUNK) > 4 * CHUNK  # the bulk still goes in whole chunks


def test_a_failing_write_is_an_io_error_naming_the_file(served, monkeypatch):
    real = fd_io.pwrite_all

    def full(fd, data, offset):
        if threading.current_thread().name.startswith("dduf-fetch-"):  # the workers' writes, not the tail's
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    monkeypatch.setattr(transfer, "pwrite_all", full)
    with FileServer(served) as srv, pytest.raises(DDUFIOError, match=r"cannot write bytes .*partial.*No space left"):
        fetch_module.fetch_archive(srv.url("tiny-sd.dduf"), {"chunk_size": CHUNK, "timeout": 2.0})


def test_hashed_pages_are_let_go_of_the_mapping(served, monkeypatch):
    """Every byte hashed in place is handed back (madvise DONTNEED on the read-only mapping): a fetch without a
    loader does not keep the whole archive mapped."""
    from dduf_plus.remote import sink

    forgotten: list[int] = []
    real = sink.ReadMap.forget

    def counting(self, start: int, end: int) -> None:
        forgotten.append(end - start)
        real(self, start, end)

    monkeypatch.setattr(sink.ReadMap, "forget", counting)
    with FileServer(served) as srv:
        done = fetched(srv.url("tiny-sd.dduf"))
    assert sum(forgotten) == done.stats.hashed > 0


def _queue_over(size: int, chunk: int, concurrency: int) -> pieces.PieceQueue:
    """A queue over ``size`` bytes of an archive with no entries (nothing for opening to read first)."""
    from types import SimpleNamespace

    from dduf_plus.remote.intervals import Intervals

    tail = SimpleNamespace(start=size, records=[], cd_offset=size, file_records=lambda: {})
    queue = pieces.PieceQueue(chunk, concurrency)
    queue.plan(tail, Intervals())
    return queue


def test_pieces_follow_the_build_order_then_the_archive_order() -> None:
    queue = _queue_over(100, 10, 1)
    queue.prioritize([(55, 75, 0), (0, 5, 1)], last=2)  # a component at 55-75 first, then one at 0-5
    order = [queue.next() for _ in range(len(queue))]
    assert order[:4] == [(50, 60), (60, 70), (70, 80), (0, 10)]
    assert order[4:] == [(10, 20), (20, 30), (30, 40), (40, 50), (80, 90), (90, 100)]


def test_only_the_last_pieces_are_cut_smaller(monkeypatch) -> None:
    monkeypatch.setattr(pieces, "TAIL_PIECE_MIN", 1)
    queue = _queue_over(100, 8, 2)  # small pieces: 8 // TAIL_SPLIT = 2 bytes
    handed = [queue.next() for _ in range(100) if len(queue)]
    assert sum(b - a for a, b in handed) == 100 and not len(queue)
    lengths = [b - a for a, b in handed]
    first_cut = lengths.index(2)
    assert all(n == 8 for n in lengths[:first_cut]) and all(n <= 8 for n in lengths[first_cut:])
    assert sum(lengths[first_cut:]) <= 2 * 8 + 8  # the cut only begins within a worker's chunk of the end
