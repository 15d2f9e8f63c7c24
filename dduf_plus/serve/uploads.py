"""Request bodies, streamed: a raw upload or a multipart form, spooled to a private temporary file inside
the app's own folder, never held whole in memory. Size is bounded while reading (and by Content-Length
before); the caller removes the file whatever happens (the client going away included)."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.to_thread
from python_multipart.multipart import MultipartParser, parse_options_header

FLUSH_BYTES = 1 << 20
MAX_FIELD = 8 << 10  # a form field (url, verify, strict): short text
FORM_SLACK = 64 << 10  # multipart boundaries and part headers around the file
_UNSAFE = re.compile(r"[^\w.+-]+")


class TooLarge(Exception):
    """The body is over the upload limit (HTTP 413)."""


class BadForm(Exception):
    """The body is not a form this endpoint understands (HTTP 400)."""


def display_name(raw: str | None) -> str:
    """The name a report shows for an upload: the client's file name, base name only, plain characters."""
    base = (raw or "").replace("\\", "/").rsplit("/", 1)[-1]
    base = _UNSAFE.sub("_", base).strip("._")[:200]
    return base or "upload.dduf"


@dataclass
class Upload:
    """What a request body held: the spooled file (if any), its display name, and the form's text fields."""

    path: str | None = None
    name: str = "upload.dduf"
    size: int = 0
    fields: dict[str, str] = field(default_factory=dict)

    def discard(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None


class _Spool:
    """An exclusively created file in ``folder``, written in ~1 MiB batches off the event loop."""

    def __init__(self, folder: Path, name: str, limit: int, upload: Upload):
        suffix = ".dduf.zst" if name.endswith(".zst") else ".dduf"
        fd, path = tempfile.mkstemp(prefix="upload-", suffix=suffix, dir=folder)
        self.fd, self.limit, self.upload = fd, limit, upload
        upload.path, upload.name = path, name
        self.buffer = bytearray()

    def add(self, data: bytes) -> None:
        self.upload.size += len(data)
        if self.upload.size > self.limit:
            raise TooLarge(f"the upload is over the limit of {self.limit} bytes")
        self.buffer += data

    async def flush(self, final: bool = False) -> None:
        if self.buffer and (final or len(self.buffer) >= FLUSH_BYTES):
            data, self.buffer = bytes(self.buffer), bytearray()
            await anyio.to_thread.run_sync(_write_all, self.fd, data)
        if final:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


async def spool_raw(chunks: AsyncIterator[bytes], folder: Path, name: str, limit: int) -> Upload:
    """A raw body (``application/octet-stream``) into a temporary file."""
    upload = Upload()
    spool = _Spool(folder, name, limit, upload)
    try:
        async for chunk in chunks:
            spool.add(chunk)
            await spool.flush()
        await spool.flush(final=True)
    except BaseException:
        spool.close()
        upload.discard()
        raise
    return upload


async def spool_form(chunks: AsyncIterator[bytes], content_type: str, folder: Path, limit: int) -> Upload:
    """A ``multipart/form-data`` body: the part named ``file`` into a temporary file, short text fields kept."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadForm("multipart body without a boundary")
    upload = Upload()
    state: dict[str, Any] = {"headers": {}, "field": b"", "value": b"", "text": None, "spool": None}
    spools: list[_Spool] = []

    def header_end() -> None:
        state["headers"][state["field"].lower()] = state["value"]
        state["field"], state["value"] = b"", b""

    def headers_done() -> None:
        _, disposition = parse_options_header(state["headers"].get(b"content-disposition", b""))
        part = disposition.get(b"name", b"").decode("utf-8", "replace")
        if part == "file" and disposition.get(b"filename") and not spools:  # a form without a file sends filename=""
            spools.append(_Spool(folder, display_name(disposition[b"filename"].decode("utf-8", "replace")), limit, upload))
            state["spool"] = spools[0]
        else:
            state["text"], state["spool"] = (part, bytearray()), None
        state["headers"] = {}

    def data(buf: bytes, start: int, end: int) -> None:
        if state["spool"] is not None:
            state["spool"].add(buf[start:end])
        elif state["text"] is not None:
            state["text"][1].extend(buf[start:end])
            if len(state["text"][1]) > MAX_FIELD:
                raise BadForm(f"form field {state['text'][0]!r} is over {MAX_FIELD} bytes")

    def part_end() -> None:
        if state["text"] is not None:
            key, value = state["text"]
            upload.fields[key] = value.decode("utf-8", "replace")
        state["text"], state["spool"] = None, None

    callbacks: Any = {
        "on_header_field": lambda b, s, e: state.__setitem__("field", state["field"] + b[s:e]),
        "on_header_value": lambda b, s, e: state.__setitem__("value", state["value"] + b[s:e]),
        "on_header_end": header_end, "on_headers_finished": headers_done,
        "on_part_data": data, "on_part_end": part_end,
    }
    parser = MultipartParser(boundary, callbacks, max_size=limit + FORM_SLACK)
    try:
        async for chunk in chunks:
            parser.write(chunk)
            if spools:
                await spools[0].flush()
        parser.finalize()
        if spools:
            await spools[0].flush(final=True)
    except BaseException as e:
        for spool in spools:
            spool.close()
        upload.discard()
        if isinstance(e, (TooLarge, BadForm)) or not isinstance(e, Exception):
            raise
        raise BadForm(f"malformed multipart body: {e}") from None
    return upload
