"""``dduf validate FILE_OR_URL...``: check archives against every DDUF and dduf_plus rule.

Exit status: 0 every file is valid, 1 at least one is not, 2 usage or I/O errors (a file that is missing
or a URL that cannot be reached; those win over 1). Imports only the format layer (no torch; zstandard
only for ``.zst`` files)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ._common import budget_arg, echo, echo_error

EXIT_OK, EXIT_INVALID, EXIT_IO = 0, 1, 2  # the table of every command: docs/cli.md

DESCRIPTION = """\
Validate DDUF archives: ZIP integrity (end records, ZIP64, central directory vs local headers, overlaps,
polyglots, names), DDUF structure, every safetensors header, configs, references and the dduf_plus index.
Structural checks read only records and headers (kilobytes, also for URLs); --verify also hashes every
entry (CRC-32 and sha256). FILE_OR_URL may be a local path or a URL (https, http, hf, s3, gs, gcs, az, abfs,
abfss; no fsspec chains, no local:// or memory://). A URL has a deadline (DDUF_REMOTE_DEADLINE, 300 s) and a byte
budget (DDUF_REMOTE_MAX_BYTES, default twice its size + 16 MiB); redirects stay on the same origin.
A local X.dduf.zst is decompressed into a private temporary file (checksums verified, within
--max-decompressed; removed after the verdict) and the archive inside validated; a stream that cannot be
decompressed is reported as Z021, one over the budget or the free disk space as Z022.
Exit status: 0 all valid, 1 any invalid, 2 usage or I/O errors (docs/cli.md)."""


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "validate", help="validate archives (local paths or URLs) against every DDUF rule",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", metavar="FILE_OR_URL", help="archives to check (.dduf, or a local .dduf.zst)")
    parser.add_argument("--json", action="store_true", help='print {"files": [{path, valid, errors, warnings}]}')
    parser.add_argument("--verify", action="store_true", help="also check CRC-32 and sha256 of every entry (reads all data)")
    parser.add_argument("--strict", action="store_true", help="treat warnings (e.g. not mmap-aligned) as errors")
    parser.add_argument("-j", "--jobs", type=_jobs, default=1, metavar="N", help="validate N files in parallel processes")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only invalid files and their errors")
    parser.add_argument("--max-decompressed", type=budget_arg, default=None, metavar="SIZE",
                        help="how far a .zst may expand: SIZE (64G), RATIOx (32x), both (64G,32x) or 'unlimited' "
                             "(default: $DDUF_PLUS_MAX_DECOMPRESSED, else 256G and 16x above 256M); over it: Z022")
    parser.set_defaults(func=run)
    return parser


def _jobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def check_one(path: str, verify: bool, strict: bool,
              max_decompressed: str | None = None) -> tuple[str, dict[str, Any] | None, str | None]:
    """(path, report as a dict, None) or (path, None, why it could not be read). Runs in worker processes."""
    from ..errors import DDUFError
    from ..format.validate import validate

    try:
        return path, validate(path, verify=verify, strict=strict, max_decompressed=max_decompressed).as_dict(), None
    except DDUFError as e:
        return path, None, str(e)
    except Exception as e:  # noqa: BLE001 - validate() catches its own bugs; this is a last line
        return path, None, f"internal error: {type(e).__name__}: {e}"


def _results(args: argparse.Namespace):
    jobs = min(args.jobs, len(args.files))
    if jobs <= 1:
        for path in args.files:
            yield check_one(path, args.verify, args.strict, args.max_decompressed)
        return
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        n = len(args.files)
        yield from pool.map(check_one, args.files, [args.verify] * n, [args.strict] * n, [args.max_decompressed] * n)


def run(args: argparse.Namespace) -> int:
    status = EXIT_OK
    out = sys.stdout
    collected: list[dict[str, Any]] = []
    for path, report, io_error in _results(args):
        if io_error is not None:
            status = EXIT_IO
            echo_error("validate", io_error)
            collected.append({"path": path, "valid": False, "errors": [], "warnings": [], "io_error": io_error})
            continue
        assert report is not None
        if not report["valid"] and status == EXIT_OK:
            status = EXIT_INVALID
        if args.json:
            collected.append(report)
        else:
            _print_human(report, args.quiet, out)
    if args.json:
        json.dump({"files": collected}, out, indent=2, ensure_ascii=True)  # \u escapes: inert on a terminal
        out.write("\n")
    out.flush()
    return status


def _print_human(report: dict[str, Any], quiet: bool, out: Any) -> None:
    errors, warnings = report["errors"], report["warnings"]
    if report["valid"]:
        if quiet:
            return
        tail = f" ({len(warnings)} warning{'s' * (len(warnings) != 1)})" if warnings else ""
        echo(f"OK       {report['path']}{tail}", file=out)
    else:
        tail = f"{len(errors)} error{'s' * (len(errors) != 1)}"
        if warnings and not quiet:
            tail += f", {len(warnings)} warning{'s' * (len(warnings) != 1)}"
        echo(f"INVALID  {report['path']} ({tail})", file=out)
    rows = [("error", f) for f in errors] + ([] if quiet else [("warning", f) for f in warnings])
    for severity, f in rows:
        where = f" {f['entry']}:" if f["entry"] else ""
        echo(f"  {severity:<7} {f['code']}{where} {f['message']}", file=out)
