"""Unpack an archive into a diffusers folder, confined to the target directory."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import DDUFFormatError, DDUFUsageError
from ..storage.confined import Confined
from . import spec
from .archive import DDUFArchive


def safe_target(root: Path, name: str) -> Path:
    """``root / name`` if it stays inside ``root``; refuses traversal whatever validation said."""
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts) or ":" in parts[0]:
        raise DDUFFormatError(f"refusing to unpack {name!r}: it would escape {root}")
    target = (root / Path(*parts)).resolve()
    if not target.is_relative_to(root.resolve()):
        raise DDUFFormatError(f"refusing to unpack {name!r}: it would escape {root}")
    return target


def unpack(archive_path: str | os.PathLike, output: str | os.PathLike, *, force: bool = False,
           keep_index: bool = False, check: bool = True) -> list[Path]:
    """Write every entry of the archive under ``output``; returns the files written.

    Raises:
        DDUFFormatError: an entry name would escape ``output`` (checked even with ``check=False``).
        DDUFUsageError: a file exists and ``force`` is False.
    """
    root = Path(output)
    written: list[Path] = []
    with DDUFArchive(archive_path, check=check) as archive:
        names = [n for n in archive.entries if keep_index or n != spec.INDEX_NAME]
        targets = {n: safe_target(root, n) for n in names}  # vet every name before writing anything
        if not force:
            clash = [str(t) for t in targets.values() if t.exists() or t.is_symlink()]
            if clash:
                raise DDUFUsageError(f"{clash[0]} exists (use --force to overwrite)")
        out_root = Confined(root)
        for name, target in targets.items():
            entry = archive.entry(name)
            folder = out_root.mkdir(target.parent)
            # exclusive temp file (a planted ".x.partial" symlink is never followed), renamed over the target;
            # 0644 less the umask, as unzip leaves files (mkstemp's 0600 made unpacked configs private)
            with out_root.atomic(folder / target.name, fsync=False, mode=0o644) as out:
                _copy_range(archive, entry.offset, entry.length, out.fd)
            written.append(target)
    return written


def _copy_range(archive: DDUFArchive, offset: int, length: int, dst: int) -> None:
    src = getattr(archive._source, "fd", None)
    done = 0
    if src is not None and hasattr(os, "copy_file_range"):
        try:
            while done < length:
                n = os.copy_file_range(src, dst, length - done, offset + done)
                if n <= 0:
                    break
                done += n
        except OSError:
            pass
    while done < length:
        chunk = archive._source.read_at(offset + done, min(64 << 20, length - done))
        os.write(dst, chunk)
        done += len(chunk)
