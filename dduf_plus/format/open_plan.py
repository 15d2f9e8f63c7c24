"""What opening an archive will read, planned from its central directory before the local headers are read,
so that a remote source can fetch it in a few merged requests (``dduf_plus.storage.prefetch_source``).

Per entry: its local header, then the start of its data: the safetensors header of a weights file, the
whole of ``model_index.json`` and configs, and for validation (which reads them) of every small non-weights
entry (tokenizer files). Where the data
starts and where a safetensors header ends come from the dduf_plus index when the bytes already fetched
(the tail) hold it; otherwise they are guessed (an aligned extra field, :data:`HEADER_GUESS` of header).

A plan is only a hint: every check still reads what it reads, and a read the plan missed (a guess too
short, an index that lies) is one more request, never a different verdict.

The one planner: validation and indexed reads of a remote archive (through :func:`prefetch_hook`) and the
whole-archive fetch (``dduf_plus.remote.fetch``, which fetches these ranges first) plan with it.

:data:`HEADER_GUESS` is 256 KiB: the largest safetensors headers of common diffusion components fit (SDXL's UNet,
1,680 tensors: 217 KiB; Flux's transformer, 1,156 tensors: 134 KiB, computed from their state dicts), and a
guess is only made for archives without a dduf_plus index. A larger guess (the fetch used 1 MiB) reads up to 4x
more for each weights entry of an archive that is validated, not downloaded; a header over the guess costs one
more request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import spec
from .structure import parse_json
from .weights import WEIGHT_SUFFIXES
from .zipfmt import DirectoryHook, ZipEntry

EXTRA_GUESS = 4096 + 64  # a local header's extra field when no index says where the data starts (alignment)
HEADER_GUESS = 256 << 10  # safetensors header bytes when no index says where tensor data starts
SMALL_ENTRY = 4 << 20  # non-weights entries up to this size are read whole by validation (configs, tokenizers)

Peek = Callable[[int, int], "bytes | None"]


def open_ranges(entries: list[ZipEntry], cd_offset: int, files: dict[str, Any], *,
                small_entries: bool = False) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges opening will read, one per entry: local headers, safetensors headers,
    ``model_index.json`` and configs; with ``small_entries`` (validation, a whole fetch) every small
    non-weights entry too. ``files`` is the dduf_plus index's ``files`` object ({} without one; untrusted:
    an offset it gives is used only where a local header could put the data)."""
    out = []
    for e in entries:
        head_end = e.header_offset + spec.LOCAL_HEADER_SIZE + len(e.name.encode("utf-8", "surrogateescape"))
        if not 0 <= e.header_offset < head_end <= cd_offset:
            continue
        found = files.get(e.name)
        record: dict[str, Any] = found if isinstance(found, dict) else {}
        offset = record.get("offset")
        indexed = type(offset) is int and head_end <= offset <= head_end + spec.U16_MAX
        data_at: int = offset if indexed else head_end + EXTRA_GUESS  # type: ignore[assignment]
        end = data_at
        if e.name.endswith(".safetensors"):
            tensors_at = record.get("tensor_data_offset")
            if indexed and type(tensors_at) is int and data_at + 8 <= tensors_at <= data_at + e.size:
                end = tensors_at
            else:
                end = data_at + min(e.size, HEADER_GUESS)
        elif e.size <= SMALL_ENTRY and (spec.json_budget(e.name) is not None
                                        or small_entries and not e.name.endswith(WEIGHT_SUFFIXES)):
            end = data_at + e.size
        out.append((e.header_offset, min(end, cd_offset) - e.header_offset))
    return out


def index_files(entries: list[ZipEntry], cd_offset: int, peek: Peek) -> dict[str, Any]:
    """The index's ``files`` object, when its local header and bytes have been fetched already; else {}.

    ``peek(offset, length)`` returns bytes already fetched, or None (it never does I/O)."""
    record = max(entries, key=lambda e: e.header_offset, default=None)
    budget = spec.json_budget(spec.INDEX_NAME)
    if record is None or record.name != spec.INDEX_NAME or (budget is not None and record.size > budget.bytes):
        return {}
    head = peek(record.header_offset, spec.LOCAL_HEADER_SIZE)
    if head is None or int.from_bytes(head[:4], "little") != spec.SIG_LOCAL:
        return {}
    data_at = record.header_offset + spec.LOCAL_HEADER_SIZE + int.from_bytes(head[26:28], "little") \
        + int.from_bytes(head[28:30], "little")
    raw = peek(data_at, record.size) if data_at + record.size <= cd_offset else None
    if raw is None:
        return {}
    index, problems = parse_json(raw, spec.INDEX_NAME, code="I001")  # budgeted, as when opening reads it
    files = index.get("files") if not problems and isinstance(index, dict) else None
    return files if isinstance(files, dict) else {}


def prefetch_hook(source: object) -> DirectoryHook | None:
    """For :func:`~dduf_plus.format.zipfmt.parse_layout`: a source that says it prefetches (a remote one,
    :mod:`dduf_plus.storage.prefetch_source`) is handed the plan once the central directory is parsed, so
    that what opening reads next arrives in a few merged requests; None for every other source."""
    if not getattr(source, "prefetching", False):
        return None
    small = bool(getattr(source, "reads_small_entries", False))

    def plan(entries: list[ZipEntry], cd_offset: int) -> None:
        files = index_files(entries, cd_offset, source.kept)  # type: ignore[attr-defined]
        source.prefetch(open_ranges(entries, cd_offset, files, small_entries=small))  # type: ignore[attr-defined]

    return plan
