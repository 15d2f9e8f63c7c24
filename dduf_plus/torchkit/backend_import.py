"""Libraries a load imports are imported with the Hugging Face Hub off, unless the user allows it.

Importing a library can make requests: bitsandbytes, on a CPU with AVX512-BF16, downloads a CPU kernel
(``kernels.get_kernel("kernels-community/quantization-bitsandbytes")``, in ``bitsandbytes/backends/cpu/ops.py``)
as it is imported, and diffusers imports bitsandbytes and torchao when its models are imported. A load of a
local archive, or one with ``local_files_only=True``, made a request to the Hub that way (and the first online
``load_dduf(URL)`` in a process waited 9.4 s for it). A load makes no request the user did not ask for, so
the steps of a load that import libraries (the pipeline's module with diffusers and transformers, a
quantization backend: bitsandbytes, torchao, sdnq, optimum-quanto, and whatever they import meanwhile) run
with huggingface_hub offline *in the loading thread*: ``huggingface_hub.constants.is_offline_mode()``, which
every Hub request checks first (its request hook), answers True there, so the request is refused before it
is sent; the library falls back as it does offline (bitsandbytes logs that it could not load the kernel and
uses its own CPU code). Other threads are not affected: the function is a thread-aware dispatcher, in place
over huggingface_hub's own while some thread is in such a step (see :mod:`dduf_plus.torchkit.empty_init` for
the rule), that answers as huggingface_hub does outside these steps.

**The knob.** ``DDUF_PLUS_BACKEND_DOWNLOADS=1`` (read at each load) lets those imports use the Hub as
huggingface_hub's own settings allow (``HF_HUB_OFFLINE`` still wins). Importing the library yourself before
loading does the same for that library: a module already imported is not imported again.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from .empty_init import Dispatcher, installed_while
from .quiet import quiet_imports

ENV_ALLOW = "DDUF_PLUS_BACKEND_DOWNLOADS"
TRUE = ("1", "true", "yes", "on")

_local = threading.local()  # .depth: how deep this thread is in import steps with the Hub off
_dispatchers: list[Dispatcher] = []


def downloads_allowed() -> bool:
    """Whether the user lets imported libraries use the Hub (``DDUF_PLUS_BACKEND_DOWNLOADS``)."""
    return os.environ.get(ENV_ALLOW, "").strip().lower() in TRUE


def _dispatching_offline(original: Callable[[], bool]) -> Callable[[], bool]:
    def is_offline_mode() -> bool:
        return True if getattr(_local, "depth", 0) else original()

    return is_offline_mode


def _offline_dispatchers() -> list[Dispatcher]:
    if not _dispatchers:
        from huggingface_hub import constants

        _dispatchers.append(Dispatcher(constants, "is_offline_mode", ("huggingface_hub.constants", "is_offline_mode"),
                                       _dispatching_offline))
    return _dispatchers


@contextlib.contextmanager
def hub_off_for_imports() -> Iterator[None]:
    """Within the block, Hub requests made from this thread are refused (unless :func:`downloads_allowed`):
    wrap the steps of a load that import libraries."""
    if downloads_allowed():
        with quiet_imports():  # their import-time notices are not the user's concern (torchkit.quiet)
            yield
        return
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        with installed_while("hub_off", _offline_dispatchers()), quiet_imports():
            yield
    finally:
        _local.depth -= 1


def import_backend(name: str) -> ModuleType:
    """``importlib.import_module(name)`` with the Hub off (see the module): for quantization backends."""
    with hub_off_for_imports():
        return importlib.import_module(name)


def offline_imports(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` runs within :func:`hub_off_for_imports` (a step that imports libraries)."""
    import functools

    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with hub_off_for_imports():
            return function(*args, **kwargs)

    return wrapped


__all__ = ["ENV_ALLOW", "downloads_allowed", "hub_off_for_imports", "import_backend", "offline_imports"]
