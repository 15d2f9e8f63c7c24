"""Typed errors. Every failure a user can cause is a :class:`DDUFError`; none of them leaks a raw
``zipfile``/``struct``/``json`` exception."""

from __future__ import annotations

import errno
import os
import reprlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .format.findings import Finding


class DDUFError(Exception):
    """Base class of every error dduf_plus raises for bad input or bad usage. ``code`` is the rule code
    (:mod:`dduf_plus.format.findings`, e.g. ``"D013"``) when a rule refused the input, else None; ``codes``
    lists it (a :class:`DDUFValidationError` lists every error's code)."""

    code: str | None = None

    def __init__(self, *args: object, code: str | None = None):
        super().__init__(*args)
        if code is not None:
            self.code = code

    @property
    def codes(self) -> list[str]:
        return [self.code] if self.code else []


class DDUFFormatError(DDUFError):
    """The archive is not a well-formed DDUF file (ZIP, DDUF or safetensors level)."""


class DDUFValidationError(DDUFFormatError):
    """Structural checks failed; ``findings`` holds every error with its stable rule code. ``kind`` says what
    ``source`` is in the message ("DDUF archive", or "pipeline folder" for a folder the loader reads)."""

    def __init__(self, source: str, findings: Sequence[Finding], *, kind: str = "DDUF archive"):
        self.source = source
        self.kind = kind
        self.findings = list(findings)
        errors = [f for f in self.findings if f.severity == "error"]
        shown = "\n".join(f"  {f}" for f in errors[:10])
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        super().__init__(f"{source} is not a valid {kind}:\n{shown}{more}", code=errors[0].code if errors else None)

    @property
    def codes(self) -> list[str]:
        return [f.code for f in self.findings if f.severity == "error"]


class DDUFPackError(DDUFError):
    """A source folder or pipeline cannot be written as DDUF (forbidden file, missing config, ...)."""


class DDUFEntryNotFoundError(DDUFError, KeyError):
    """An entry or component was asked for that the archive does not hold."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DDUFLoadError(DDUFError):
    """A component cannot be built (unknown class, missing library, missing file...)."""


class DDUFReferenceError(DDUFError):
    """An external component reference cannot be resolved or does not match its recorded content.
    ``mismatch`` is True when a copy was found but its content differs from the recorded hashes."""

    mismatch: bool = False


class DDUFIntegrityError(DDUFFormatError):
    """Entry bytes do not match their recorded CRC-32 or sha256."""


class DDUFUsageError(DDUFError):
    """The command line or call itself is wrong: a bad argument value, an output that exists without
    ``--force``, a URL scheme that is not allowed. The CLI exits 2."""


class DDUFIOError(DDUFError):
    """A file or URL cannot be opened or read: missing, unreachable, refused, an HTTP error status, no range
    support, or over its time or byte budget. The CLI exits 2."""


class DDUFNotFoundError(DDUFIOError, FileNotFoundError):
    """A path or URL that does not exist. Both a :class:`DDUFError` and a :class:`FileNotFoundError`, so
    ``except FileNotFoundError`` catches ``load_dduf("missing.dduf")`` as it would ``open("missing.dduf")``."""

    def __init__(self, message: str, filename: str | None = None):
        super().__init__(message)
        self.errno, self.strerror, self.filename = errno.ENOENT, os.strerror(errno.ENOENT), filename

    def __str__(self) -> str:  # OSError would print "[Errno 2] ..." once errno is set
        return str(self.args[0]) if self.args else ""


class DDUFPathError(DDUFError):
    """A write, rename, link or removal would reach outside the folder it belongs to (an output folder, one
    of dduf_plus' caches): refused whatever the archive says (see :mod:`dduf_plus.storage.confined`)."""


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80  # a user's 10**8-item list or 1 GB string: shown in part, never built whole
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def bounded_repr(value: object) -> str:
    """``repr(value)`` for a message, built in bounded time and memory whatever the value's size."""
    return _REPR.repr(value)


def path_argument(value: object, call: str) -> str:
    """``value`` as a ``str`` path (a ``str``, ``bytes`` or ``os.PathLike``, as ``open`` takes it); anything
    else is a :class:`DDUFUsageError` naming ``call`` (``"validate(source=...)"``): a user's ``validate(5)``
    gets a message about their argument, not ``AttributeError: 'int' object has no attribute 'name'``."""
    try:
        text = os.fsdecode(value)  # type: ignore[arg-type]  # anything else raises TypeError, answered below
    except TypeError:
        raise DDUFUsageError(f"{call}: expected a path (str or os.PathLike), got {type(value).__name__} "
                             f"{bounded_repr(value):.60}") from None
    if "\x00" in text:  # no file system takes it: open() would raise a bare ValueError ("embedded null byte")
        raise DDUFUsageError(f"{call}: the path {bounded_repr(text):.60} holds a NUL character")
    return text


def io_error(message: str, error: OSError, filename: str | os.PathLike | None = None) -> DDUFIOError:
    """The DDUFError for a failed open/read: :class:`DDUFNotFoundError` when the path does not exist."""
    if isinstance(error, FileNotFoundError):
        return DDUFNotFoundError(message, os.fspath(filename) if filename is not None else None)
    return DDUFIOError(message)
