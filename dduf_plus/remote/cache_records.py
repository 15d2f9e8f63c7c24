"""What the remote cache remembers of a URL and of a fetched archive: the per-URL record (size, where the tail
starts, the key) that lets a second load read exactly the tail in one request, the ``<key>.sha256.json``
manifest of every entry's checked sha256, the ``<key>.progress.json`` record of an interrupted fetch's byte
ranges, and a range reader over a cached file (:mod:`.fetch` and :mod:`.transfer` write them;
``local_files_only`` loads find the file through them)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..errors import DDUFIOError
from ..storage.confined import Confined
from .tail import Tail


def url_record(cache: Confined, url: str) -> Path:
    return cache.path("urls", hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest() + ".json")


def read_record(cache: Confined, url: str) -> dict[str, Any]:
    try:
        record = json.loads(url_record(cache, url).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) and record.get("url") == url else {}


def write_record(cache: Confined, url: str, size: int, tail: Tail) -> None:
    path = url_record(cache, url)
    cache.mkdir(path.parent)
    cache.write_bytes(path, json.dumps({"url": url, "size": size, "tail_start": tail.start, "key": tail.key}).encode())


def manifest_path(cache: Confined, key: str) -> Path:
    return cache.path(f"{key}.sha256.json")


def write_manifest(cache: Confined, tail: Tail, url: str, size: int, digests: dict[str, str]) -> None:
    """``<key>.sha256.json`` beside a completed archive: every entry's sha256 as fetched and checked, and the
    URL it came from when the key is bound to it (no index sha256 for every entry)."""
    record = {"key": tail.key, "size": size, "shared": tail.shared, "url": None if tail.shared else url,
              "sha256": dict(sorted(digests.items()))}
    cache.write_bytes(manifest_path(cache, tail.key), json.dumps(record, indent=1).encode())


def progress_bytes(url: str, size: int, key: str, spans: list[list[int]]) -> bytes:
    """The progress record of a fetch of ``size`` bytes under ``key``: the byte ranges already in its partial
    file (a resume hashes them locally instead of fetching them again)."""
    return json.dumps({"url": url, "size": size, "key": key, "done": spans}).encode()


def read_progress(path: Path, size: int, key: str) -> list[tuple[int, int]]:
    """The byte ranges the progress record at ``path`` lists, when it is this archive's (same size and key:
    for an archive whose key is bound to its URL, the same URL); none when it is not, or is unreadable."""
    try:
        record = json.loads(path.read_text())
        if record.get("size") != size or record.get("key") != key:
            return []
        return [(int(a), int(b)) for a, b in record.get("done", []) if 0 <= int(a) < int(b) <= size]
    except (OSError, ValueError, TypeError, AttributeError):
        return []


def cached_sha256(path: str | os.PathLike) -> dict[str, str] | None:
    """{entry: sha256} recorded when the remote-cache file ``path`` was fetched and checked (None: no record).
    For an archive without a complete index these are the only strong hashes of its entries."""
    path = Path(path)
    try:
        record = json.loads(path.with_name(path.name.removesuffix(".dduf") + ".sha256.json").read_text())
    except (OSError, ValueError):
        return None
    digests = record.get("sha256") if isinstance(record, dict) else None
    return dict(digests) if isinstance(digests, dict) else None


class LocalRanges:
    """A :class:`RangeReader` over a cached file, named by the URL it was fetched from (the key of an
    archive bound to its URL covers the URL)."""

    def __init__(self, url: str, path: Path):
        self.name, self.path, self.size = url, path, path.stat().st_size
        self.bytes_read = 0

    def read_at(self, offset: int, length: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        if len(data) != length:
            raise DDUFIOError(f"{self.path}: short read at {offset}")
        self.bytes_read += length
        return data

    def read_into(self, offset: int, out: memoryview) -> None:
        out[:] = self.read_at(offset, len(out))

    def remaining(self) -> float:
        return float("inf")

    def close(self) -> None:
        pass
