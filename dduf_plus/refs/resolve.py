"""Resolve a component reference to files on this machine, verified by size and sha256.

Order (the loader has already used a component passed as an argument):
  1. ``refs={name: SPEC}`` (or ``{"*": SPEC}``) given by the caller: only that source is tried;
  2. the recorded local folder or ``.dduf`` when it exists here;
  3. the Hugging Face cache: the recorded repo id at the recorded revision;
  4. the Hugging Face cache by content: any ``models--*/blobs/<hash>`` of any repo (blobs are named by
     sha256 for LFS files and by git blob sha1 for small files, so finding them hashes nothing);
  5. a Hub download of only the recorded files, unless offline (HF_HUB_OFFLINE, ``local_files_only``).

Each candidate's files are checked against the reference (size, then sha256, hashed once per file and
remembered by stat in :mod:`dduf_plus.refs.cache`); a copy that does not match is refused and the next
candidate tried. Torch-free; the loader's ``ComponentFiles`` classes are imported only by
:func:`resolve_component`."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import DDUFError, DDUFIntegrityError, DDUFReferenceError
from ..format.references import reference_problem
from ..format.spec import CONFIG_FILES
from ..storage.confined import Confined, component_name_problem, plain_name
from ..storage.hub_env import env_true, is_offline
from . import cache as _cache
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

if TYPE_CHECKING:  # pragma: no cover
    from ..format.archive import DDUFArchive
    from .model_dirs import InPlace

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


class _Attempt(NamedTuple):
    what: str
    problem: str
    mismatch: bool  # the source had the files, with the wrong content


class Problem(NamedTuple):
    """What a candidate source gets wrong about one recorded file: the sentence for messages, and whether the
    file is absent there (a copy without the file is no mismatch: the next candidate is tried, even with
    ``verify=False``)."""

    text: str
    missing: bool = False

    def __str__(self) -> str:
        return self.text


class _Candidate(NamedTuple):
    how: str
    source: str
    # -> ("folder", Path) | ("files", {name: Path}) | ("dduf", (Path, member)) ; or raises _Skip
    get: Callable[[], tuple[str, Any]]


class _Skip(Exception):
    """A candidate that does not apply here (not cached, path absent): a note for the error message."""


class _Options(NamedTuple):
    verify: bool  # refuse mismatches (else: warn and use)
    hash_files: bool  # hash what is not yet known (False: dduf refs without --verify)
    download: bool


def _recorded_files(reference: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    files = reference.get("files")
    if not isinstance(files, dict):
        return {}
    return {str(k): v for k, v in files.items() if isinstance(v, dict)}


# --- checking ------------------------------------------------------------------------------------------
def _check_folder_files(component: str, files: Mapping[str, Path], recorded: Mapping[str, Mapping[str, Any]],
                        source: str, opts: _Options) -> tuple[bool, list[Problem]]:
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


def _check_archive(component: str, archive: DDUFArchive, member: str,
                   recorded: Mapping[str, Mapping[str, Any]], source: str, opts: _Options) -> tuple[bool, list[Problem]]:
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


# --- candidates ----------------------------------------------------------------------------------------
def component_folder(root: Path, subs: list[str], *, direct: bool) -> Path | None:
    """The one rule for a folder SOURCE, at pack (``--ref``) and at load (``refs=``): ``root/SUB`` for the
    first SUB that is a folder; else, when ``direct`` (no ``:SUBFOLDER`` given), ``root`` itself when it is
    a component folder (a config file, no model_index.json: ``--ref vae=/models/sd15/vae``)."""
    for sub in subs:
        if (root / sub).is_dir():
            return root / sub
    if direct and not (root / "model_index.json").is_file() and any((root / c).is_file() for c in CONFIG_FILES):
        return root
    return None


def _folder_candidate(how: str, spec: Spec, name: str, fallback_subfolder: str | None = None) -> _Candidate:
    """A pipeline folder's component folder. With no explicit subfolder, ``fallback_subfolder`` (the one
    the reference records) and then ``name`` are tried, and a component folder given directly
    (``refs={"vae": "/models/vae"}``: a config file, no model_index.json) is accepted too."""
    subs = [spec.subfolder] if spec.subfolder else list(dict.fromkeys(s for s in (fallback_subfolder, name) if s))

    def get() -> tuple[str, Any]:
        root = Path(spec.location)
        if not root.is_dir():
            raise _Skip(f"{root} does not exist here")
        found = component_folder(root, subs, direct=spec.subfolder is None)
        if found is not None:
            return "folder", found
        raise _Skip(f"no {' or '.join(subs)} folder in {root}")

    shown = spec.location + (f":{subs[0]}" if subs[0] != name else "")
    return _Candidate(how, shown, get)


def _dduf_candidate(how: str, spec: Spec, name: str) -> _Candidate:
    sub = spec.subfolder or name

    def get() -> tuple[str, Any]:
        if not Path(spec.location).is_file():
            raise _Skip(f"{spec.location} does not exist here")
        return "dduf", (Path(spec.location), sub)

    return _Candidate(how, f"{spec.location}" + (f":{sub}" if sub != name else ""), get)


def _hf_cache_candidate(spec: Spec, name: str, revision: str | None, cache_dir: str | os.PathLike | None) -> _Candidate:
    sub = spec.subfolder or name
    rev = spec.revision or revision or "main"

    def get() -> tuple[str, Any]:
        for cache in _cache.hf_cache_dirs(cache_dir):
            snap = _cache.snapshot_dir(cache, spec.location, rev)
            if snap is not None and (snap / sub).is_dir():
                return "folder", snap / sub
        caches = ", ".join(str(c) for c in _cache.hf_cache_dirs(cache_dir))
        raise _Skip(f"not in the Hugging Face cache ({caches})")

    return _Candidate("hf cache", f"{spec.location}@{rev}:{sub}", get)


def _content_candidate(recorded: Mapping[str, Mapping[str, Any]], cache_dir: str | os.PathLike | None) -> _Candidate:
    def get() -> tuple[str, Any]:
        if not recorded:
            raise _Skip("no file hashes recorded")
        blobs = _cache.blob_index(_cache.hf_cache_dirs(cache_dir))
        found: dict[str, Path] = {}
        missing = []
        for fname, rec in sorted(recorded.items()):
            keys = [k for k in (rec.get("sha256"), rec.get("git_sha1")) if k]
            path = next((blobs[k] for k in keys if k in blobs), None)
            if path is None:
                missing.append(fname)
            else:
                found[fname] = path
        if missing:
            raise _Skip(f"{len(missing)} of {len(recorded)} files are in no cached repo ({', '.join(missing[:3])}"
                        + (", ..." if len(missing) > 3 else "") + ")")
        return "files", found

    return _Candidate("hf cache by content", "", get)


ALLOW_PRIVATE_ENV = "DDUF_PLUS_ALLOW_PRIVATE_URLS"


def _check_recorded_host(url: str) -> None:
    """A URL the archive recorded (not one the caller passed in ``refs=``) is fetched only from a public
    host: an archive from a stranger must not make the loader reach loopback, private or link-local
    addresses (the intranet, cloud metadata services). ``$DDUF_PLUS_ALLOW_PRIVATE_URLS=1`` or a ``refs=``
    override lifts it. ``hf://`` goes to the configured Hub endpoint, like a Hub reference."""
    from ..storage.urls import host_problem

    if url.lower().startswith("hf://") or env_true(os.environ.get(ALLOW_PRIVATE_ENV)):
        return
    why = host_problem(url)
    if why:
        raise _Skip(f"the archive records {url}, and {why}: a recorded URL is fetched only from a public host "
                    f"(pass it as refs={{...}} or set {ALLOW_PRIVATE_ENV}=1 to allow it)")


def _hosted_candidate(how: str, spec: Spec, name: str, recorded: Mapping[str, Mapping[str, Any]], *,
                      fetch: bool, offline: bool, token: str | bool | None) -> _Candidate:
    """A component inside a hosted archive: the files already fetched (by content, no request), else only
    the component's entries fetched by range reads, each verified as it arrives (:mod:`.hosted`)."""
    sub = spec.subfolder or name

    def get() -> tuple[str, Any]:
        from ..storage.urls import check_url
        from . import hosted

        if not recorded:
            raise _Skip("no file hashes recorded: a hosted component is fetched only by content")
        try:
            check_url(spec.location)
        except DDUFError as e:
            raise _Skip(str(e)) from None
        found, missing = hosted.cached_files(recorded)
        if missing and fetch and how.startswith("recorded"):
            _check_recorded_host(spec.location)
        if not missing:
            return "files", found
        if not fetch:
            why = "offline: HF_HUB_OFFLINE or local_files_only" if offline else "no download here"
            raise _Skip(f"{len(missing)} of {len(recorded)} files not fetched yet ({why})")
        try:
            found.update(hosted.fetch_component(spec.location, sub, name, recorded, missing, token=token))
        except DDUFIntegrityError:
            raise  # the bytes there are not the referenced ones: never used, never retried elsewhere
        except DDUFError as e:
            raise _Skip(f"cannot be fetched: {e}") from None
        return "files", found

    return _Candidate(how, f"{spec.location}" + (f":{sub}" if sub != name else ""), get)


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _download_candidate(spec: Spec, name: str, recorded: Mapping[str, Mapping[str, Any]], *, revision: str | None,
                        local_files_only: bool, token: str | bool | None,
                        cache_dir: str | os.PathLike | None) -> _Candidate:
    sub = spec.subfolder or name
    rev = spec.revision or revision

    def get() -> tuple[str, Any]:
        if local_files_only:
            raise _Skip("not downloaded: local_files_only=True")
        if is_offline():
            raise _Skip("not downloaded: HF_HUB_OFFLINE is set")
        from ..remote.hub import hub_unreachable

        if why := hub_unreachable():  # one quick connect instead of huggingface_hub's 5 retries (~23 s)
            raise _Skip(f"not downloaded: the Hub cannot be reached ({why})")
        try:
            from huggingface_hub import snapshot_download
        except ImportError:  # pragma: no cover - a dependency, but keep the message useful
            raise _Skip("not downloaded: huggingface_hub is not installed") from None
        patterns = [f"{_glob_escape(sub)}/{_glob_escape(f)}" for f in recorded] or [f"{_glob_escape(sub)}/*"]
        try:
            path = snapshot_download(spec.location, revision=rev, allow_patterns=patterns, token=token,
                                     cache_dir=Path(cache_dir) if cache_dir is not None else None)
        except Exception as e:  # every hub/network error: report it, never retry here
            raise _Skip(f"download failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        return "folder", Path(path) / sub

    return _Candidate("hub download", f"{spec.location}" + (f"@{rev}" if rev else "") + f":{sub}", get)


def _model_dirs_candidate(name: str, reference: Mapping[str, Any],
                          given: Sequence[str | os.PathLike] | None) -> list[_Candidate]:
    """The reference found by its tensors in app model folders (:mod:`dduf_plus.refs.model_dirs`)."""
    from . import model_dirs

    dirs = model_dirs.search_dirs(given)

    def get() -> tuple[str, Any]:
        found = model_dirs.find_component(name, reference, dirs)
        if isinstance(found, str):
            raise _Skip(found)
        return "verified files", found

    return [_Candidate("model folder", os.pathsep.join(map(str, dirs)), get)] if dirs else []


def _candidates(name: str, reference: Mapping[str, Any], recorded: Mapping[str, Mapping[str, Any]], *,
                override: SpecLike | None, revision: str | None, local_files_only: bool,
                token: str | bool | None, cache_dir: str | os.PathLike | None, download: bool,
                model_dirs: Sequence[str | os.PathLike] | None = None) -> list[_Candidate]:
    def for_spec(spec: Spec, how: str) -> list[_Candidate]:
        if spec.kind == "folder":
            return [_folder_candidate(how, spec, name)]
        if spec.kind == "dduf":
            return [_dduf_candidate(how, spec, name)]
        if spec.kind == "url":
            offline = local_files_only or is_offline()
            return [_hosted_candidate(how, spec, name, recorded, fetch=download and not offline,
                                      offline=offline, token=token)]
        out = [_hf_cache_candidate(spec, name, revision, cache_dir)]
        if download:
            out.append(_download_candidate(spec, name, recorded, revision=revision, local_files_only=local_files_only,
                                           token=token, cache_dir=cache_dir))
        return out

    if override is not None:
        spec = parse_spec(override)
        recorded_sub = str(reference.get("subfolder") or "") or None
        if spec.kind == "folder":
            return [_folder_candidate("override", spec, name, recorded_sub)]
        if spec.subfolder is None and recorded_sub:
            spec = spec._replace(subfolder=recorded_sub)
        return for_spec(spec, "override")
    recorded_spec = reference_spec(reference)
    out: list[_Candidate] = []
    if recorded_spec is not None and recorded_spec.kind in ("folder", "dduf", "url"):
        out += for_spec(recorded_spec, "recorded " + {"dduf": "archive", "url": "hosted archive"}.get(
            recorded_spec.kind, "folder"))
    hub = recorded_spec if recorded_spec is not None and recorded_spec.kind == "hub" else None
    if hub is not None:
        out.append(_hf_cache_candidate(hub, name, revision, cache_dir))
    out.append(_content_candidate(recorded, cache_dir))
    out += _model_dirs_candidate(name, reference, model_dirs)  # app folders: after local copies, before downloads
    if hub is not None and download:
        out.append(_download_candidate(hub, name, recorded, revision=revision, local_files_only=local_files_only,
                                       token=token, cache_dir=cache_dir))
    return out


# --- views -----------------------------------------------------------------------------------------------
def _visible_files(folder: Path) -> set[str]:
    try:
        return {e.name for e in os.scandir(folder) if not e.name.startswith(".") and e.is_file()}
    except OSError:
        return set()


def view_folder(component: str, files: Mapping[str, Path]) -> Path:
    """A folder named ``component`` holding exactly ``files`` (symlinks), under dduf_plus' cache: the
    loader then sees the recorded files and nothing else (no unverified variant or extra file). Every
    name is checked to be plain and every write stays inside the cache (:mod:`dduf_plus.storage.confined`)."""
    targets = {f: os.path.realpath(p) for f, p in sorted(files.items())}
    digest = hashlib.sha256(json.dumps(targets, sort_keys=True).encode()).hexdigest()[:24]
    cache = Confined(_cache.dduf_cache_dir())
    views = cache.mkdir(cache.path("views"))
    final = cache.path("views", digest, component)
    if final.is_dir() and not final.is_symlink() and _visible_files(final) == set(targets) \
            and all(os.path.realpath(final / plain_name(f, "file name")) == t for f, t in targets.items()):
        return final
    with cache.temp_dir(views, prefix=".view.") as tmp:
        cache.mkdir(tmp / component)
        for f, t in targets.items():
            cache.symlink(t, cache.path("views", tmp.name, component, f))
        cache.remove_tree(final.parent)  # a stale or partial view we made earlier (inside the cache only)
        try:
            cache.replace(tmp, final.parent)
        except OSError:  # another process made it meanwhile
            if not final.is_dir():
                raise
    return final


def with_files_on_disk(loc: Located) -> Located:
    """``loc`` with every file it stands for a real file on disk: a model-folder part used in place is written
    once as a file in diffusers' names into dduf_plus' cache (``dduf complete`` copies it, export reads it);
    anything else is returned as it is."""
    if loc.in_place is None:
        return loc
    files = {**loc.files, loc.in_place.weights: loc.in_place.copy()}
    return loc._replace(files=files, folder=view_folder(loc.component, files), in_place=None)


# --- entry points ----------------------------------------------------------------------------------------
def _fix_hint(name: str, reference: Mapping[str, Any]) -> str:
    spec = reference_spec(reference)
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
    # The same rules as `dduf validate` (R001, D012): a malformed record never reaches a file system.
    why = component_name_problem(name)
    if why is not None:
        raise DDUFReferenceError(f"reference name {name!r} {why} (D012)")
    why = reference_problem(dict(reference) if isinstance(reference, Mapping) else reference)
    if why is not None:
        raise DDUFReferenceError(f"component {name!r}: malformed reference (R001): {why}")
    recorded = _recorded_files(reference)
    override = None
    if refs:
        override = refs.get(name, refs.get("*"))
    opts = _Options(verify, hash_files, download)
    if override is None and reference_spec(reference) is None:
        raise DDUFReferenceError(
            f"component {name!r} is not stored in the archive and has no recorded source: pass it to "
            f"load_dduf(..., {name}=...), or give refs={{{name!r}: SPEC}} (CLI: --ref {name}=SPEC)")
    attempts: list[_Attempt] = []
    candidates = _candidates(name, reference, recorded, override=override, revision=revision,
                             local_files_only=local_files_only, token=token, cache_dir=cache_dir, download=download,
                             model_dirs=model_dirs)
    for cand in candidates:
        try:
            kind, value = cand.get()
        except _Skip as why:
            attempts.append(_Attempt(f"{cand.how} {cand.source}".strip(), str(why), False))
            continue
        located = _try(name, cand, kind, value, recorded, opts, attempts)
        if located is not None:
            for a in attempts:
                if a.mismatch:
                    logger.warning("component %r: refused %s (%s); using %s", name, a.what, a.problem, located.source)
            return located
    error = DDUFReferenceError(_failure_message(name, reference, attempts))
    error.mismatch = any(a.mismatch for a in attempts)  # a copy was found, with other content
    raise error


def _try(name: str, cand: _Candidate, kind: str, value: Any, recorded: Mapping[str, Mapping[str, Any]],
         opts: _Options, attempts: list[_Attempt]) -> Located | None:
    if kind == "verified files":  # verified tensor by tensor (refs/model_dirs.py), not by the files' sha256
        for r in value.rejected:
            logger.info("component %r: model folder candidate %s rejected: %s", name, r.path, r.why)
        return Located(name, cand.how, value.source, view_folder(name, value.files), None, None, value.files, True,
                       value.in_place)
    if kind == "dduf":
        from ..format.archive import DDUFArchive

        path, member = value
        source = f"{cand.how} {path}" + (f" (component {member})" if member != name else "")
        try:
            with DDUFArchive(path) as archive:
                known, problems = _check_archive(name, archive, member, recorded, source, opts)
        except DDUFError as e:
            attempts.append(_Attempt(f"{cand.how} {path}", f"cannot be read: {e}", False))
            return None
        result = Located(name, cand.how, str(path), None, path, member, {}, known)
    else:
        folder: Path | None = None
        if kind == "folder":
            folder = root = Path(value)
            files = {f: root / f for f in recorded} if recorded else {f: root / f for f in _visible_files(root)}
            source = f"{cand.how} {cand.source} ({root})" if str(root) not in cand.source else f"{cand.how} {root}"
        else:
            files = dict(value)
            source = f"{cand.how} ({', '.join(sorted({str(p.parent.parent) for p in files.values()}))})"
        known, problems = _check_folder_files(name, files, recorded, source, opts)
        if folder is None or _visible_files(folder) != set(files):
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


def _failure_message(name: str, reference: Mapping[str, Any], attempts: list[_Attempt]) -> str:
    hint = reference.get("type_hint")
    what = f" ({' '.join(str(h) for h in hint)})" if isinstance(hint, list) and all(hint) else ""
    header = f"component {name!r}{what}, referenced from {describe_reference(name, reference)}, cannot be resolved"
    mismatches = [a for a in attempts if a.mismatch]
    if mismatches:
        header += " (a copy was found but its content differs from the reference)"
    tried = "\n".join(f"  - {a.what}: {a.problem}" for a in attempts)
    return f"{header}:\n{tried}\nTo fix: {_fix_hint(name, reference)}"


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
    for name, reference in sorted(references.items()):
        recorded = _recorded_files(reference) if isinstance(reference, Mapping) else {}
        row: dict[str, Any] = {
            "component": name,
            "source": describe_reference(name, reference) if isinstance(reference, Mapping) else None,
            "files": len(recorded),
            "bytes": sum(int(r.get("size") or 0) for r in recorded.values()),
        }
        try:
            loc = locate_component(name, reference, refs=refs, cache_dir=cache_dir, verify=True, hash_files=verify,
                                   download=False, model_dirs=model_dirs)
        except DDUFReferenceError as e:
            spec = reference_spec(reference) if isinstance(reference, Mapping) else None
            online = spec is not None and spec.kind in ("hub", "url") and not (local_files_only or is_offline())
            reason = str(e)
            if online and spec is not None and spec.kind == "hub":
                from ..remote.hub import hub_unreachable

                why = hub_unreachable()  # "will be downloaded" only from a Hub that answers
                if why is not None:
                    online = False
                    head, sep, fix = reason.rpartition("\nTo fix: ")
                    reason = f"{head}\n  - hub download: the Hub cannot be reached ({why}){sep}{fix}" if sep else reason
            status = "differs" if getattr(e, "mismatch", False) else "download" if online else "unresolved"
            row.update(status=status, resolves_to=None, how=None, verified=False, reason=reason)
        else:
            where = loc.archive if loc.archive is not None else loc.folder
            row.update(status="ok", how=loc.how, resolves_to=str(where), verified=loc.verified,
                       member=loc.member, reason=None, found=loc.source)
        row["source_kind"] = spec_kind(reference)  # "hub", "url", "folder", "dduf" or None (no source)
        out.append(row)
    return out


def spec_kind(reference: Any) -> str | None:
    """The kind of source a reference records (see :class:`Spec`), None when it records none or is malformed."""
    spec = reference_spec(reference) if isinstance(reference, Mapping) else None
    return spec.kind if spec is not None else None
