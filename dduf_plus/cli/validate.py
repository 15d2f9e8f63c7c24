"""``dduf validate FILE_OR_URL...``: check archives against every DDUF and dduf_plus rule.

Exit status: 0 every file is valid, 1 at least one is not, 2 usage or I/O errors (a file that is missing
or a URL that cannot be reached; those win over 1). Imports only the format layer (no torch; zstandard
only for ``.zst`` files), unless ``--load-check`` asks for the load check (torch and the components' libraries)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import textwrap
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ._common import budget_arg, echo, echo_error, int_arg, plural

if TYPE_CHECKING:  # pragma: no cover
    from ..format.findings import Finding
    from ..format.validate import ValidationReport

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
Catalogues: --from-file LIST (one path or URL a line, '-' for stdin; blank lines and # comments skipped)
validates them on --jobs N threads and, with --json-lines, prints one JSON object a line as each archive
finishes (the same object as one entry of --json's "files"); a source that cannot be read is a line with
"io_error" and the batch goes on. Python: dduf_plus.validate_many(sources, executor=...).
Severities: error (will not load, unsafe, or loads differently: invalid), warning (loads, but you must know;
--strict counts it as an error), info (a foreign or slower archive: no dduf_plus index, unaligned, no ZIP64;
never an error). --load-check also builds each model component on the meta device (torch; no weight is read)
and matches its tensors' names, shapes and dtypes to the stored headers (L001-L005).
Exit status: 0 all valid, 1 any invalid, 2 usage or I/O errors (docs/cli.md)."""


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "validate", help="validate archives (local paths or URLs) against every DDUF rule",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", metavar="FILE_OR_URL", help="archives to check (.dduf, or a local .dduf.zst)")
    parser.add_argument("--from-file", metavar="LIST", default=None,
                        help="also check every path or URL listed in LIST, one a line ('-': stdin); uses threads")
    parser.add_argument("--json-lines", action="store_true",
                        help="print one JSON object per archive, a line each, as each finishes")
    parser.add_argument("--json", action="store_true", help='print {"files": [{path, valid, errors, warnings, infos}]}')
    parser.add_argument("--verify", action="store_true", help="also check CRC-32 and sha256 of every entry (reads all data)")
    parser.add_argument("--strict", action="store_true", help="treat warnings as errors (infos stay infos)")
    parser.add_argument("--load-check", action="store_true",
                        help="also build each model on the meta device (imports torch; reads no weight) and match "
                             "its tensor names, shapes and dtypes to the stored ones (L001-L005)")
    parser.add_argument("-j", "--jobs", type=_jobs, default=1, metavar="N", help="validate N files in parallel (processes; threads with --from-file or --json-lines)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only invalid files and their errors")
    parser.add_argument("--max-decompressed", type=budget_arg, default=None, metavar="SIZE",
                        help="how far a .zst may expand: SIZE (64G), RATIOx (32x), both (64G,32x) or 'unlimited' "
                             "(default: $DDUF_PLUS_MAX_DECOMPRESSED, else 256G and 16x above 256M); over it: Z022")
    parser.set_defaults(func=run)
    return parser


_jobs = int_arg(1)


def check_one(path: str, verify: bool, strict: bool, max_decompressed: str | None = None,
              load_check: bool = False) -> ValidationReport:
    """The report on ``path`` (``io_error`` set when it could not be read). Runs in worker processes; the one
    place that turns a DDUFError into a report is :func:`dduf_plus.catalogue.validate_one`."""
    from ..catalogue import validate_one

    return validate_one(path, verify, strict, max_decompressed, load_check=load_check)


def _listed(name: str) -> Iterator[str]:
    """The sources listed in ``name`` ('-': stdin), read lazily: blank lines and ``#`` comments skipped. The
    file is opened now, so a missing list is a usage error before any work."""
    from ..errors import DDUFUsageError

    try:
        stream = sys.stdin if name == "-" else open(name, encoding="utf-8", errors="surrogateescape")  # noqa: SIM115
    except OSError as e:
        raise DDUFUsageError(f"--from-file {name}: cannot open: {e.strerror or e}") from None

    def lines() -> Iterator[str]:
        with stream if name != "-" else contextlib.nullcontext(stream):
            for line in stream:
                line = line.strip()
                if line and not line.startswith("#"):
                    yield line

    return lines()


def _catalogue(args: argparse.Namespace) -> Iterator[ValidationReport]:
    """--from-file / --json-lines: every source through validate_many on threads, as each finishes."""
    import itertools

    from ..catalogue import validate_many

    sources = itertools.chain(args.files, _listed(args.from_file) if args.from_file is not None else ())
    yield from validate_many(sources, verify=args.verify, strict=args.strict, max_workers=args.jobs,
                             max_decompressed=args.max_decompressed, ordered=bool(args.json),
                             load_check=args.load_check)


def _results(args: argparse.Namespace) -> Iterator[ValidationReport]:
    if args.from_file is not None or args.json_lines:
        yield from _catalogue(args)
        return
    jobs = min(args.jobs, len(args.files))
    if jobs <= 1:
        for path in args.files:
            yield check_one(path, args.verify, args.strict, args.max_decompressed, args.load_check)
        return
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        n = len(args.files)
        yield from pool.map(check_one, args.files, [args.verify] * n, [args.strict] * n, [args.max_decompressed] * n,
                            [args.load_check] * n)


def run(args: argparse.Namespace) -> int:
    from ..errors import DDUFUsageError

    if not args.files and args.from_file is None:
        raise DDUFUsageError("give at least one FILE_OR_URL, or --from-file LIST")
    if args.json and args.json_lines:
        raise DDUFUsageError("--json and --json-lines exclude each other")
    with _data_stdout(args.json or args.json_lines) as out:
        return _report_all(args, out)


def _report_all(args: argparse.Namespace, out: Any) -> int:
    """Validate every source, print each report to ``out`` as asked; the exit status (worst of all)."""
    from ..format.validate import REPORT_SCHEMA_VERSION

    status = EXIT_OK
    collected: list[dict[str, Any]] = []
    for report in _results(args):
        if report.io_error is not None:
            status = EXIT_IO
            echo_error("validate", report.io_error)
        elif not report.valid and status == EXIT_OK:
            status = EXIT_INVALID
        if args.json_lines:
            _line(report.as_dict(), out)
        elif args.json:
            collected.append(report.as_dict())
        elif report.io_error is None:
            _print_human(report, args.quiet, out)
    if args.json:
        doc = {"schema_version": REPORT_SCHEMA_VERSION, "files": collected}
        json.dump(doc, out, indent=2, ensure_ascii=True)  # \u escapes: inert on a terminal
        out.write("\n")
    out.flush()
    return status


@contextlib.contextmanager
def _data_stdout(machine: bool) -> Iterator[Any]:
    """Where the reports go. For ``--json`` / ``--json-lines``, stdout carries the JSON and nothing else: while
    the archives are checked, anything else written to stdout (a library's ``print`` in a model class the
    load check builds, a native library writing to file descriptor 1, worker processes) goes to stderr, and
    the JSON to the original stdout. The file descriptor is redirected only when stdout has one."""
    real = sys.stdout
    if not machine:
        yield real
        return
    import os

    try:
        fd, err_fd = real.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (an embedding, pytest's capture)
        with contextlib.redirect_stdout(sys.stderr):
            yield real
        return
    real.flush()
    saved = os.dup(fd)
    os.dup2(err_fd, fd)
    out = os.fdopen(saved, "w", encoding="utf-8", closefd=False)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield out
    finally:
        with contextlib.suppress(OSError):
            out.flush()
        os.dup2(saved, fd)
        os.close(saved)


def _line(report: dict[str, Any], out: Any) -> None:
    """One --json-lines record, flushed at once so a consumer sees each archive as it finishes."""
    out.write(json.dumps(report, ensure_ascii=True) + "\n")
    out.flush()


def _print_human(report: ValidationReport, quiet: bool, out: Any) -> None:
    """The verdict line (labels and counts from the table the serve page uses: findings.SEVERITIES), then the
    findings: errors, warnings, infos (``quiet``: invalid archives and their errors only)."""
    from ..format.findings import VERDICT_LABELS, count_text

    if report.valid and quiet:
        return
    counts = {"error": len(report.errors), "warning": len(report.warnings), "info": len(report.infos)}
    if quiet:
        counts = {"error": counts["error"]}
    tail = count_text(counts)
    echo(f"{VERDICT_LABELS[report.valid]:<8} {report.path}{f' ({tail})' if tail else ''}", file=out)
    _print_findings(list(report.errors if quiet else report.findings), out)


def _print_findings(findings: list[Finding], out: Any) -> None:
    """One line per finding, except that a rule found on several entries is one group: its message once and
    the entries listed (huggingface_hub's writer gets Z018 on every entry). JSON keeps every finding."""
    from ..format.findings import SEVERITIES, group_findings

    for group in group_findings(findings):
        label = SEVERITIES[group.severity].label if group.severity in SEVERITIES else group.severity
        if len(group.findings) == 1:
            f = group.findings[0]
            where = f" {f.entry}:" if f.entry else ""
            echo(f"  {label:<7} {f.code}{where} {f.message}", file=out)
            continue
        count = plural(len(group.entries), "entry", "entries") if group.entries else plural(len(group.findings), "time")
        echo(f"  {label:<7} {group.code} ({count}): {group.message}", file=out)
        if group.same_message:
            for line in textwrap.wrap(", ".join(group.entries), 100, break_long_words=False, break_on_hyphens=False):
                echo(f"          {line}", file=out)
        else:
            for f in group.findings:
                echo(f"          {f.entry + ': ' if f.entry else ''}{f.message}", file=out)
