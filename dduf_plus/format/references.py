"""The rules a ``_dduf_plus_references`` record must follow: one implementation, run by
:class:`~dduf_plus.format.archive.DDUFArchive` on open (so ``validate``, ``info``, ``refs``, ``complete``
and ``load_dduf`` all refuse the same records) and by the resolver before it touches a file system.

A reference is untrusted input: its component name, ``subfolder``, ``revision``, ``variant`` and file
names end up in paths, so each must be a plain name (D012 for the names that choose a folder, R001 for
the rest of a malformed record). R003 (a warning) marks a reference that records no source, R004 (a warning) one whose source is a local path."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..storage.confined import component_name_problem, name_problem
from . import spec
from .findings import Finding, finding

SHA256 = re.compile(r"[0-9a-f]{64}")
GIT_SHA1 = re.compile(r"[0-9a-f]{40}")
_OPTIONAL_STRINGS = ("subfolder", "revision", "variant")
# A git ref as the Hub accepts it (branch, tag, commit, refs/pr/N): '/'-separated plain parts.
_REVISION_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-+]*")
MAX_REFERENCED_FILES = 10_000


def reference_findings(model_index: Mapping[str, Any], components: Mapping[str, Any]) -> list[Finding]:
    """D012 / R001 / R003 findings for every reference of ``model_index`` (nothing if it has none);
    ``components`` are the components model_index.json names."""
    refs = model_index.get(spec.REFERENCES_KEY)
    if not isinstance(refs, dict):
        return []  # absent, or not an object (check_structure reports that as R001)
    out: list[Finding] = []
    for component, ref in refs.items():
        why = component_name_problem(component)
        if why is not None:
            out.append(finding("D012", spec.REFERENCES_KEY, f"reference name {component!r} {why}"))
            continue
        subfolder = ref.get("subfolder") if isinstance(ref, dict) else None
        if isinstance(subfolder, str) and (why := name_problem(subfolder)) is not None:
            out.append(finding("D012", component, f"reference subfolder {subfolder!r} {why}"))
            continue
        why = reference_problem(ref)
        if why is None and component not in components:
            why = "model_index.json names no such component"
        if why:
            out.append(finding("R001", component, why))
        elif ref.get("pretrained_model_name_or_path") is None:
            out.append(finding("R003", component, "no source recorded; pass it to load_dduf (refs= or the "
                                                   "component itself)"))
        elif is_local_path(ref["pretrained_model_name_or_path"]):
            out.append(finding("R004", component, f"source {_shown(ref['pretrained_model_name_or_path'])} is a "
                                                   "local path: it resolves only where that path holds the same files"))
    return out


_DRIVE = re.compile(r"[A-Za-z]:[\\/]")


def is_local_path(source: str) -> bool:
    """A reference source that names a place on one machine: an absolute or relative path, or a ``.dduf`` that is
    no URL (a repo id ``org/name`` and a URL travel). The same spelling rules the SPEC parser applies."""
    if "://" in source:
        return False
    return source.startswith(("/", "~", ".", "\\")) or bool(_DRIVE.match(source)) or source.endswith(".dduf")


def _shown(source: str) -> str:
    return repr(source if len(source) <= 80 else source[:77] + "...")


def revision_problem(revision: str) -> str | None:
    parts = revision.split("/")
    if not all(_REVISION_PART.fullmatch(p) for p in parts) or any(p.endswith(".lock") or ".." in p for p in parts):
        return f"revision {revision!r} is not a branch, tag or commit name"
    return None


def reference_problem(ref: Any) -> str | None:
    """Why ``ref`` is not a well-formed reference record (R001), or None. Does not look at its name."""
    if not isinstance(ref, dict):
        return f"reference is a JSON {type(ref).__name__}, not an object"
    if "pretrained_model_name_or_path" not in ref:
        return "'pretrained_model_name_or_path' is missing (a repository, a path, or null for no source)"
    repo = ref["pretrained_model_name_or_path"]
    if repo is not None and (not isinstance(repo, str) or not repo.strip()):
        return "'pretrained_model_name_or_path' must be a non-empty string (or null: no source)"
    if isinstance(repo, str) and any(ord(c) < 0x20 or ord(c) == 0x7F for c in repo):
        return "'pretrained_model_name_or_path' holds control characters"
    for key in _OPTIONAL_STRINGS:
        if ref.get(key) is not None and not isinstance(ref[key], str):
            return f"{key!r} must be a string or null"
    if ref.get("subfolder") is not None and (why := name_problem(ref["subfolder"])) is not None:
        return f"subfolder {ref['subfolder']!r} {why}"
    if ref.get("revision") is not None and (why := revision_problem(ref["revision"])) is not None:
        return why
    if ref.get("variant") is not None and (why := name_problem(ref["variant"])) is not None:
        return f"variant {ref['variant']!r} {why}"
    files = ref.get("files")
    if not isinstance(files, dict) or (not files and repo is not None):
        return "'files' must be a non-empty object of file name -> {size, sha256 and/or git_sha1}"
    if len(files) > MAX_REFERENCED_FILES:
        return f"'files' lists {len(files)} files (at most {MAX_REFERENCED_FILES})"
    for filename, rec in files.items():
        if name_problem(filename) is not None:
            return f"file name {filename!r} is not a plain name inside the component folder"
        if not isinstance(rec, dict):
            return f"files[{filename!r}] must be an object with 'size' and 'sha256' (or 'git_sha1')"
        if type(rec.get("size")) is not int or rec["size"] < 0:
            return f"files[{filename!r}].size must be a non-negative integer"
        sha256, git_sha1 = rec.get("sha256"), rec.get("git_sha1")
        if sha256 is None and git_sha1 is None:
            return f"files[{filename!r}] has no content id: give 'sha256' (or, for small non-LFS files, 'git_sha1')"
        if sha256 is not None and not (isinstance(sha256, str) and SHA256.fullmatch(sha256)):
            return f"files[{filename!r}].sha256 must be 64 lowercase hex digits"
        if git_sha1 is not None and not (isinstance(git_sha1, str) and GIT_SHA1.fullmatch(git_sha1)):
            return f"files[{filename!r}].git_sha1 must be 40 lowercase hex digits"
    return None
