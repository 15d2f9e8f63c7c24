"""Small helpers shared by CLI commands: terminal-safe output, output and path checks, sizes.

Everything a command prints for humans goes through :func:`echo` (or :func:`printable`): class names,
entry names, reference sources and finding messages come from the archive, and an archive must not be
able to retitle, clear or rewrite the user's terminal. JSON output goes through :func:`print_json`
(``ensure_ascii``: every non-ASCII character is a ``\\u`` escape, so it is inert on a terminal too)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ..errors import DDUFError, DDUFIOError, DDUFNotFoundError, DDUFUsageError
from ..sizes import format_size, parse_size

T = TypeVar("T")

_SHORT_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(ch: str) -> str:
    if ch in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def printable(value: object, *, newlines: bool = False) -> str:
    """``value`` as text that is inert on a terminal: every character that is not printable (C0 and C1
    controls such as ESC, BEL, CR, DEL and the one-character CSI U+009B, bidi overrides such as U+202E and
    other format characters, line/paragraph separators, lone surrogates) becomes a Python-style escape
    (``\\x1b``, ``\\u202e``). With ``newlines`` a ``\\n`` stays a line break (multi-line messages).

    Example:
        >>> printable("Evil\\x1b]0;pwned\\x07Pipe")
        'Evil\\\\x1b]0;pwned\\\\x07Pipe'
    """
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():  # the common case, one C-level pass
        return text
    return "".join(ch if ch.isprintable() or (newlines and ch == "\n") else _escape(ch) for ch in text)


def echo(text: object = "", *, file: Any = None) -> None:
    """Print one line of human-readable output, escaped by :func:`printable` (an embedded newline too)."""
    print(printable(text), file=file if file is not None else sys.stdout)


def echo_error(command: str, message: object) -> None:
    """``dduf COMMAND: error: MESSAGE`` on stderr; the message keeps its line breaks, nothing else raw. A
    validation error lists its findings grouped by rule (a rule broken by every entry is one line)."""
    from ..errors import DDUFValidationError

    if isinstance(message, DDUFValidationError):
        message = validation_text(message)
    print(printable(f"dduf {command}: error: {message}", newlines=True), file=sys.stderr)


def validation_text(error: Any) -> str:
    """``SOURCE is not a valid DDUF archive:`` (or its ``kind``) and its errors, one line per rule: ``CODE [entry]: message``
    for a single finding, ``CODE (N entries): message`` and the entries for a rule found on several."""
    from ..format.findings import group_findings

    lines = [f"{error.source} is not a valid {getattr(error, 'kind', 'DDUF archive')}:"]
    groups = group_findings(f for f in error.findings if f.severity == "error")
    for group in groups[:10]:
        if len(group.findings) == 1:
            lines.append(f"  {group.findings[0]}")
            continue
        lines.append(f"  {group.code} ({plural(len(group.entries), 'entry', 'entries') if group.entries else plural(len(group.findings), 'time')}): {group.message}")
        if group.entries:
            shown = ", ".join(group.entries[:8]) + (f", ... ({len(group.entries) - 8} more)" if len(group.entries) > 8 else "")
            lines.append(f"    {shown}")
    if len(groups) > 10:
        lines.append(f"  ... and {len(groups) - 10} more rules")
    return "\n".join(lines)


class SafeFormatter(logging.Formatter):
    """Log records, escaped like :func:`printable` (line breaks kept): messages quote archive content."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record), newlines=True)


class PrintedOnce(logging.Filter):
    """For the CLI's root handler: a record that a library's own handler has already printed is not printed
    again. huggingface_hub (and transformers, diffusers) add a stderr handler to their root logger and still
    propagate, so each of their lines (huggingface_hub's "Retrying in 1s") came out twice. The library's
    handler is given :class:`SafeFormatter` when first seen, so its lines are escaped like ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None and logger is not logging.root:
            if logger.handlers:
                for handler in logger.handlers:
                    if not isinstance(handler.formatter, SafeFormatter):
                        handler.setFormatter(SafeFormatter("%(message)s"))
                return False
            if not logger.propagate:
                break
            logger = logger.parent
        return True


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=False, ensure_ascii=True)
    sys.stdout.write("\n")


def human_bytes(n: float) -> str:
    """Decimal units, the one convention of every command's output (:func:`dduf_plus.sizes.format_size`)."""
    return format_size(n)


def size_arg(text: str) -> int:
    """An argparse ``type`` for a size flag (``256M``, ``1G``, ``1048576``): :func:`dduf_plus.sizes.parse_size`."""
    size = parse_size(text)
    if size is None:
        raise argparse.ArgumentTypeError(f"not a size: {text.strip()!r} (e.g. 256M)")
    return size


def int_arg(low: int, high: int | None = None, *, what: str = "an integer",
            out_of_range: str = "{value}: at least {low}") -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high`` (None: no upper end), checked before any work;
    ``out_of_range`` (formatted with ``value``, ``low``, ``high``) says why a number is refused, ``what`` what a
    text that is no integer is not."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(out_of_range.format(value=value, low=low, high=high))
        return value

    return parse


def human_rate(n: float, seconds: float) -> str:
    """``n`` bytes in ``seconds`` as a decimal rate (``32.10 MB/s``); ``-`` for no time."""
    return f"{human_bytes(n / seconds)}/s" if seconds > 0 else "-"


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 file``, ``2 files``, ``0 files`` (``words``: an irregular plural)."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


def human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


# --- arguments ------------------------------------------------------------------------------------------


def as_usage(call: Callable[[], T]) -> T:
    """Run an argument parser; its DDUFError is a usage error (exit 2), whatever its class."""
    try:
        return call()
    except DDUFUsageError:
        raise
    except DDUFError as e:
        raise DDUFUsageError(str(e)) from None


def output_file(path: str | os.PathLike, force: bool, name: str | None = None) -> Path:
    """The one rule for commands that write a file, as ``cp``'s: an existing file is replaced only with
    ``--force``; a folder is never a file's output, but a trailing slash names the folder to write ``name``
    into (``-o out/``); the folder must exist (none is created)."""
    text = os.fspath(path)
    if text.endswith(("/", os.sep)):
        folder = Path(text)
        if not folder.is_dir():
            raise DDUFNotFoundError(f"cannot write into {text}: no such folder", text)
        if name is None:
            raise DDUFUsageError(f"{text} is a folder; give the file to write")
        text = os.path.join(text, name)
    out = Path(text)
    if out.is_dir():
        raise DDUFUsageError(f"{out} is a folder; give the file to write (e.g. {out / (name or 'NAME.dduf')}, "
                             f"or {out}/ to write {name or 'it'} inside)")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise DDUFNotFoundError(f"cannot write {out}: {'no such folder' if not parent.exists() else 'not a folder:'} "
                                f"{parent}", str(parent))
    if (out.exists() or out.is_symlink()) and not force:
        raise DDUFUsageError(f"{out} exists (use --force to overwrite)")
    return out


# errors only a write gives: with no file name on them, the command's output is the file that failed
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def os_error_text(error: OSError, output: str | os.PathLike | None) -> str:
    """One line for an OSError that ended a command, naming what the user gave: ``cannot write OUT: Read-only
    file system``. The atomic writers fail first on their temporary file (``.OUT.x1y2z3.tmp`` beside OUT), a
    name the user never typed; docs/cli.md promises the output given instead. A file inside an output folder
    (``unpack -o DIR``) is named as it is; any other path (an input) as ``PATH: reason``, as coreutils say it."""
    reason = error.strerror or str(error)
    if not error.filename:  # os.write() on a descriptor names no file: disk full is the output's
        if output is None or error.errno not in WRITE_ERRNOS:
            return reason
        given = os.fspath(output)
        return f"cannot write {'into ' if given.endswith(('/', os.sep)) else ''}{given}: {reason}"
    failed = Path(os.fsdecode(error.filename))
    if output is None:
        return f"{failed}: {reason}"
    given = os.fspath(output)
    out = Path(given).absolute()
    where = failed.absolute()
    if where.parent == out.parent and where.name.startswith(f".{out.name}.") and where.name.endswith(".tmp"):
        return f"cannot write {given}: {reason}"  # the temporary file of OUT
    if given.endswith(("/", os.sep)) and where.parent == out and where.name.startswith(".") \
            and where.name.endswith(".tmp"):
        return f"cannot write into {given}: {reason}"  # -o DIR/: the temporary file of DIR/NAME
    if where == out or out in where.parents:
        return f"cannot write {failed}: {reason}"
    return f"{failed}: {reason}"


def check_archive_name(output: Path) -> None:
    """An archive's output name. ``.zst`` is refused (exit 2, before any work): these commands write a plain
    archive, which ``dduf validate`` and ``load_dduf`` would then try to decompress (Z021). Another name
    (``-o model``, ``-o model.zip``) is a warning: the archive is valid, but a Hub repo's archive is found by
    its ``.dduf`` name (``load_dduf("org/repo")`` lists only those; ``dduf_file="model"`` is refused)."""
    name = output.name
    if name.endswith(".dduf"):
        return
    stem = name.removesuffix(".zst").removesuffix(".dduf").removesuffix(".zip")
    suggested = output.with_name(f"{stem}.dduf")
    if name.endswith(".zst"):
        raise DDUFUsageError(f"{output}: this writes a plain archive, not a .zst; write {suggested}, then "
                             f"`dduf compress {suggested}` makes {suggested}.zst")
    logging.getLogger("dduf_plus.cli").warning(
        "%s does not end in .dduf: the archive is valid, but load_dduf('org/repo') and dduf_file= find a Hub "
        "repo's archive by that name; consider -o %s", output, suggested)


def output_folder(path: str | os.PathLike) -> Path:
    """Commands that write a folder (unpack): the target may exist, but only as a folder; its parent must
    exist (as ``mkdir`` without ``-p``)."""
    out = Path(path)
    if (out.exists() or out.is_symlink()) and not out.is_dir():
        raise DDUFUsageError(f"{out} exists and is not a folder; give a folder to unpack into")
    parent = out.absolute().parent
    if not out.is_dir() and not parent.is_dir():
        raise DDUFNotFoundError(f"cannot create {out}: no such folder {parent}", str(parent))
    return out


def input_file(path: str | os.PathLike) -> Path:
    """A local input file that must exist (compress, decompress): missing or a folder is an I/O error."""
    source = Path(path)
    if not source.exists():
        raise DDUFNotFoundError(f"cannot open {source}: No such file or directory", str(source))
    if source.is_dir():
        raise DDUFIOError(f"cannot open {source}: not a regular file (a folder)")
    return source


def input_folder(path: str | os.PathLike, what: str = "SRC") -> Path:
    folder = Path(path)
    if not folder.exists():
        raise DDUFNotFoundError(f"{what} {folder} does not exist", str(folder))
    if not folder.is_dir():
        raise DDUFUsageError(f"{what} {folder} is not a folder (a diffusers pipeline folder with model_index.json)")
    return folder


def path_like_missing(spec: str, what: str) -> None:
    """A source argument (``--base``, ``--ref``) that looks like a path but does not exist: say so, instead
    of taking it for a Hub repo id. Path-looking: starts with ``/``, ``.`` or ``~``, ends with ``.dduf``, or
    its first folder exists here. ``:SUBFOLDER`` and ``@REVISION`` suffixes are not part of the path."""
    from ..refs.resolve import parse_spec  # torch-free

    text = spec.strip()
    try:
        parsed = parse_spec(text)
    except DDUFError:
        parsed = None
    if parsed is not None and parsed.kind in ("folder", "dduf"):
        if not os.path.exists(parsed.location):
            raise DDUFNotFoundError(f"{what} {text}: {parsed.location} does not exist", parsed.location)
        return
    head = text.split("@", 1)[0].split(":", 1)[0]
    first = head.split("/", 1)[0]
    if "/" in head and first and os.path.isdir(first) and not os.path.exists(head):
        from ..remote.hub import is_repo_id

        hint = f" (to mean the Hub repo {head}, run from a folder without ./{first})" if is_repo_id(head) else ""
        raise DDUFNotFoundError(f"{what} {text}: {os.path.abspath(head)} does not exist{hint}", head)


@contextlib.contextmanager
def plain_archive(source: str, max_decompressed: str | None = None) -> Iterator[tuple[str, int | None]]:
    """(path of the plain archive, size of the .zst or None) for a read-only command (info, refs): a local
    ``.dduf.zst`` is decompressed as ``dduf validate`` does (a private temporary file removed afterwards, or
    the verified cache entry); anything else is passed through, for the archive reader to judge."""
    from ..storage.urls import is_url
    from ..storage.zst import is_zst

    if not is_zst(source) or is_url(source) or os.path.isdir(source):
        yield source, None
        return
    from ..storage.source import open_source
    from ..storage.zst_cache import validation_archive

    local = open_source(source)  # missing, a folder, unreadable: the same messages as a plain archive
    compressed = local.size
    local.close()
    with validation_archive(source, max_decompressed=max_decompressed) as plain:
        yield str(plain), compressed


def budget_arg(text: str) -> str:
    """argparse type for ``--max-decompressed``: checked at parse time (bad value: exit 2), kept as text."""
    import argparse

    from ..errors import DDUFError
    from ..storage.zst import DecompressionBudget

    try:
        DecompressionBudget.parse(text)
    except DDUFError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def table(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as left-aligned columns sized to their widest cell (a long fp8 dtype name widens its column
    instead of pushing the rest of its row out of line); the last column is not padded."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([*(str(cell).ljust(w) for cell, w in zip(r, widths, strict=False)), str(r[-1])]).rstrip() for r in rows]


def adapter_lines(adapters: list[dict[str, Any]]) -> list[str]:
    """A LoRA archive's adapters: ``adapter pixel (kohya, 1.2 MB, weight 0.8): unet 64 modules rank 4``, then
    the trainer's title, architecture and trigger words when it recorded them."""
    lines = []
    for a in adapters:
        targets = ", ".join(f"{c} {t.get('modules')} modules rank {'/'.join(map(str, t.get('ranks') or []))}"
                            for c, t in a["targets"].items())
        size = human_bytes(a["bytes"]) if isinstance(a.get("bytes"), int) else "?"
        lines.append(f"adapter {a['name']} ({a.get('layout')}, {size}, weight {a['weight']:g}): {targets}")
        meta = a.get("metadata") or {}
        for key in ("modelspec.title", "modelspec.architecture", "ss_base_model_version"):
            if key in meta:
                lines.append(f"  {key}: {meta[key]}")
        if a.get("trigger_words"):
            lines.append(f"  trigger words: {', '.join(a['trigger_words'])}")
    return lines
