"""Typed errors. Every failure a user can cause is a :class:`DDUFError`; none of them leaks a raw
``zipfile``/``struct``/``json`` exception."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .format.findings import Finding


class DDUFError(Exception):
    """Base class of every error dduf_plus raises for bad input or bad usage."""


class DDUFFormatError(DDUFError):
    """The archive is not a well-formed DDUF file (ZIP, DDUF or safetensors level)."""


class DDUFValidationError(DDUFFormatError):
    """Structural checks failed; ``findings`` holds every error with its stable rule code."""

    def __init__(self, source: str, findings: Sequence[Finding]):
        self.source = source
        self.findings = list(findings)
        errors = [f for f in self.findings if f.severity == "error"]
        shown = "\n".join(f"  {f}" for f in errors[:10])
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        super().__init__(f"{source} is not a valid DDUF archive:\n{shown}{more}")

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
    """An external component reference cannot be resolved or does not match its recorded content."""


class DDUFIntegrityError(DDUFFormatError):
    """Entry bytes do not match their recorded CRC-32 or sha256."""
