"""The ``dduf`` command. Each sub-command lives in its own module with ``register(subparsers)``; only the
module of the command being run is imported, so ``dduf validate`` / ``dduf info`` never import torch.

Exit status, the same for every command (docs/cli.md):
    0   success (validate: every file valid; refs: every reference resolves here or can be downloaded)
    1   the input was read and is refused, or the work failed on it: an invalid archive, a folder that
        cannot be packed, an unresolved reference, a component that cannot be converted
    2   usage or I/O: bad arguments, a path or URL that does not exist or cannot be opened, read or
        reached (or is over its time/byte budget), an output that exists without --force or cannot be
        written
    130 interrupted (Ctrl-C)"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ..errors import DDUFError, DDUFIOError, DDUFUsageError
from ._common import PrintedOnce, SafeFormatter, echo_error, os_error_text
from .quiet import quiet_other_libraries
from .suggest import SuggestingParser, command_parser

# name -> (module, one-line help)
COMMANDS = {
    "pack": ("pack", "pack a diffusers pipeline folder into a .dduf archive"),
    "unpack": ("unpack", "unpack an archive into a diffusers folder"),
    "info": ("info", "show components, dtypes, sizes and references of an archive or folder"),
    "validate": ("validate", "validate archives (local paths or URLs) against every DDUF rule"),
    "refs": ("refs", "list an archive's external references and where each resolves"),
    "complete": ("complete", "pull referenced components into a self-contained archive"),
    "export": ("export", "write an archive as the single .safetensors file apps load"),
    "compress": ("compress", "zstd-compress an archive for transport"),
    "decompress": ("decompress", "decompress a .dduf.zst archive"),
    "serve": ("serve", "serve validation over HTTP (API, page, Hub webhook; extra 'serve')"),
}

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_IO = EXIT_USAGE  # usage and I/O errors share 2: "the command could not do its work on this input"


def exit_code(error: BaseException) -> int:
    """The exit status for an error that ended a command (see the module docstring)."""
    if isinstance(error, (DDUFUsageError, DDUFIOError, OSError)):
        return EXIT_USAGE
    return EXIT_INVALID


def build_parser(command: str | None) -> argparse.ArgumentParser:
    from .._version import __version__

    parser = SuggestingParser(prog="dduf", description="Fast, safe, composable DDUF archives.")
    parser.add_argument("--version", action="version", version=f"dduf_plus {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if name == command:
            importlib.import_module(f"{__name__}.{module}").register(subparsers)
        else:
            subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # said by the command's own parser: its usage and `dduf pack: error: ...`, not the top level's
            (command_parser(parser, args.command) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # argparse: 2 on usage errors, 0 for --help
        return int(e.code or 0)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    level = logging.WARNING - 10 * min(args.verbose, 2)
    if not getattr(args, "quiet", False):
        level = min(level, logging.INFO)
    handler = logging.StreamHandler()
    handler.setFormatter(SafeFormatter("%(message)s"))  # log messages quote archive content
    handler.addFilter(PrintedOnce())  # a library printing its own records: once, not twice
    quiet_other_libraries(handler, args.verbose)  # other libraries' notices: only with -v
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("dduf_plus").setLevel(level)
    for stream in (sys.stdout, sys.stderr):  # a name the terminal's encoding lacks is escaped, not a crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `dduf info --json | head`
        sys.stderr.close()
        return 0
    except DDUFError as e:
        echo_error(args.command, e)
        return exit_code(e)
    except OSError as e:  # writing an output: disk full, permission denied, a path component that is a file
        echo_error(args.command, os_error_text(e, getattr(args, "output", None)))
        return exit_code(e)
    except KeyboardInterrupt:
        print(f"dduf {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
