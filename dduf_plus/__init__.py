"""dduf_plus: fast, safe, composable DDUF archives for diffusion pipelines.

The format layer (``dduf_plus.format``) imports no torch; loading (``load_dduf``) imports torch and diffusers
when first used. Every public name is imported lazily, on first attribute access, from the module in ``_LAZY``;
the ``TYPE_CHECKING`` block below names the same objects for type checkers (tests/test_api.py checks that the
two, and ``__all__``, agree)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "DDUFArchive": "dduf_plus.format.archive",
    "DDUFWriter": "dduf_plus.format.writer",
    "pack": "dduf_plus.packing",
    "pack_folder": "dduf_plus.format.pack",
    "read_dduf_file": "dduf_plus.compat",
    "load_dduf": "dduf_plus.loading.pipeline",
    "save_dduf": "dduf_plus.packing.save",
    "inspect_dtypes": "dduf_plus.inspection",
    "validate": "dduf_plus.catalogue",  # the format floor's validate, plus the opt-in load check
    "ValidationReport": "dduf_plus.format.validate",
    "validate_many": "dduf_plus.catalogue",
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
    # `X as X`: an explicit re-export, for checkers that do not count a plain import in a py.typed package
    from .catalogue import validate as validate
    from .catalogue import validate_many as validate_many
    from .compat import read_dduf_file as read_dduf_file
    from .errors import DDUFEntryNotFoundError as DDUFEntryNotFoundError
    from .errors import DDUFError as DDUFError
    from .errors import DDUFFormatError as DDUFFormatError
    from .errors import DDUFIntegrityError as DDUFIntegrityError
    from .errors import DDUFIOError as DDUFIOError
    from .errors import DDUFLoadError as DDUFLoadError
    from .errors import DDUFNotFoundError as DDUFNotFoundError
    from .errors import DDUFPackError as DDUFPackError
    from .errors import DDUFPathError as DDUFPathError
    from .errors import DDUFReferenceError as DDUFReferenceError
    from .errors import DDUFUsageError as DDUFUsageError
    from .errors import DDUFValidationError as DDUFValidationError
    from .format.archive import DDUFArchive as DDUFArchive
    from .format.pack import pack_folder as pack_folder
    from .format.validate import ValidationReport as ValidationReport
    from .format.writer import DDUFWriter as DDUFWriter
    from .inspection import inspect_dtypes as inspect_dtypes
    from .loading.pipeline import load_dduf as load_dduf
    from .packing import pack as pack
    from .packing.save import save_dduf as save_dduf


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dduf_plus' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = sorted(_LAZY) + ["__version__"]
