"""Request bodies, streamed: a raw upload or a multipart form, spooled to a private temporary file inside
the app's own folder, never held whole in memory. Size is bounded while reading (and by Content-Length
before); the caller removes the file whatever happens (the client going away included).

A hostile client is bounded too: how many bodies arrive at once (:class:`Intake`, overall and per client
address), how long one may take and how slowly it may trickle (:func:`timed`), how many form parts it may
send and how large each part's headers and text are (:class:`_FormSink`), and how much disk the spools may
leave free."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.to_thread
from python_multipart.multipart import MultipartParser, parse_options_header

from ..sizes import format_size
from ..storage.fd_io import write_all

FLUSH_BYTES = 1 << 20
MAX_FIELD = 8 << 10  # a form field (url, verify, strict): short text
MAX_PART_HEADERS = 8 << 10  # the headers of one multipart part (Content-Disposition, Content-Type)
FORM_SLACK = 64 << 10  # multipart boundaries and part headers around the file
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ZST_REFUSED = ("a .zst upload is not validated here (decompressing it would write outside the app's folder): "
               "decompress it first (dduf decompress X.dduf.zst) and upload the .dduf")
_UNSAFE = re.compile(r"[^\w.+-]+")
# what a urlencoded form body starts with (a short field name and "="); anything else sent with that content
# type (curl --data-binary's default) is taken as the archive itself
_FORM_START = re.compile(rb"[A-Za-z0-9_.%+-]{1,64}=")


class TooLarge(Exception):
    """The body is over the upload limit (HTTP 413)."""


class BadForm(Exception):
    """The body is not a form this endpoint understands (HTTP 400)."""


class SlowBody(Exception):
    """The body did not arrive in time, or arrived slower than the minimum rate (HTTP 408)."""


class NoSpace(Exception):
    """Spooling the upload would leave less free disk than the app keeps (HTTP 507)."""


class Crowded(Exception):
    """Too many bodies are being received at once (HTTP 503), or from this client (``per_client``: 429)."""

    def __init__(self, message: str, per_client: bool = False):
        super().__init__(message)
        self.per_client = per_client


class Ticket:
    """One body being received: who sends it, since when, how much arrived; ``evicted`` once the intake
    gave its place to a newcomer (the read in progress, if any, is interrupted then)."""

    def __init__(self, client: str):
        self.client, self.start, self.received = client, time.monotonic(), 0
        self.evicted = False
        self.interrupted = False  # the current read was cancelled by us (deadline or eviction), not from outside
        self._reader: asyncio.Task[Any] | None = None  # the task blocked in a read now

    def rate(self, now: float) -> float:
        return self.received / max(now - self.start, 1e-3)

    def interrupt(self) -> None:
        """Cancel the read in progress (called on the event loop)."""
        if self._reader is not None and not self.interrupted:
            self.interrupted = True
            self._reader.cancel()

    async def read(self, iterator: AsyncIterator[bytes], due: float) -> bytes:
        """The next chunk, or :class:`_Interrupted` at ``due`` (monotonic time) or on eviction. One timer per
        read (no task per chunk: ~1 us instead of ~80 us, at 16k chunks per GiB)."""
        if self.evicted:
            raise _Interrupted
        loop = asyncio.get_running_loop()
        self._reader, self.interrupted = asyncio.current_task(), False
        timer = loop.call_later(max(0.0, due - time.monotonic()), self.interrupt)
        try:
            return await iterator.__anext__()
        except asyncio.CancelledError:
            if not self.interrupted:
                raise  # cancelled from outside (the server shutting down): not ours to swallow
            uncancel = getattr(self._reader, "uncancel", None)  # Python 3.11+: the task is not cancelled any more
            if uncancel is not None:
                uncancel()
            raise _Interrupted from None
        finally:
            timer.cancel()
            self._reader = None


class _Interrupted(Exception):
    """A read stopped by its deadline or by eviction."""


class Intake:
    """Admission of request bodies, apart from the validation slots: at most ``total`` being received at
    once, ``per_client`` of them from one client address. When all places are taken, a newcomer takes the
    place of the slowest body arriving below ``min_rate`` bytes/s (measured over at least ``MIN_AGE``
    seconds): clients that trickle cannot keep one that sends at a normal rate out; to hold the service
    they must each keep sending ``min_rate``. Runs on the event loop (one thread)."""

    MIN_AGE = 1.0

    def __init__(self, total: int, per_client: int, min_rate: int = 0):
        self.total, self.per_client, self.min_rate = total, per_client, min_rate
        self._tickets: set[Ticket] = set()
        self._clients: Counter[str] = Counter()

    def _slowest(self) -> Ticket | None:
        now = time.monotonic()
        old = [t for t in self._tickets if now - t.start >= self.MIN_AGE and t.rate(now) < self.min_rate]
        return min(old, key=lambda t: t.rate(now), default=None)

    def _drop(self, ticket: Ticket) -> None:
        if ticket in self._tickets:
            self._tickets.discard(ticket)
            self._clients[ticket.client] -= 1
            if self._clients[ticket.client] <= 0:
                del self._clients[ticket.client]

    @contextmanager
    def admit(self, client: str) -> Iterator[Ticket]:
        if self._clients[client] >= self.per_client:
            raise Crowded(f"{self.per_client} uploads from {client} are arriving already", per_client=True)
        if len(self._tickets) >= self.total:
            victim = self._slowest()
            if victim is None:
                raise Crowded(f"{self.total} uploads are arriving already; try again shortly")
            victim.evicted = True
            self._drop(victim)
            victim.interrupt()
        ticket = Ticket(client)
        self._tickets.add(ticket)
        self._clients[client] += 1
        try:
            yield ticket
        finally:
            self._drop(ticket)


async def timed(chunks: AsyncIterator[bytes], deadline: float, min_rate: int, grace: float,
                ticket: Ticket | None = None) -> AsyncIterator[bytes]:
    """``chunks`` while they keep coming: the whole body within ``deadline`` seconds, and, once ``grace``
    seconds have passed, at least ``min_rate`` bytes/s on average since the start; :class:`SlowBody` else
    (also when ``ticket`` is evicted). Each wait is bounded, so a client that sends nothing at all is cut off
    as surely as one that trickles."""
    ticket = ticket or Ticket("-")
    start, iterator = ticket.start, chunks.__aiter__()
    while True:
        due = start + deadline
        if min_rate > 0:
            due = min(due, start + grace + (ticket.received + 1) / min_rate)
        try:
            chunk = await ticket.read(iterator, due)
        except StopAsyncIteration:
            return
        except _Interrupted:
            raise _slow(ticket, deadline, min_rate, grace) from None
        ticket.received += len(chunk)
        yield chunk


def _slow(ticket: Ticket, deadline: float, min_rate: int, grace: float) -> SlowBody:
    elapsed = time.monotonic() - ticket.start
    if ticket.evicted:
        return SlowBody(f"the request body arrived too slowly ({ticket.received} bytes in {elapsed:.0f} s) while "
                        f"the service was full; send at least {min_rate} bytes/s")
    if elapsed >= deadline:
        return SlowBody(f"the request body took longer than {deadline:g} s")
    return SlowBody(f"the request body arrived too slowly ({ticket.received} bytes in {elapsed:.0f} s; at least "
                    f"{min_rate} bytes/s after the first {grace:g} s)")


async def peek(chunks: AsyncIterator[bytes], size: int) -> tuple[bytes, AsyncIterator[bytes]]:
    """The first ``size`` bytes of a body (fewer if it is shorter) and the whole body again, as a stream."""
    iterator = chunks.__aiter__()
    head = b""
    while len(head) < size:
        try:
            head += await iterator.__anext__()
        except StopAsyncIteration:
            break

    async def again() -> AsyncIterator[bytes]:
        if head:
            yield head
        async for chunk in iterator:
            yield chunk

    return head[:size], again()


def looks_like_form(head: bytes) -> bool:
    """Whether a body sent as ``application/x-www-form-urlencoded`` is one (else: an archive sent by
    ``curl --data-binary @x.dduf``, whose content type is that by default)."""
    return not head or bool(_FORM_START.match(head))


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

    def __init__(self, folder: Path, name: str, limit: int, upload: Upload, reserve: int = 0):
        fd, path = tempfile.mkstemp(prefix="upload-", suffix=".dduf", dir=folder)  # never .zst: see app.Service.check
        self.fd, self.limit, self.upload, self.folder, self.reserve = fd, limit, upload, folder, reserve
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
            await anyio.to_thread.run_sync(_write_keeping_reserve, self.fd, data, self.folder, self.reserve)
        if final:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write_keeping_reserve(fd: int, data: bytes, folder: Path, reserve: int) -> None:
    """All of ``data`` to the spool file, refused first where it would leave less than ``reserve`` free."""
    if reserve and shutil.disk_usage(folder).free - len(data) < reserve:  # every ~1 MiB: a statvfs, microseconds
        raise NoSpace(f"not enough free disk space for this upload now (the app keeps "
                      f"{format_size(reserve, binary=True)} free)")
    write_all(fd, data)


async def spool_raw(chunks: AsyncIterator[bytes], folder: Path, name: str, limit: int, reserve: int = 0) -> Upload:
    """A raw body (``application/octet-stream``, or any type but JSON, forms and multipart) into a temporary
    file; an empty body is :class:`BadForm`."""
    upload = Upload()
    spool = _Spool(folder, name, limit, upload, reserve)
    try:
        async for chunk in chunks:
            spool.add(chunk)
            await spool.flush()
        await spool.flush(final=True)
    except BaseException:
        spool.close()
        upload.discard()
        raise
    if upload.size == 0:
        upload.discard()
        raise BadForm(EMPTY)
    return upload


EMPTY = ("the body is empty: send the archive as the body (curl --data-binary @x.dduf -H 'Content-Type: "
         "application/octet-stream' URL), as a multipart field named file (curl -F file=@x.dduf URL), "
         'or JSON {"url": ...}')


class _FormSink:
    """python-multipart callbacks: the part named ``file`` (with a file name) into a spool, short text
    fields into ``upload.fields``. At most ``max_parts`` parts, each with at most MAX_PART_HEADERS bytes of
    headers and (text) MAX_FIELD bytes of value: a form of many small fields costs kilobytes, not a
    multiple of the body."""

    def __init__(self, folder: Path, limit: int, upload: Upload, max_parts: int = 16, reserve: int = 0):
        self.folder, self.limit, self.upload, self.max_parts, self.reserve = folder, limit, upload, max_parts, reserve
        self.headers: dict[bytes, bytes] = {}
        self.field, self.value = b"", b""
        self.header_bytes, self.parts = 0, 0
        self.text: tuple[str, bytearray] | None = None
        self.spool: _Spool | None = None  # the file, once its part began
        self.writing = False  # inside the file part now

    def callbacks(self) -> Any:
        return {"on_part_begin": self._part_begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_done, "on_part_data": self._data, "on_part_end": self._part_end}

    def _part_begin(self) -> None:
        self.parts += 1
        if self.parts > self.max_parts:
            raise BadForm(f"more than {self.max_parts} form fields")
        self.header_bytes = 0

    def _count_header(self, n: int) -> None:
        self.header_bytes += n
        if self.header_bytes > MAX_PART_HEADERS:
            raise BadForm(f"the headers of form field {self.parts} are over {MAX_PART_HEADERS} bytes")

    def _header_field(self, buf: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        self.field += buf[start:end]

    def _header_value(self, buf: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        self.value += buf[start:end]

    def _header_end(self) -> None:
        self.headers[self.field.lower()] = self.value
        self.field, self.value = b"", b""

    def _headers_done(self) -> None:
        _, disposition = parse_options_header(self.headers.get(b"content-disposition", b""))
        part = disposition.get(b"name", b"").decode("utf-8", "replace")
        filename = disposition.get(b"filename")
        self.headers = {}
        if not filename:  # a form without a file sends filename="": a text field like any other
            self.text = (part, bytearray())
            return
        if part != "file":
            raise BadForm(f"no `file` field: the form sends a file in the field {part[:64]!r}; send the archive "
                          "as the field named file (curl -F file=@x.dduf URL)")
        if self.spool is not None:
            raise BadForm("the form sends more than one file; validate one archive per request")
        self.spool = _Spool(self.folder, display_name(filename.decode("utf-8", "replace")), self.limit, self.upload,
                            self.reserve)
        self.writing = True

    def _data(self, buf: bytes, start: int, end: int) -> None:
        if self.writing and self.spool is not None:
            self.spool.add(buf[start:end])
        elif self.text is not None:
            self.text[1].extend(buf[start:end])
            if len(self.text[1]) > MAX_FIELD:
                raise BadForm(f"form field {self.text[0][:64]!r} is over {MAX_FIELD} bytes")

    def _part_end(self) -> None:
        if self.text is not None:
            self.upload.fields[self.text[0]] = self.text[1].decode("utf-8", "replace")
        self.text, self.writing = None, False


async def spool_form(chunks: AsyncIterator[bytes], content_type: str, folder: Path, limit: int,
                     max_parts: int = 16, reserve: int = 0) -> Upload:
    """A ``multipart/form-data`` body: the part named ``file`` into a temporary file, short text fields kept."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadForm("multipart body without a boundary")
    upload = Upload()
    sink = _FormSink(folder, limit, upload, max_parts, reserve)
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
        if isinstance(e, (TooLarge, BadForm, NoSpace, SlowBody)) or not isinstance(e, Exception):
            raise
        raise BadForm(f"malformed multipart body: {e}") from None
    if sink.spool is not None and upload.size == 0:
        upload.discard()
        raise BadForm(f"the uploaded file {upload.name!r} is empty")
    return upload
