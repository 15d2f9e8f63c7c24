"""Loading floor: DDUF archives into torch / diffusers / transformers objects.

Importing this package is cheap; torch and diffusers are imported by the modules that need them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_LAZY = {
    "load_dduf": "pipeline",
    "ComponentFiles": "files",
    "ArchiveComponentFiles": "files",
    "FolderComponentFiles": "files",
    "install_bridge": "bridge",
    "remove_bridge": "bridge",
}

if TYPE_CHECKING:  # pragma: no cover
    from .bridge import install_bridge, remove_bridge  # noqa: F401
    from .files import ArchiveComponentFiles, ComponentFiles, FolderComponentFiles  # noqa: F401
    from .pipeline import load_dduf  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_LAZY)
