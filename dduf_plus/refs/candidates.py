"""Where a component reference may be found on this machine, in the order :mod:`.resolve` tries them: the
caller's ``refs=`` override, the recorded folder, archive or hosted archive, the Hugging Face cache by repo
and by content, app model folders, then a Hub download. Each is a :class:`Candidate` whose ``get`` looks
there (a :class:`Skip` says why it does not apply); what it finds is checked by :mod:`.compare`."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Union

from ..errors import DDUFError, DDUFIntegrityError
from ..format.spec import CONFIG_FILES
from ..storage.hub_env import env_true, is_offline
from . import cache as _cache
from .spec import Spec, SpecLike, parse_spec, reference_spec

if TYPE_CHECKING:  # pragma: no cover
    from .model_dirs import Match


class FoundFolder(NamedTuple):
    """A component folder (a pipeline's subfolder, a snapshot's, a download's): its files checked by hash."""

    path: Path


class FoundFiles(NamedTuple):
    """The reference's files, each found somewhere (cache blobs by content): checked by hash."""

    files: dict[str, Path]


class FoundArchive(NamedTuple):
    """Component ``member`` of another ``.dduf`` archive."""

    path: Path
    member: str


# what a candidate found; a model-folder Match is already verified tensor by tensor
Found = Union[FoundFolder, FoundFiles, FoundArchive, "Match"]


class Candidate(NamedTuple):
    """One source to try: how it was found (for messages), what it is, and ``get`` to look there (it returns
    what it found, or raises :class:`Skip`)."""

    how: str
    source: str
    get: Callable[[], Found]


class Skip(Exception):
    """A candidate that does not apply here (not cached, path absent): a note for the error message."""


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


def folder_candidate(how: str, spec: Spec, name: str, fallback_subfolder: str | None = None) -> Candidate:
    """A pipeline folder's component folder. With no explicit subfolder, ``fallback_subfolder`` (the one
    the reference records) and then ``name`` are tried, and a component folder given directly
    (``refs={"vae": "/models/vae"}``: a config file, no model_index.json) is accepted too."""
    subs = [spec.subfolder] if spec.subfolder else list(dict.fromkeys(s for s in (fallback_subfolder, name) if s))

    def get() -> Found:
        root = Path(spec.location)
        if not root.is_dir():
            raise Skip(f"{root} does not exist here")
        found = component_folder(root, subs, direct=spec.subfolder is None)
        if found is not None:
            return FoundFolder(found)
        raise Skip(f"no {' or '.join(subs)} folder in {root}")

    shown = spec.location + (f":{subs[0]}" if subs[0] != name else "")
    return Candidate(how, shown, get)


def dduf_candidate(how: str, spec: Spec, name: str) -> Candidate:
    sub = spec.subfolder or name

    def get() -> Found:
        if not Path(spec.location).is_file():
            raise Skip(f"{spec.location} does not exist here")
        return FoundArchive(Path(spec.location), sub)

    return Candidate(how, f"{spec.location}" + (f":{sub}" if sub != name else ""), get)


def hf_cache_candidate(spec: Spec, name: str, revision: str | None, cache_dir: str | os.PathLike | None) -> Candidate:
    sub = spec.subfolder or name
    rev = spec.revision or revision or "main"

    def get() -> Found:
        for cache in _cache.hf_cache_dirs(cache_dir):
            snap = _cache.snapshot_dir(cache, spec.location, rev)
            if snap is not None and (snap / sub).is_dir():
                return FoundFolder(snap / sub)
        caches = ", ".join(str(c) for c in _cache.hf_cache_dirs(cache_dir))
        raise Skip(f"not in the Hugging Face cache ({caches})")

    return Candidate("hf cache", f"{spec.location}@{rev}:{sub}", get)


def content_candidate(recorded: Mapping[str, Mapping[str, Any]], cache_dir: str | os.PathLike | None) -> Candidate:
    def get() -> Found:
        if not recorded:
            raise Skip("no file hashes recorded")
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
            raise Skip(f"{len(missing)} of {len(recorded)} files are in no cached repo ({', '.join(missing[:3])}"
                        + (", ..." if len(missing) > 3 else "") + ")")
        return FoundFiles(found)

    return Candidate("hf cache by content", "", get)


ALLOW_PRIVATE_ENV = "DDUF_PLUS_ALLOW_PRIVATE_URLS"


def check_recorded_host(url: str) -> None:
    """A URL the archive recorded (not one the caller passed in ``refs=``) is fetched only from a public
    host: an archive from a stranger must not make the loader reach loopback, private or link-local
    addresses (the intranet, cloud metadata services). ``$DDUF_PLUS_ALLOW_PRIVATE_URLS=1`` or a ``refs=``
    override lifts it. ``hf://`` goes to the configured Hub endpoint, like a Hub reference."""
    from ..storage.urls import host_problem

    if url.lower().startswith("hf://") or env_true(os.environ.get(ALLOW_PRIVATE_ENV)):
        return
    why = host_problem(url)
    if why:
        raise Skip(f"the archive records {url}, and {why}: a recorded URL is fetched only from a public host "
                    f"(pass it as refs={{...}} or set {ALLOW_PRIVATE_ENV}=1 to allow it)")


def hosted_candidate(how: str, spec: Spec, name: str, recorded: Mapping[str, Mapping[str, Any]], *,
                     fetch: bool, offline: bool, token: str | bool | None) -> Candidate:
    """A component inside a hosted archive: the files already fetched (by content, no request), else only
    the component's entries fetched by range reads, each verified as it arrives (:mod:`.hosted`)."""
    sub = spec.subfolder or name

    def get() -> Found:
        from ..storage.urls import check_url
        from . import hosted

        if not recorded:
            raise Skip("no file hashes recorded: a hosted component is fetched only by content")
        try:
            check_url(spec.location)
        except DDUFError as e:
            raise Skip(str(e)) from None
        found, missing = hosted.cached_files(recorded)
        if missing and fetch and how.startswith("recorded"):
            check_recorded_host(spec.location)
        if not missing:
            return FoundFiles(found)
        if not fetch:
            why = "offline: HF_HUB_OFFLINE or local_files_only" if offline else "no download here"
            raise Skip(f"{len(missing)} of {len(recorded)} files not fetched yet ({why})")
        try:
            found.update(hosted.fetch_component(spec.location, sub, name, recorded, missing, token=token))
        except DDUFIntegrityError:
            raise  # the bytes there are not the referenced ones: never used, never retried elsewhere
        except DDUFError as e:
            raise Skip(f"cannot be fetched: {e}") from None
        return FoundFiles(found)

    return Candidate(how, f"{spec.location}" + (f":{sub}" if sub != name else ""), get)


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def download_candidate(spec: Spec, name: str, recorded: Mapping[str, Mapping[str, Any]], *, revision: str | None,
                       local_files_only: bool, token: str | bool | None,
                       cache_dir: str | os.PathLike | None) -> Candidate:
    sub = spec.subfolder or name
    rev = spec.revision or revision

    def get() -> Found:
        if local_files_only:
            raise Skip("not downloaded: local_files_only=True (local_files_only=False lets it download)")
        if is_offline():
            raise Skip("not downloaded: offline mode, HF_HUB_OFFLINE is set (unset it, or HF_HUB_OFFLINE=0, to "
                       "let it download)")
        from ..remote.hub import hub_unreachable

        if why := hub_unreachable():  # one quick connect instead of huggingface_hub's 5 retries (~23 s)
            raise Skip(f"not downloaded: the Hub cannot be reached ({why})")
        try:
            from huggingface_hub import snapshot_download
        except ImportError:  # pragma: no cover - a dependency, but keep the message useful
            raise Skip("not downloaded: huggingface_hub is not installed") from None
        patterns = [f"{_glob_escape(sub)}/{_glob_escape(f)}" for f in recorded] or [f"{_glob_escape(sub)}/*"]
        try:
            path = snapshot_download(spec.location, revision=rev, allow_patterns=patterns, token=token,
                                     cache_dir=Path(cache_dir) if cache_dir is not None else None)
        except Exception as e:  # every hub/network error: report it, never retry here
            raise Skip(f"download failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        return FoundFolder(Path(path) / sub)

    return Candidate("hub download", f"{spec.location}" + (f"@{rev}" if rev else "") + f":{sub}", get)


def model_dirscandidates(name: str, reference: Mapping[str, Any],
                          given: Sequence[str | os.PathLike] | None) -> list[Candidate]:
    """The reference found by its tensors in app model folders (:mod:`dduf_plus.refs.model_dirs`)."""
    from . import model_dirs

    dirs = model_dirs.search_dirs(given)

    def get() -> Found:
        found = model_dirs.find_component(name, reference, dirs)
        if isinstance(found, str):
            raise Skip(found)
        return found

    return [Candidate("model folder", os.pathsep.join(map(str, dirs)), get)] if dirs else []


def candidates(name: str, reference: Mapping[str, Any], recorded: Mapping[str, Mapping[str, Any]], *,
               override: SpecLike | None, revision: str | None, local_files_only: bool,
               token: str | bool | None, cache_dir: str | os.PathLike | None, download: bool,
               model_dirs: Sequence[str | os.PathLike] | None = None) -> list[Candidate]:
    """The sources to try for component ``name``, in order: only the override's when one is given, else the
    recorded source, the Hugging Face cache (by repo, then by content), app model folders, a Hub download."""

    def for_spec(spec: Spec, how: str) -> list[Candidate]:
        if spec.kind == "folder":
            return [folder_candidate(how, spec, name)]
        if spec.kind == "dduf":
            return [dduf_candidate(how, spec, name)]
        if spec.kind == "url":
            offline = is_offline(local_files_only)
            return [hosted_candidate(how, spec, name, recorded, fetch=download and not offline,
                                     offline=offline, token=token)]
        out = [hf_cache_candidate(spec, name, revision, cache_dir)]
        if download:
            out.append(download_candidate(spec, name, recorded, revision=revision, local_files_only=local_files_only,
                                          token=token, cache_dir=cache_dir))
        return out

    if override is not None:
        spec = parse_spec(override)
        recorded_sub = str(reference.get("subfolder") or "") or None
        if spec.kind == "folder":
            return [folder_candidate("override", spec, name, recorded_sub)]
        if spec.subfolder is None and recorded_sub:
            spec = spec._replace(subfolder=recorded_sub)
        return for_spec(spec, "override")
    recorded_spec = reference_spec(reference)
    out: list[Candidate] = []
    if recorded_spec is not None and recorded_spec.kind in ("folder", "dduf", "url"):
        out += for_spec(recorded_spec, "recorded " + {"dduf": "archive", "url": "hosted archive"}.get(
            recorded_spec.kind, "folder"))
    hub = recorded_spec if recorded_spec is not None and recorded_spec.kind == "hub" else None
    if hub is not None:
        out.append(hf_cache_candidate(hub, name, revision, cache_dir))
    out.append(content_candidate(recorded, cache_dir))
    out += model_dirscandidates(name, reference, model_dirs)  # app folders: after local copies, before downloads
    if hub is not None and download:
        out.append(download_candidate(hub, name, recorded, revision=revision, local_files_only=local_files_only,
                                      token=token, cache_dir=cache_dir))
    return out
