"""Resolve a component reference to files on this machine, verified by size and sha256.

Order (the loader has already used a component passed as an argument):
  1. ``refs={name: SPEC}`` (or ``{"*": SPEC}``) given by the caller: only that source is tried;
  2. the recorded local folder or ``.dduf`` when it exists here;
  3. the Hugging Face cache: the recorded repo id at the recorded revision;
  4. the Hugging Face cache by content: any ``models--*/blobs/<hash>`` of any repo (blobs are named by
     sha256 for LFS files and by git blob sha1 for small files, so finding them hashes nothing);
  5. a Hub download of only the recorded files, unless offline (HF_HUB_OFFLINE, ``local_files_only``).

The sources are :mod:`.candidates`; each candidate's files are checked against the reference by
:mod:`.compare` (size, then sha256, hashed once per file and remembered by stat in :mod:`.cache`); a copy
that does not match is refused and the next candidate tried; what is used is shown to the loader through a
folder of exactly the recorded files (:mod:`.views`). Torch-free; the loader's ``ComponentFiles`` classes are imported only by
:func:`resolve_component`."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import DDUFError, DDUFReferenceError
from ..format.references import reference_problem
from ..storage.confined import component_name_problem
from ..storage.hub_env import is_offline
from .candidates import (  # noqa: F401 (ALLOW_PRIVATE_ENV, component_folder: re-exported, packing names them here)
    ALLOW_PRIVATE_ENV,
    Candidate,
    Found,
    FoundArchive,
    FoundFolder,
    Skip,
    candidates,
    component_folder,
)
from .compare import CheckOptions, check_archive, check_folder_files, recorded_files
from .model_dirs import InPlace, Match, search_session
from .spec import (  # noqa: F401 (the SPEC names, re-exported: packing and the CLI name them here)
    REFERENCE_KINDS,
    Spec,
    SpecLike,
    check_ref_names,
    describe_reference,
    parse_ref_args,
    parse_spec,
    reference_spec,
)
from .views import view_folder, visible_files

if TYPE_CHECKING:  # pragma: no cover
    from ..storage.signed import StatKey

logger = logging.getLogger(__name__)


# --- the result ----------------------------------------------------------------------------------------
class Located(NamedTuple):
    """Where a reference resolved: a folder holding exactly the recorded files, or an archive component."""

    component: str
    how: str  # "override", "recorded folder", "recorded archive", "hf cache", "hf cache by content", "hub download"
    source: str  # what was used, for messages ("org/repo@main (/root/.cache/...)")
    folder: Path | None  # set for every kind except archives
    archive: Path | None
    member: str | None  # component folder inside ``archive``
    files: dict[str, Path]  # recorded filename -> file on disk (empty for archives)
    verified: bool  # every sha256 checked (now or remembered); False with verify=False or check-only
    # a model-folder part used in place (refs/model_dirs.py): ``files`` and ``folder`` then hold its config
    # only, its weights are views of the user's file; :func:`with_files_on_disk` writes them as a real file
    in_place: InPlace | None = None
    # a folder of shards found in a model folder: each file's stat when its tensors were verified (the loader
    # refuses a file whose opened descriptor has another)
    keys: Mapping[str, StatKey] | None = None


class _Attempt(NamedTuple):
    """One source tried and refused, for the error message."""

    what: str
    problem: str
    mismatch: bool  # the source had the files, with the wrong content


def with_files_on_disk(loc: Located) -> Located:
    """``loc`` with every file it stands for a real file on disk: a model-folder part used in place is written
    once as a file in diffusers' names into dduf_plus' cache (``dduf complete`` copies it, export reads it);
    anything else is returned as it is."""
    if loc.in_place is None:
        return loc
    files = {**loc.files, loc.in_place.weights: loc.in_place.copy()}
    return loc._replace(files=files, folder=view_folder(loc.component, files), in_place=None)


# --- entry points ----------------------------------------------------------------------------------------
def _fix_hint(name: str, reference: Mapping[str, Any], override: SpecLike | None = None) -> str:
    spec = parse_spec(override) if override is not None else reference_spec(reference)  # the caller's refs= wins
    sub = (spec.subfolder if spec else None) or name
    lines = []
    if spec is not None and spec.kind == "url":
        lines.append(f"fetch it where {spec.location} can be reached (only {sub}/ is read)")
    if spec is not None and spec.kind == "hub":
        rev = f" --revision {spec.revision}" if spec.revision else ""
        lines.append(f"download it where there is network: hf download {spec.location}{rev} --include '{sub}/*'")
    lines.append(f"point to a local copy: load_dduf(..., refs={{{name!r}: '/path/to/pipeline'}}) "
                 f"(CLI: --ref {name}=PATH)")
    lines.append(f"pass the component itself: load_dduf(..., {name}=...)")
    return "; or ".join(lines)  # "or" joins alternatives: the first keeps its words, whichever it is


def locate_component(
    name: str,
    reference: Mapping[str, Any],
    *,
    refs: Mapping[str, SpecLike] | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    verify: bool = True,
    hash_files: bool = True,
    download: bool = True,
    model_dirs: Sequence[str | os.PathLike] | None = None,
) -> Located:
    """Find ``name``'s files as recorded in ``reference`` (see the module docstring for the order).

    ``verify=False`` hashes nothing: sizes and hashes already known (remembered, or the cache blob's
    name) are still compared and a mismatch is logged as a warning instead of refusing the copy.
    ``hash_files=False`` (``dduf refs``) never hashes but still refuses known mismatches.
    ``revision`` is used for references that record none.

    Raises:
        DDUFReferenceError: no candidate has the recorded files; the message names the component, every
            source tried and why it was refused, and what to do.
    """
    found = _search(name, reference, refs=refs, local_files_only=local_files_only, token=token, revision=revision,
                    cache_dir=cache_dir, opts=CheckOptions(verify, hash_files, download), model_dirs=model_dirs)
    if isinstance(found, Located):
        return found
    error = DDUFReferenceError(_failure_message(name, reference, found, refs.get(name, refs.get("*")) if refs else None))
    error.mismatch = any(a.mismatch for a in found)  # a copy was found, with other content
    raise error


def _search(name: str, reference: Mapping[str, Any], *, refs: Mapping[str, SpecLike] | None, local_files_only: bool,
            token: str | bool | None, revision: str | None, cache_dir: str | os.PathLike | None,
            opts: CheckOptions, model_dirs: Sequence[str | os.PathLike] | None) -> Located | list[_Attempt]:
    """The first candidate holding ``name``'s recorded files, else every source tried and why it was refused.
    A malformed name or reference, or none to look for, raises :class:`DDUFReferenceError`."""
    # The same rules as `dduf validate` (R001, D012): a malformed record never reaches a file system.
    why = component_name_problem(name)
    if why is not None:
        raise DDUFReferenceError(f"reference name {name!r} {why} (D012)")
    why = reference_problem(dict(reference) if isinstance(reference, Mapping) else reference)
    if why is not None:
        raise DDUFReferenceError(f"component {name!r}: malformed reference (R001): {why}")
    recorded = recorded_files(reference)
    override = refs.get(name, refs.get("*")) if refs else None
    if override is None and reference_spec(reference) is None:
        raise DDUFReferenceError(
            f"component {name!r} is not stored in the archive and has no recorded source: pass it to "
            f"load_dduf(..., {name}=...), or give refs={{{name!r}: SPEC}} (CLI: --ref {name}=SPEC)")
    attempts: list[_Attempt] = []
    for cand in candidates(name, reference, recorded, override=override, revision=revision,
                           local_files_only=local_files_only, token=token, cache_dir=cache_dir,
                           download=opts.download, model_dirs=model_dirs):
        try:
            found = cand.get()
        except Skip as skipped:
            attempts.append(_Attempt(f"{cand.how} {cand.source}".strip(), str(skipped), False))
            continue
        located = _try(name, cand, found, recorded, opts, attempts)
        if located is not None:
            for a in attempts:
                if a.mismatch:
                    logger.warning("component %r: refused %s (%s); using %s", name, a.what, a.problem, located.source)
            return located
    return attempts


def _try(name: str, cand: Candidate, found: Found, recorded: Mapping[str, Mapping[str, Any]],
         opts: CheckOptions, attempts: list[_Attempt]) -> Located | None:
    if isinstance(found, Match):  # verified tensor by tensor (refs/model_dirs.py), not by the files' sha256
        for r in found.rejected:
            logger.info("component %r: model folder candidate %s rejected: %s", name, r.path, r.why)
        return Located(name, cand.how, found.source, view_folder(name, found.files), None, None, found.files, True,
                       found.in_place, found.keys)
    if isinstance(found, FoundArchive):
        from ..format.archive import DDUFArchive

        path, member = found
        source = f"{cand.how} {path}" + (f" (component {member})" if member != name else "")
        try:
            with DDUFArchive(path) as archive:
                known, problems = check_archive(name, archive, member, recorded, source, opts)
        except DDUFError as e:
            attempts.append(_Attempt(f"{cand.how} {path}", f"cannot be read: {e}", False))
            return None
        result = Located(name, cand.how, str(path), None, path, member, {}, known)
    else:
        folder: Path | None = None
        if isinstance(found, FoundFolder):
            folder = root = found.path
            files = {f: root / f for f in recorded} if recorded else {f: root / f for f in visible_files(root)}
            source = f"{cand.how} {cand.source} ({root})" if str(root) not in cand.source else f"{cand.how} {root}"
        else:
            files = dict(found.files)
            source = f"{cand.how} ({', '.join(sorted({str(p.parent.parent) for p in files.values()}))})"
        known, problems = check_folder_files(name, files, recorded, source, opts)
        if folder is None or visible_files(folder) != set(files):
            folder = None
        result = Located(name, cand.how, source, folder, None, None, files, known)
    if problems:
        missing = [p for p in problems if p.missing]
        if missing or opts.verify:
            attempts.append(_Attempt(source, "; ".join(map(str, problems[:3])) + ("; ..." if len(problems) > 3 else ""),
                                     not missing))
            return None
        for p in problems:
            logger.warning("component %r: %s (verify=False: using it anyway)", name, p)
    if result.archive is None and result.folder is None:
        result = result._replace(folder=view_folder(name, result.files))
    return result


def _failure_message(name: str, reference: Mapping[str, Any], attempts: list[_Attempt],
                     override: SpecLike | None = None) -> str:
    hint = reference.get("type_hint")
    what = f" ({' '.join(str(h) for h in hint)})" if isinstance(hint, list) and all(hint) else ""
    header = f"component {name!r}{what}, referenced from {describe_reference(name, reference)}, cannot be resolved"
    mismatches = [a for a in attempts if a.mismatch]
    if mismatches:
        header += " (a copy was found but its content differs from the reference)"
    tried = "\n".join(f"  - {a.what}: {a.problem}" for a in attempts)
    return f"{header}:\n{tried}\nTo fix: {_fix_hint(name, reference, override)}"


def check_references(
    references: Mapping[str, Mapping[str, Any]],
    *,
    refs: Mapping[str, SpecLike] | None = None,
    cache_dir: str | os.PathLike | None = None,
    verify: bool = False,
    local_files_only: bool = False,
    model_dirs: Sequence[str | os.PathLike] | None = None,
) -> list[dict[str, Any]]:
    """Where each reference resolves on this machine, without downloading (``dduf refs``).

    ``verify=False`` hashes nothing (remembered hashes and sizes are used); ``verify=True`` hashes what is
    not yet known. A reference that is not local reports whether a download would be attempted."""

    out = []
    opts = CheckOptions(verify=True, hash_files=verify, download=False)
    with search_session():  # model folders walked and read once for every reference
        for name, reference in sorted(references.items()):
            recorded = recorded_files(reference) if isinstance(reference, Mapping) else {}
            row: dict[str, Any] = {
                "component": name,
                "source": describe_reference(name, reference) if isinstance(reference, Mapping) else None,
                "files": len(recorded),
                "bytes": sum(int(r.get("size") or 0) for r in recorded.values()),
            }
            try:
                found: Located | list[_Attempt] | DDUFReferenceError = _search(
                    name, reference, refs=refs, local_files_only=False, token=None, revision=None, cache_dir=cache_dir,
                    opts=opts, model_dirs=model_dirs)
            except DDUFReferenceError as e:  # nothing to look for (a malformed or sourceless reference)
                found = e
            if isinstance(found, Located):
                where = found.archive if found.archive is not None else found.folder
                row.update(status="ok", how=found.how, resolves_to=str(where), verified=found.verified,
                           member=found.member, reason=None, found=found.source)
            else:
                row.update(_unresolved_row(name, reference, found, local_files_only))
            row["source_kind"] = spec_kind(reference)  # "hub", "url", "folder", "dduf" or None (no source)
            out.append(row)
    return out


def _unresolved_row(name: str, reference: Mapping[str, Any], found: list[_Attempt] | DDUFReferenceError,
                    local_files_only: bool) -> dict[str, Any]:
    """``dduf refs``' row for a reference found nowhere here: "download" when a download would be tried
    (from a Hub that answers), "differs" when a copy has other content, else "unresolved"."""
    spec = reference_spec(reference) if isinstance(reference, Mapping) else None
    online = spec is not None and spec.kind in ("hub", "url") and not is_offline(local_files_only)
    attempts = found if isinstance(found, list) else []
    if online and spec is not None and spec.kind == "hub":
        from ..remote.hub import hub_unreachable

        why = hub_unreachable()  # "will be downloaded" only from a Hub that answers
        if why is not None:
            online = False
            attempts = attempts + [_Attempt("hub download", f"the Hub cannot be reached ({why})", False)]
    reason = str(found) if isinstance(found, DDUFReferenceError) else _failure_message(name, reference, attempts)
    mismatch = any(a.mismatch for a in attempts)
    status = "differs" if mismatch else "download" if online else "unresolved"
    return {"status": status, "resolves_to": None, "how": None, "verified": False, "reason": reason}


def spec_kind(reference: Any) -> str | None:
    """The kind of source a reference records (see :class:`Spec`), None when it records none or is malformed."""
    spec = reference_spec(reference) if isinstance(reference, Mapping) else None
    return spec.kind if spec is not None else None
