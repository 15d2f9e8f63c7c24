"""Unpack an archive into a diffusers folder, confined to the target directory."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..errors import DDUFFormatError, DDUFPathError, DDUFUsageError, DDUFValidationError
from ..storage import beneath
from ..storage.confined import Confined
from ..storage.fd_io import kernel_copy, pwrite_all, write_all
from . import spec
from .archive import DDUFArchive
from .chat_template import restore_plan

logger = logging.getLogger(__name__)


def safe_target(root: Path, name: str) -> Path:
    """``root / name`` if the name is plain (no traversal, no absolute path, no drive); refuses it whatever
    validation said. Where the entry's folder is, and whether a link on the way leads out, is the writer's to
    check as it writes (:class:`~dduf_plus.storage.beneath.Beneath`)."""
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts) or ":" in parts[0]:
        raise DDUFFormatError(f"refusing to unpack {name!r}: it would escape {root}")
    return root.joinpath(*parts)


def unpack(archive_path: str | os.PathLike, output: str | os.PathLike, *, force: bool = False,
           keep_index: bool = False, check: bool = True) -> list[Path]:
    """Write every entry of the archive under ``output``; returns the files written.

    Every folder is reached from the output folder's descriptor one name at a time, never following a link by
    path: a link inside the output is followed only where its target lies inside it too, checked again at each
    write, so a folder swapped for a link leading out while the entries are written is refused, not written
    through.

    Raises:
        DDUFFormatError: an entry name would escape ``output`` (checked even with ``check=False``).
        DDUFValidationError: a chat-template record would restore a file that may not be written (I002, D013,
            D014, Z005: see :func:`restored_originals`), also with ``check=False``; nothing is written.
        DDUFUsageError: a file exists and ``force`` is False, or a folder in ``output`` is a link leading out of
            it; nothing is written.
        DDUFPathError: such a link appeared while the entries were written.
    """
    root = Path(output)
    with DDUFArchive(archive_path, check=check) as archive:
        names = [n for n in archive.entries if keep_index or n != spec.INDEX_NAME]
        originals = restored_originals(archive)  # chat templates folded at pack time, as the source had them
        names += [n for n in originals if n not in archive.entries]
        targets = {n: safe_target(root, n) for n in names}  # vet every name before writing anything
        if beneath.AVAILABLE:
            written = _unpack_beneath(archive, targets, originals, root, force)
        else:  # no descriptor-relative calls here (Windows): paths checked, then written
            written = _unpack_by_path(archive, targets, originals, root, force)
        if archive.references:  # the folder lacks them: say so, and what gives a usable folder
            logger.warning("%s is a partial archive: %s (referenced, not stored) %s missing from %s, so diffusers "
                           "and dduf pack cannot use that folder as it is; run `dduf complete %s -o FULL.dduf` "
                           "and unpack FULL.dduf", archive_path, ", ".join(sorted(archive.references)),
                           "is" if len(archive.references) == 1 else "are", output, archive_path)
    return written


def _unpack_beneath(archive: DDUFArchive, targets: dict[str, Path], originals: dict[str, bytes], root: Path,
                    force: bool) -> list[Path]:
    with beneath.Beneath(root) as out:
        _vet_targets(out, targets, force)
        for name in targets:
            # exclusive temp file (a planted ".x.partial" link is never followed), renamed over the target;
            # 0644 less the umask, as unzip leaves files (mkstemp's 0600 made unpacked configs private)
            with out.atomic(name, mode=0o644) as fd:
                if name in originals:
                    write_all(fd, originals[name])
                else:
                    _copy_entry(archive, name, fd)
    return list(targets.values())


def _vet_targets(out: beneath.Beneath, targets: dict[str, Path], force: bool) -> None:
    """Before anything is written: every entry's folder is reachable without leaving the output, and (unless
    ``force``) no entry's file exists yet."""
    for name, target in targets.items():
        try:
            exists = out.lexists(name)
        except DDUFPathError as e:  # a link the user left in the output: their folder, their fix
            raise DDUFUsageError(f"cannot unpack {name}: {e}") from None
        if exists and not force:
            raise DDUFUsageError(f"{target} exists (use --force to overwrite)")


def _unpack_by_path(archive: DDUFArchive, targets: dict[str, Path], originals: dict[str, bytes], root: Path,
                    force: bool) -> list[Path]:
    """Where descriptor-relative calls are missing: every target resolved and checked inside ``root``, then
    written through :class:`Confined` (which checks again before each write and rename)."""
    out_root = Confined(root)
    resolved = root.resolve()
    for name, target in targets.items():
        folder = target.parent.resolve()
        if not folder.is_relative_to(resolved):
            raise DDUFUsageError(f"refusing to unpack {name!r}: {target.parent} is a link to {folder}, outside {root}")
    if not force:
        clash = [str(t) for t in targets.values() if t.exists() or t.is_symlink()]
        if clash:
            raise DDUFUsageError(f"{clash[0]} exists (use --force to overwrite)")
    for name, target in targets.items():
        folder = out_root.mkdir(target.parent)
        with out_root.atomic(folder / target.name, fsync=False, mode=0o644) as out:
            if name in originals:
                out.file.write(originals[name])
            else:
                _copy_entry(archive, name, out.fd)
    return list(targets.values())


def restored_originals(archive: DDUFArchive) -> dict[str, bytes]:
    """``{entry name: bytes}`` of the files a pack folded (chat templates into tokenizer_config.json), each
    checked against the index record; a component whose record does not check out keeps its stored entry.

    Raises:
        DDUFValidationError: a record restores a tokenizer_config.json that is not the stored one beyond its
            chat template (I002) or over its budgets (D013, D014), or more files than the entry cap (Z005):
            the codes ``dduf validate`` reports for the archive.
    """
    entries = archive.entries
    plan = restore_plan(archive.index, {n: e.length for n, e in entries.items()}, archive.read_bytes)
    if plan.findings:
        raise DDUFValidationError(archive.path, plan.findings)
    for component in plan.unchecked:
        logger.warning("%s: the chat template record does not match the archive; %s/tokenizer_config.json is "
                       "written as stored", component, component)
    return plan.files


def _copy_entry(archive: DDUFArchive, name: str, dst: int) -> None:
    """Entry ``name``'s bytes to the new file ``dst``: by the kernel where it can, else read and written whole (a
    short write on a filling disk is continued, then fails: never a truncated file kept as if complete)."""
    entry = archive.entry(name)
    src = archive.fd
    done = 0 if src is None else kernel_copy(src, dst, entry.length, entry.offset, 0)
    while done < entry.length:  # where the kernel stopped or could not: through a buffer
        chunk = archive.read_bytes(name, done, min(64 << 20, entry.length - done))
        pwrite_all(dst, chunk, done)
        done += len(chunk)
