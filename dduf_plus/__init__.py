"""dduf_plus: fast, safe, composable DDUF archives for diffusion pipelines.

The format layer (``dduf_plus.format``) is standard-library only; loading (``load_dduf``) imports torch
and diffusers when first used."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__

_LAZY = {
    "DDUFArchive": "dduf_plus.format.archive",
    "DDUFWriter": "dduf_plus.format.writer",
    "pack_folder": "dduf_plus.format.pack",
    "read_dduf_file": "dduf_plus.compat",
    "load_dduf": "dduf_plus.loading.pipeline",
    "save_dduf": "dduf_plus.loading.save",
    "inspect_dtypes": "dduf_plus.inspect",
    "validate": "dduf_plus.format.validate",
    "ValidationReport": "dduf_plus.format.validate",
    "DDUFError": "dduf_plus.errors",
    "DDUFFormatError": "dduf_plus.errors",
    "DDUFValidationError": "dduf_plus.errors",
    "DDUFPackError": "dduf_plus.errors",
    "DDUFLoadError": "dduf_plus.errors",
    "DDUFReferenceError": "dduf_plus.errors",
    "DDUFIntegrityError": "dduf_plus.errors",
    "DDUFEntryNotFoundError": "dduf_plus.errors",
    "DDUFNotFoundError": "dduf_plus.errors",
    "DDUFIOError": "dduf_plus.errors",
    "DDUFUsageError": "dduf_plus.errors",
    "DDUFPathError": "dduf_plus.errors",
}

if TYPE_CHECKING:  # pragma: no cover
    from .errors import (  # noqa: F401
        DDUFEntryNotFoundError,
        DDUFError,
        DDUFFormatError,
        DDUFIntegrityError,
        DDUFIOError,
        DDUFLoadError,
        DDUFNotFoundError,
        DDUFPackError,
        DDUFPathError,
        DDUFReferenceError,
        DDUFUsageError,
        DDUFValidationError,
    )
    from .format.archive import DDUFArchive  # noqa: F401
    from .format.pack import pack_folder  # noqa: F401
    from .format.writer import DDUFWriter  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dduf_plus' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = sorted(_LAZY) + ["__version__"]
