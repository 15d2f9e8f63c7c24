"""Other libraries' import-time notices, kept off the user's screen while dduf_plus imports those libraries.

A first ``load_dduf`` in a fresh interpreter imports diffusers, which imports torchao: torchao logs the
compiled extensions it cannot load (``Failed to load ..._C_mxfp8...so``), torch's pytree warns about
torchao's Enum registrations, and diffusers says it cannot import torchao's tensor types. Five lines about
the libraries' build, none about the user's archive, printed by a call the user expected to be silent.

:func:`quiet_imports` wraps the steps of a load (or a pack) that import libraries: for its duration the
loggers in :data:`IMPORT_NOTICES` show that thread's errors only. It is scoped to be nothing more than that:

- a logger the user has given a level (``logging.getLogger("torchao").setLevel(logging.INFO)``) is left
  alone, and so are diffusers' loggers under ``DIFFUSERS_VERBOSITY``: what the user asked for is shown;
- only the importing thread's records are dropped, and only until the step ends (a filter, no level set);
- Python warnings, handlers and the root logger are not touched: the user's own filters and logging
  configuration stay as they were.

The CLI (:mod:`dduf_plus.cli.quiet`) goes further for a command's whole run; it uses the same logger list."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

# The loggers that print while a library is imported, through their own handler or Python's last resort, so
# nothing the user configured on the root logger would hold them back. Exact names: a logger's filter sees the
# records created on it, not its children's.
IMPORT_NOTICES = (
    "torch.utils._pytree",  # "<enum ...> is an Enum subclass ..." (torchao's registrations)
    "torch._subclasses",
    "torchao",  # "Failed to load .../_C_mxfp8...so"
    "torchao.kernel.intmm",  # "Detected no triton ..."
    "diffusers.quantizers.torchao.torchao_quantizer",  # "Unable to import `torchao` Tensor objects ..."
    # "SDNQ: OpenVINO MM kernels are not available! Falling back to ..." (an SDNQ archive's load), on the logger
    # SDNQ names after SDNQ_LOGGER_NAME
    os.environ.get("SDNQ_LOGGER_NAME") or "sdnq",
)
USER_VERBOSITY = {"diffusers": "DIFFUSERS_VERBOSITY", "transformers": "TRANSFORMERS_VERBOSITY"}

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


class ImportNotices(logging.Filter):
    """Drops the records below ERROR that one thread's imports create; other threads' records pass."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.thread != self.thread


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Within the block, this thread's records below ERROR on the :data:`IMPORT_NOTICES` loggers the user has
    not configured are dropped. A filter per entry (no logger's level changes, so logging's level cache is
    never cleared: ~13 us per entry, where setting levels cost 0.15-0.9 ms on 800+ loggers; a load enters
    once per component)."""
    if _shown:
        yield
        return
    notice = ImportNotices()
    loggers = [logging.getLogger(n) for n in IMPORT_NOTICES if not _user_asked(n)]
    for logger in loggers:
        logger.addFilter(notice)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(notice)


__all__ = ["IMPORT_NOTICES", "USER_VERBOSITY", "ImportNotices", "quiet_imports", "show_import_notices"]
