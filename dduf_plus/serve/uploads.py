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
        fd, path = tempfile.mkstemp(prefix="upload-", suffix=".dduf", dir=folder)  # never .zst: see app.Service.check
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


class _FormSink:
    """python-multipart callbacks: the part named ``file`` (with a file name) into a spool, short text
    fields into ``upload.fields``."""

    def __init__(self, folder: Path, limit: int, upload: Upload):
        self.folder, self.limit, self.upload = folder, limit, upload
        self.headers: dict[bytes, bytes] = {}
        self.field, self.value = b"", b""
        self.text: tuple[str, bytearray] | None = None
        self.spool: _Spool | None = None  # the file, once its part began
        self.writing = False  # inside the file part now

    def callbacks(self) -> Any:
        return {"on_header_field": self._header_field, "on_header_value": self._header_value,
                "on_header_end": self._header_end, "on_headers_finished": self._headers_done,
                "on_part_data": self._data, "on_part_end": self._part_end}

    def _header_field(self, buf: bytes, start: int, end: int) -> None:
        self.field += buf[start:end]

    def _header_value(self, buf: bytes, start: int, end: int) -> None:
        self.value += buf[start:end]

    def _header_end(self) -> None:
        self.headers[self.field.lower()] = self.value
        self.field, self.value = b"", b""

    def _headers_done(self) -> None:
        _, disposition = parse_options_header(self.headers.get(b"content-disposition", b""))
        part = disposition.get(b"name", b"").decode("utf-8", "replace")
        filename = disposition.get(b"filename")
        if part == "file" and filename and self.spool is None:  # a form without a file sends filename=""
            self.spool = _Spool(self.folder, display_name(filename.decode("utf-8", "replace")), self.limit, self.upload)
            self.writing = True
        else:
            self.text = (part, bytearray())
        self.headers = {}

    def _data(self, buf: bytes, start: int, end: int) -> None:
        if self.writing and self.spool is not None:
            self.spool.add(buf[start:end])
        elif self.text is not None:
            self.text[1].extend(buf[start:end])
            if len(self.text[1]) > MAX_FIELD:
                raise BadForm(f"form field {self.text[0]!r} is over {MAX_FIELD} bytes")

    def _part_end(self) -> None:
        if self.text is not None:
            self.upload.fields[self.text[0]] = self.text[1].decode("utf-8", "replace")
        self.text, self.writing = None, False


async def spool_form(chunks: AsyncIterator[bytes], content_type: str, folder: Path, limit: int) -> Upload:
    """A ``multipart/form-data`` body: the part named ``file`` into a temporary file, short text fields kept."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadForm("multipart body without a boundary")
    upload = Upload()
    sink = _FormSink(folder, limit, upload)
    parser = MultipartParser(boundary, sink.callbacks(), max_size=limit + FORM_SLACK)
    try:
        async for chunk in chunks:
            parser.write(chunk)
            if sink.spool is not None:
                await sink.spool.flush()
        parser.finalize()
        if sink.spool is not None:
            await sink.spool.flush(final=True)
    except BaseException as e:
        if sink.spool is not None:
            sink.spool.close()
        upload.discard()
        if isinstance(e, (TooLarge, BadForm)) or not isinstance(e, Exception):
            raise
        raise BadForm(f"malformed multipart body: {e}") from None
    return upload
