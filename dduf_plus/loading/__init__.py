"""Loading floor: DDUF archives into torch / diffusers / transformers objects.

Importing this package is cheap; torch and diffusers are imported by the modules that need them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# public name -> submodule that defines it
_LAZY: dict[str, str] = {
    "load_dduf": "pipeline",
    "ComponentFiles": "files",
    "ArchiveComponentFiles": "files",
    "FolderComponentFiles": "files",
    "install_bridge": "bridge",
    "remove_bridge": "bridge",
}

if TYPE_CHECKING:  # pragma: no cover
    # the same names as _LAZY (tests/test_api.py checks it); `X as X` is an explicit re-export
    from .bridge import install_bridge as install_bridge
    from .bridge import remove_bridge as remove_bridge
    from .files import ArchiveComponentFiles as ArchiveComponentFiles
    from .files import ComponentFiles as ComponentFiles
    from .files import FolderComponentFiles as FolderComponentFiles
    from .pipeline import load_dduf as load_dduf


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = sorted(_LAZY)
