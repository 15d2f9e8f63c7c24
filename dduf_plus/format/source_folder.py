"""A folder someone else wrote, as ``dduf pack`` and ``load_dduf`` read it: only inside its boundary, only regular
files, small files only within their budgets.

Users pack and load folders they did not write (a repo downloaded as a tarball, a shared snapshot). Such a
folder may hold a link to ``~/.ssh/id_rsa`` named ``tokenizer/vocab.txt``, a FIFO named ``vae/extra.json``, or a
sparse 10 GB ``model_index.json``. The one rule for where a folder's files may live (:func:`boundary_of`,
:func:`is_inside`) is shared by the loader (:mod:`dduf_plus.loading.folder_source`) and the packer
(:mod:`dduf_plus.format.pack`), so both refuse the same links (Z008). :func:`source_file` checks one file before
anything reads it; :func:`read_source` reads a small one bounded by its budget (D013 JSON, D014 tokenizer files),
never more than the budget + 1 bytes even if the file grows after its size was checked."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import NamedTuple

from ..errors import DDUFPackError
from ..storage.fd_io import read_at_most
from . import spec
from .json_budget import budget_for
from .tokenizer_budget import MAX_TOKENIZER_FILE, applies

HUB_CACHE_KINDS = ("models--", "datasets--", "spaces--")  # a Hugging Face cache repo folder's name starts so
ESCAPE_HINT = "copy the file into the folder if it belongs in the archive"


def boundary_of(root: Path) -> Path:
    """The folder files may live in: ``root`` itself, or for a Hugging Face cache snapshot
    (``.../models--org--name/snapshots/<commit>``, or a folder inside one: a pipeline in a repo's sub-folder) the
    repo's cache folder, whose ``blobs/`` the links name (it holds that repo's files only)."""
    real = Path(os.path.realpath(root))
    for folder in (real, *real.parents):
        if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith(HUB_CACHE_KINDS):
            return folder.parent.parent
    return real


def is_inside(real: Path, boundary: Path) -> bool:
    """Whether the real (links resolved) path ``real`` is ``boundary`` or beneath it."""
    return real == boundary or boundary in real.parents


def escape_message(real: Path, boundary: Path, hint: str) -> str:
    """What a file leading out of its folder's boundary is told (the loader and the packer say the same)."""
    return f"is a link to {real}, outside {boundary}: a folder is read only inside itself ({hint})"


class SourceFile(NamedTuple):
    """A file of the folder, checked: its real path (inside the boundary) and its size when checked."""

    real: Path
    size: int


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def kind_of(mode: int) -> str:
    """``"a FIFO"``, ``"a folder"``... for a mode that is not a regular file's."""
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def source_file(path: Path, boundary: Path, shown: str | os.PathLike | None = None) -> SourceFile:
    """``path`` checked before any byte of it is read: its real path inside ``boundary`` (Z008 otherwise: a link
    leading out would publish a file from elsewhere) and a regular file (a FIFO would block its reader for ever,
    a device never ends). ``shown`` names it in messages (``path`` by default).

    Raises:
        DDUFPackError: naming the file, the rule and what to do.
    """
    shown = os.fspath(shown if shown is not None else path)
    real = Path(os.path.realpath(path))
    if not is_inside(real, boundary):
        raise DDUFPackError(f"{shown}: Z008 {escape_message(real, boundary, ESCAPE_HINT)}")
    try:
        st = os.stat(real)
    except OSError as e:
        dangling = " (a link to nothing)" if os.path.islink(path) else ""
        raise DDUFPackError(f"{shown}: cannot read it{dangling}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise DDUFPackError(f"{shown}: is {kind_of(st.st_mode)}, not a regular file: DDUF stores files only "
                            "(remove it, or put the file itself in its place)")
    return SourceFile(real, st.st_size)


def size_limit(entry: str) -> tuple[int, str] | None:
    """``(bytes, rule code)`` a small file stored as ``entry`` ("tokenizer/tokenizer.json") may hold: D014 for
    tokenizer files, D013 for JSON (its kind's budget); None for other files (weights: read by header only)."""
    json_limit = budget_for(entry).bytes if entry.endswith(".json") else None
    if "/" in entry and applies(entry) and (json_limit is None or MAX_TOKENIZER_FILE <= json_limit):
        return MAX_TOKENIZER_FILE, "D014"
    return None if json_limit is None else (json_limit, "D013")  # (tokenizer_config.json: its config budget)


def size_problem(entry: str, size: int) -> str | None:
    """Why a file of ``size`` bytes may not be stored as ``entry`` (its code first), or None: said from the size
    alone, before the file is read or copied."""
    limit = size_limit(entry)
    if limit is None or size <= limit[0]:
        return None
    return f"{limit[1]} {size} bytes is more than the {limit[0]} {entry} may hold (DDUF readers refuse it); not read"


def read_source(path: Path, shown: str | os.PathLike, limit: int, code: str, *, follow_links: bool = True) -> bytes:
    """The bytes of the small file ``path`` (``shown`` in messages), at most ``limit`` of them: more is ``code``
    (D013, D014), found by reading ``limit + 1`` bytes, never the whole file.

    Raises:
        DDUFPackError: over ``limit``, no longer a regular file, or unreadable.
    """
    try:
        data = read_at_most(path, limit, follow_links=follow_links)
    except OSError as e:
        raise DDUFPackError(f"{os.fspath(shown)}: cannot read it: {e.strerror or e}") from None
    if data is None:
        raise DDUFPackError(f"{os.fspath(shown)}: is no longer a regular file (a FIFO, a device or a folder was put "
                            "in its place); not read")
    if len(data) > limit:
        raise DDUFPackError(f"{os.fspath(shown)}: {code} more than the {limit} bytes it may hold (DDUF readers refuse "
                            "it); not read further")
    return data


def read_entry_file(path: Path, entry: str, *, follow_links: bool = True) -> bytes:
    """The bytes of the file stored as ``entry``, bounded by :func:`size_limit` where its kind has one (else by
    its size when opened); never blocks on a FIFO."""
    limit = size_limit(entry)
    if limit is not None:
        return read_source(path, f"{path} ({entry})", limit[0], limit[1], follow_links=follow_links)
    try:
        data = read_at_most(path, None, follow_links=follow_links)
    except OSError as e:
        raise DDUFPackError(f"{path} ({entry}): cannot read it: {e.strerror or e}") from None
    if data is None:
        raise DDUFPackError(f"{path} ({entry}): is not a regular file (a FIFO, a device or a folder); not read")
    return data


MODEL_INDEX_LIMIT = spec.JSON_BUDGETS[spec.MODEL_INDEX].bytes
