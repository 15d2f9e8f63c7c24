"""A candidate source's files compared with what a component reference records (:mod:`.resolve` tries the
sources): the size first, then the sha256 (or git blob sha1 of small files), each file hashed once and
remembered by stat in :mod:`.cache`. An entry of another archive is hashed here too: that archive's own index
hashes are claims of its writer."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from . import cache as _cache

if TYPE_CHECKING:  # pragma: no cover
    from ..format.archive import DDUFArchive


class Problem(NamedTuple):
    """What a candidate source gets wrong about one recorded file: the sentence for messages, and whether the
    file is absent there (a copy without the file is no mismatch: the next candidate is tried, even with
    ``verify=False``)."""

    text: str
    missing: bool = False

    def __str__(self) -> str:
        return self.text


class CheckOptions(NamedTuple):
    """How a candidate is checked."""

    verify: bool  # refuse mismatches (else: warn and use)
    hash_files: bool  # hash what is not yet known (False: dduf refs without --verify)
    download: bool


def recorded_files(reference: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The reference's ``files`` record: {file name: {"size", "sha256" or "git_sha1"}} (malformed rows left out)."""
    files = reference.get("files")
    if not isinstance(files, dict):
        return {}
    return {str(k): v for k, v in files.items() if isinstance(v, dict)}


def check_folder_files(component: str, files: Mapping[str, Path], recorded: Mapping[str, Mapping[str, Any]],
                       source: str, opts: CheckOptions) -> tuple[bool, list[Problem]]:
    """Compare files on disk with the reference. Returns (all hashes known and equal, problems)."""
    hv = _cache.verified_hashes()
    problems: list[Problem] = []
    all_known = True
    for fname, rec in sorted(recorded.items()):
        path = files.get(fname)
        where = f"{component}/{fname} from {source}"
        if path is None or not path.is_file():
            problems.append(Problem(f"{component}/{fname} is missing in {source}", missing=True))
            continue
        size = path.stat().st_size
        if rec.get("size") is not None and size != rec["size"]:
            problems.append(Problem(f"{where}: {size} bytes, the reference records {rec['size']}"))
            continue
        want, want_git = rec.get("sha256"), rec.get("git_sha1")
        if want:
            got = hv.lookup(path)
            if got is None and opts.hash_files and opts.verify:
                got = hv.sha256(path)
            if got is None:
                all_known = False
            elif got != want:
                problems.append(Problem(f"{where}: sha256 {got} differs from the recorded {want} ({path})"))
        elif want_git:
            if opts.hash_files and opts.verify:
                got = _cache.git_blob_sha1_file(path)
                if got != want_git:
                    problems.append(Problem(f"{where}: git blob sha1 {got} differs from the recorded {want_git} ({path})"))
            else:
                all_known = False
        else:
            all_known = False  # only a size was recorded
    return all_known and not problems, problems


def check_archive(component: str, archive: DDUFArchive, member: str,
                  recorded: Mapping[str, Mapping[str, Any]], source: str, opts: CheckOptions) -> tuple[bool, list[Problem]]:
    """Entries of another archive against the reference. That archive's own index hashes are claims of
    its writer, so each entry is hashed here once and remembered by the archive's stat."""
    hv = _cache.verified_hashes()
    problems: list[Problem] = []
    all_known = True
    if member not in archive.components:
        return False, [Problem(f"{source} has no component {member!r}")]
    comp = archive.components[member]
    if comp.external is not None and not comp.files:
        return False, [Problem(f"{source} does not store {member!r} either (it references it)")]
    for fname, rec in sorted(recorded.items()):
        entry_name = f"{member}/{fname}"
        where = f"{component}/{fname} from {source} (entry {entry_name})"
        if entry_name not in archive:
            problems.append(Problem(f"{component}/{fname} is missing in {source} (no entry {entry_name})", missing=True))
            continue
        entry = archive.entry(entry_name)
        if rec.get("size") is not None and entry.length != rec["size"]:
            problems.append(Problem(f"{where}: {entry.length} bytes, the reference records {rec['size']}"))
            continue
        want = rec.get("sha256")
        want_git = rec.get("git_sha1")
        got = hv.lookup(archive.path, member=entry_name)
        if got is None and opts.hash_files and opts.verify:
            view = archive.view(entry_name)
            try:
                got = hashlib.sha256(view).hexdigest()
                git = _cache.git_blob_sha1(bytes(view)) if (want_git and not want) else None
            finally:
                view.release()
            hv.remember(archive.path, got, member=entry_name)
            if git is not None and git != want_git:
                problems.append(Problem(f"{where}: git blob sha1 {git} differs from the recorded {want_git}"))
                continue
        if want:
            if got is None:
                all_known = False
            elif got != want:
                problems.append(Problem(f"{where}: sha256 {got} differs from the recorded {want}"))
        elif not (want_git and got is not None):
            all_known = False
    return all_known and not problems, problems
