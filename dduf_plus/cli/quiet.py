"""What other libraries print during a command: nothing, unless the user asks for it with ``-v``.

Importing torchao logs the compiled extensions it cannot load (``Failed to load ..._C_mxfp8...so``) and
makes torch's pytree warn about its Enum registrations; diffusers says it cannot import torchao's tensor
types and that it overrides ``torch_dtype``; bitsandbytes logs its kernel lookups, sdnq its missing OpenVINO
kernels; libraries raise FutureWarnings about their own APIs. None of it is about the user's archive, and
every line of it made a clean ``dduf pack --quantize`` look broken. A command therefore shows dduf_plus's own
records and warnings, other libraries' errors only, and all of it again with ``-v``."""

from __future__ import annotations

import logging
import os
import warnings

from ..torchkit.quiet import IMPORT_NOTICES, show_import_notices

# Loggers that print through their own handler or are configured at import, so a filter on the CLI's root
# handler does not reach them: their level is set before the library is imported (their import keeps it).
# The same loggers load_dduf holds back while it imports libraries (torchkit.quiet), for the whole command here.
OWN_HANDLERS = IMPORT_NOTICES
# diffusers and transformers read these when they configure their loggers (a user's own setting wins).
VERBOSITY_ENV = ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY")


# Whose warnings a command still shows: ours, and huggingface_hub's, which are about the user's own request
# (a retry of a download, a token) rather than about a library's build.
SHOWN = ("dduf_plus", "huggingface_hub")


class OwnRecordsOnly(logging.Filter):
    """For the CLI's root handler: dduf_plus's and huggingface_hub's records, other libraries' errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".", 1)[0] in SHOWN or record.levelno >= logging.ERROR


def quiet_other_libraries(handler: logging.Handler, verbose: int) -> None:
    """Keep other libraries' notices off stderr for this command, unless ``verbose`` (``-v``) asks for them."""
    show_import_notices(bool(verbose))  # -v: not even a load's or a pack's imports are quieted (each run says)
    if verbose:
        return
    handler.addFilter(OwnRecordsOnly())
    for name in OWN_HANDLERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for name in VERBOSITY_ENV:
        os.environ.setdefault(name, "error")
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=r"dduf_plus(\.|$)")
