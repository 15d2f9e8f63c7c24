"""Other libraries' import-time notices, kept off the user's screen while dduf_plus imports those libraries.

A first ``load_dduf`` in a fresh interpreter imports diffusers, which imports torchao: torchao logs the
compiled extensions it cannot load (``Failed to load ..._C_mxfp8...so``), torch's pytree warns about
torchao's Enum registrations, and diffusers says it cannot import torchao's tensor types. Five lines about
the libraries' build, none about the user's archive, printed by a call the user expected to be silent.

:func:`quiet_imports` wraps the steps of a load (or a pack) that import libraries: for its duration the
loggers in :data:`IMPORT_NOTICES` show errors only. It is scoped to be nothing more than that:

- a logger the user has given a level (``logging.getLogger("torchao").setLevel(logging.INFO)``) is left
  alone, and so are diffusers' loggers under ``DIFFUSERS_VERBOSITY``: what the user asked for is shown;
- the previous levels are back when the step ends (the outermost step, when several threads load at once);
- Python warnings, handlers and the root logger are not touched: the user's own filters and logging
  configuration stay as they were.

The CLI (:mod:`dduf_plus.cli.quiet`) goes further for a command's whole run; it uses the same logger list."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

# Loggers that print while a library is imported, through their own handler or Python's last resort, so
# nothing the user configured on the root logger would hold them back. Each one's children follow it.
IMPORT_NOTICES = (
    "torch.utils._pytree",  # "<enum ...> is an Enum subclass ..." (torchao's registrations)
    "torch._subclasses",
    "torchao",  # "Failed to load .../_C_mxfp8...so", "Detected no triton"
    "diffusers.quantizers",  # "Unable to import `torchao` Tensor objects ..."
    "sdnq",  # "SDNQ: OpenVINO MM kernels are not available! Falling back to ..." (an SDNQ archive's load)
)
USER_VERBOSITY = {"diffusers": "DIFFUSERS_VERBOSITY", "transformers": "TRANSFORMERS_VERBOSITY"}

_lock = threading.Lock()
_depth = 0
_changed: list[logging.Logger] = []  # the loggers the outermost step set, to set back to NOTSET
_shown = False  # show_import_notices() was called: quiet_imports changes nothing


def show_import_notices(show: bool = True) -> bool:
    """Let the import notices through from now on (the CLI's ``-v``: "everything other libraries say");
    returns the previous setting."""
    global _shown
    previous, _shown = _shown, show
    return previous


def _user_asked(name: str) -> bool:
    """The user configured this logger (a level of its own, or the library's verbosity variable)."""
    env = USER_VERBOSITY.get(name.split(".", 1)[0])
    return logging.getLogger(name).level != logging.NOTSET or bool(env and os.environ.get(env))


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Within the block, :data:`IMPORT_NOTICES` loggers the user has not configured show errors only."""
    global _depth
    with _lock:
        _depth += 1
        if _depth == 1 and not _shown:
            _changed.extend(logging.getLogger(n) for n in IMPORT_NOTICES if not _user_asked(n))
            _set_levels(_changed, logging.ERROR)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _set_levels([lg for lg in _changed if lg.level == logging.ERROR], logging.NOTSET)  # unless re-set
                _changed.clear()


def _set_levels(loggers: list[logging.Logger], level: int) -> None:
    """``setLevel`` on each, with one clearing of logging's level cache instead of one per logger: each
    clearing walks every logger of the process (800+ once diffusers and transformers are in), and a load
    enters :func:`quiet_imports` once per component (measured 0.7-0.9 ms per entry with ``setLevel`` each)."""
    for logger in loggers[:-1]:
        logger.level = level  # the public attribute setLevel assigns; the last setLevel clears the cache
    if loggers:
        loggers[-1].setLevel(level)


__all__ = ["IMPORT_NOTICES", "USER_VERBOSITY", "quiet_imports", "show_import_notices"]
