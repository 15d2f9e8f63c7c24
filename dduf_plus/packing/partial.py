"""Partial archives: store references instead of components that live elsewhere.

A reference sits in ``model_index.json`` under ``_dduf_plus_references`` and speaks Modular Diffusers'
component-spec vocabulary plus what that spec lacks, the identity of every file::

    "_dduf_plus_references": {
      "text_encoder": {
        "pretrained_model_name_or_path": "org/base-model",    # repo id, folder, .dduf, or null
        "subfolder": "text_encoder",
        "revision": "0123...cdef",                            # null: the default branch
        "variant": null,
        "type_hint": ["transformers", "CLIPTextModel"],
        "files": {
          "config.json": {"size": 534, "sha256": "...", "git_sha1": "..."},
          "model.safetensors": {"size": 159416, "sha256": "..."}
        }
      }
    }

``sha256`` is the content identity (the Hub's LFS oid, the Hugging Face cache blob name of LFS files);
``git_sha1`` (the git blob id, which names the cache blob of a small non-LFS file) is recorded for files
the Hub keeps out of LFS, so they are found in the cache by content too. No torch here."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from ..assignments import PackNameError, check_names
from ..errors import DDUFError, DDUFNotFoundError, DDUFPackError
from ..format import spec
from ..format.chat_template import TEMPLATE_FILE
from ..format.pack import (
    EntrySource,
    FolderPlan,
    PackResult,
    Skipped,
    _plan_component,
    plan_folder,
    write_archive,
)
from ..format.structure import component_specs, model_index_object
from ..format.weights import classify, select_weights, variants
from ..refs import cache as _cache
from ..refs.resolve import Spec, component_folder, parse_ref_args, parse_spec
from ..remote.hub import HubSourceNotFoundError, hub_unreachable
from .identity import ComponentBytes, ComponentCopy, component_difference

logger = logging.getLogger(__name__)

__all__ = ["ORIGINAL_MODEL_INDEX_KEY", "BaseComparer", "PartialPlan", "make_references", "pack_partial",
           "parse_ref_args", "canonical_model_index_bytes", "model_index_with", "warn_local_paths"]

# Set only when the source model_index.json is not in diffusers' canonical form: its exact text, so that
# ``dduf complete`` can restore it and equal a direct full pack byte for byte.
ORIGINAL_MODEL_INDEX_KEY = "_dduf_plus_original_model_index"

FileRecords = dict[str, dict[str, Any]]
_COMMIT = re.compile(r"[0-9a-f]{40}")


class BaseMatch(NamedTuple):
    """A local component found to be a source's: what its reference records."""

    files: FileRecords  # the source's files (the loader verifies them by these)
    variant: str | None  # the source's weight variant that matched
    how: str  # "identical bytes" or "same content" (re-serialized: other bytes, same tensors and settings)


class PartialPlan(NamedTuple):
    model_index: dict[str, Any]  # with _dduf_plus_references
    model_index_bytes: bytes
    sources: list[EntrySource]  # what is still stored
    skipped: list[Skipped]
    references: dict[str, dict[str, Any]]
    report: list[str]  # human lines: what was referenced, what was compared, bytes saved
    bytes_saved: int  # bytes of local files not stored because they are referenced
    folder: Path


def canonical_model_index_bytes(model_index: Mapping[str, Any]) -> bytes:
    """model_index.json as diffusers writes it (``ConfigMixin.to_json_string``)."""
    return (json.dumps(model_index, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _files(n: int) -> str:
    return f"{n} file{'s' if n != 1 else ''}"


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


# --- file identities -------------------------------------------------------------------------------------
def hash_local_files(files: Mapping[str, Path]) -> FileRecords:
    """{filename: {size, sha256[, git_sha1]}} of local files; sha256 through the verified-hash memory, so
    packing a fine-tune and loading it later on the same machine hash each referenced file once."""
    hv = _cache.verified_hashes()
    out: FileRecords = {}
    for fname, path in sorted(files.items()):
        size = path.stat().st_size
        rec: dict[str, Any] = {"size": size, "sha256": hv.sha256(path)}
        if not _cache.is_lfs_by_default(fname, size):
            rec["git_sha1"] = _cache.git_blob_sha1_file(path)
        out[fname] = rec
    return out


def _pack_selection(filenames: Sequence[str], variant: str | None) -> list[str]:
    """The files a pack keeps from a component listing: allowed types, the chosen variant's weights."""
    allowed = [f for f in filenames if (f.endswith(spec.ALLOWED_EXTENSIONS) or f == TEMPLATE_FILE)
               and not f.startswith(".") and "/" not in f]
    weights = set(select_weights(allowed, variant))
    return sorted(f for f in allowed if classify(f) is None or f in weights)


def _sibling_record(sibling: Any) -> dict[str, Any]:
    """{size, sha256 (LFS files) or git_sha1} of one ``model_info(files_metadata=True)`` sibling."""
    lfs = sibling.lfs
    sha = (getattr(lfs, "sha256", None) or (lfs.get("sha256") if isinstance(lfs, dict) else None)) \
        if lfs is not None else None
    rec: dict[str, Any] = {"size": sibling.size}
    if sha:
        rec["sha256"] = sha
    elif sibling.blob_id:
        rec["git_sha1"] = sibling.blob_id
    return rec


class _Source:
    """A SPEC's side of the comparison: per component, {filename: record} (records may lack sha256 when
    only the Hub's git id is known) and the revision the records were read at."""

    def __init__(self, spec_: Spec, *, variant: str | None, token: str | bool | None, local_files_only: bool):
        self.spec = spec_
        self.variant = variant
        self.token = token
        self.local_files_only = local_files_only
        self.revision: str | None = spec_.revision
        self._hub: dict[str, dict[str, Any]] | None = None
        self.hub_from: str = ""
        self.model_index: dict[str, Any] | None = None
        # Files of a Hugging Face cache written without symlinks (real files in snapshots/): no blob name
        # gives their hash, so they are hashed, once, when compared (remembered by stat key).
        self.cache_paths: dict[str, Path] = {}

    def hub_files(self) -> dict[str, dict[str, Any]]:
        """{repo path: record} from the Hub's file metadata, or from the local HF cache when offline."""
        if self._hub is not None:
            return self._hub
        problems: list[str] = []
        if not (self.local_files_only or _cache.is_offline() or hub_unreachable()):
            try:
                return self._files_from_hub()
            except Exception as e:  # network, auth, not found: say so; the cache may still know it
                problems.append(f"Hub metadata unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        found = self._files_from_cache(problems)
        if found is not None:
            return found
        rev = self.spec.revision
        problems.append(f"{self.spec.location}" + (f"@{rev}" if rev else "") + " is not in the Hugging Face cache")
        if why := (not (self.local_files_only or _cache.is_offline()) and hub_unreachable()):
            problems.append(f"the Hub cannot be reached ({why})")
        raise HubSourceNotFoundError(f"cannot read the file list of {self.spec}: " + "; ".join(problems),
                                     self.spec.location)

    def _files_from_hub(self) -> dict[str, dict[str, Any]]:
        from huggingface_hub import HfApi

        info = HfApi().model_info(self.spec.location, revision=self.spec.revision, files_metadata=True,
                                  token=self.token)
        files = {s.rfilename: _sibling_record(s) for s in info.siblings or []}
        self._hub, self.revision, self.hub_from = files, info.sha or self.spec.revision, "the Hub's file metadata"
        return files

    def _files_from_cache(self, problems: list[str]) -> dict[str, dict[str, Any]] | None:
        """Records of the cached snapshot: blob names give the hashes (sha256 for LFS files, git blob id
        for the others); files of a cache without links are kept in ``cache_paths``, hashed when compared."""
        for cache in _cache.hf_cache_dirs(None):
            snap = _cache.snapshot_dir(cache, self.spec.location, self.spec.revision)
            if snap is None:
                continue
            files: dict[str, dict[str, Any]] = {}
            for path in sorted(snap.rglob("*")):
                if not path.is_file():
                    continue
                rel = path.relative_to(snap).as_posix()
                name = _cache.blob_name_of(path, snap.parent.parent) or ""  # only a link into its own blobs/
                rec: dict[str, Any] = {"size": path.stat().st_size}
                if len(name) == 64:
                    rec["sha256"] = name
                elif len(name) == 40:
                    rec["git_sha1"] = name
                else:
                    self.cache_paths[rel] = path
                files[rel] = rec
            why = f"; {problems[0]}" if problems else ""
            self._hub, self.revision, self.hub_from = files, snap.name, f"the Hugging Face cache ({snap}{why})"
            return files
        return None

    def component_files(self, sub: str, variant: str | None | Literal[False] = False
                        ) -> tuple[FileRecords, dict[str, Path]] | None:
        """({filename: record}, {filename: local path}) of the source's component folder, None if absent;
        the weights of ``variant`` (False: the pack's)."""
        if variant is not False:
            saved, self.variant = self.variant, variant
            try:
                return self.component_files(sub)
            finally:
                self.variant = saved
        kind = self.spec.kind
        if kind == "folder":
            root = Path(self.spec.location)
            folder = root / sub
            if not folder.is_dir():
                return None
            names = _pack_selection(sorted(e.name for e in os.scandir(folder) if e.is_file()), self.variant)
            return {n: {"size": (folder / n).stat().st_size} for n in names}, {n: folder / n for n in names}
        if kind == "url":  # a hosted archive: its index records, read by range requests (no entry fetched)
            from ..refs.hosted import hosted_member_records

            found = hosted_member_records(self.spec.location, sub, token=self.token)
            if found is None:
                return None
            records, self.model_index = found
            names = _pack_selection(list(records), self.variant)
            return {n: records[n] for n in names}, {}
        if kind == "dduf":
            from ..format.archive import DDUFArchive

            with DDUFArchive(self.spec.location) as archive:
                if sub not in archive.components or not archive.components[sub].files:
                    return None
                names = _pack_selection(list(archive.components[sub].files), self.variant)
                records = {}  # FileRecords, as declared by the hosted branch above
                for n in names:
                    view = archive.view(f"{sub}/{n}")
                    try:
                        rec: dict[str, Any] = {"size": len(view), "sha256": hashlib.sha256(view).hexdigest()}
                        if not _cache.is_lfs_by_default(n, len(view)):
                            rec["git_sha1"] = _cache.git_blob_sha1(bytes(view))
                    finally:
                        view.release()
                    records[n] = rec
                return records, {}
        files = self.hub_files()
        prefix = sub.rstrip("/") + "/"
        records = {p[len(prefix):]: r for p, r in files.items() if p.startswith(prefix) and "/" not in p[len(prefix):]}
        if not records:
            return None
        names = _pack_selection(list(records), self.variant)
        paths = {n: self.cache_paths[prefix + n] for n in names if prefix + n in self.cache_paths}
        return {n: records[n] for n in names}, paths

    def variants(self, sub: str) -> set[str]:
        """The weight variants the source's component folder has (``fp16``, ...)."""
        if self.spec.kind == "folder":
            folder = Path(self.spec.location) / sub
            return variants(e.name for e in os.scandir(folder) if e.is_file()) if folder.is_dir() else set()
        if self.spec.kind == "dduf":
            from ..format.archive import DDUFArchive

            with DDUFArchive(self.spec.location) as archive:
                return variants(archive.components[sub].files) if sub in archive.components else set()
        if self.spec.kind == "hub":
            prefix = sub.rstrip("/") + "/"
            return variants(p[len(prefix):] for p in self.hub_files() if p.startswith(prefix))
        return set()

    def open_copy(self, sub: str, names: Sequence[str]) -> ComponentBytes | None:
        """The bytes of the source's ``sub`` files ``names`` (mapped files, or the archive's entries), or None
        where they are not on this machine (a Hub repo not in the cache, a hosted archive)."""
        where = f"BASE {self.spec}/{sub}"
        if self.spec.kind == "folder":
            folder = Path(self.spec.location) / sub
            return ComponentBytes.from_paths(where, {n: folder / n for n in names})
        if self.spec.kind == "dduf":
            from ..format.archive import DDUFArchive

            archive = DDUFArchive(self.spec.location)
            return ComponentBytes(where, names, lambda n: archive.view(f"{sub}/{n}"), archive.close)
        if self.spec.kind == "hub":
            for cache in _cache.hf_cache_dirs(None):
                snap = _cache.snapshot_dir(cache, self.spec.location, self.revision or self.spec.revision)
                paths = {n: snap / sub / n for n in names} if snap is not None else {}
                if paths and all(p.is_file() for p in paths.values()):
                    return ComponentBytes.from_paths(where, paths)
        return None

    def records(self, found: tuple[FileRecords, dict[str, Path]]) -> FileRecords:
        """What a reference records of the source's files: their records, files at hand hashed (once)."""
        records, paths = found
        if self.spec.kind == "folder":
            return hash_local_files(paths)
        return {**records, **hash_local_files(paths)}

    def type_hint(self, component: str) -> tuple[str | None, str | None] | None:
        """(library, class) the source's model_index.json gives ``component``, when it is at hand."""
        if self.model_index is None:
            raw: bytes | None = None
            try:
                if self.spec.kind == "folder":
                    raw = (Path(self.spec.location) / spec.MODEL_INDEX).read_bytes()
                elif self.spec.kind == "dduf":
                    from ..format.archive import DDUFArchive

                    with DDUFArchive(self.spec.location) as archive:
                        raw = archive.read_bytes(spec.MODEL_INDEX)
            except (OSError, DDUFError):
                raw = None
            try:
                self.model_index = json.loads(raw) if raw else {}
            except ValueError:
                self.model_index = {}
        specs = component_specs(self.model_index) if isinstance(self.model_index, dict) else {}
        return specs.get(component)


def _same_content(name: str, local: FileRecords, local_paths: Mapping[str, Path], other: FileRecords,
                  other_paths: Mapping[str, Path]) -> list[str]:
    """Why the local component differs from ``other`` (empty: every local file is there, same bytes)."""
    hv = _cache.verified_hashes()
    why = []
    for fname, rec in sorted(local.items()):
        o = other.get(fname)
        if o is None:
            why.append(f"{name}/{fname} is not in it")
            continue
        if o.get("size") is not None and o["size"] != rec["size"]:
            why.append(f"{name}/{fname}: {o['size']} bytes there, {rec['size']} here")
            continue
        if fname in other_paths and "sha256" not in o:
            src, dst = other_paths[fname], local_paths.get(fname)
            same_inode = dst is not None and os.path.samefile(src, dst)
            o = {**o, "sha256": rec["sha256"] if same_inode else hv.sha256(src)}
        if o.get("sha256"):
            if o["sha256"] != rec["sha256"]:
                why.append(f"{name}/{fname}: sha256 differs")
        elif o.get("git_sha1"):
            mine = rec.get("git_sha1") or _cache.git_blob_sha1_file(local_paths[fname])
            if o["git_sha1"] != mine:
                why.append(f"{name}/{fname}: git blob id differs")
        else:
            why.append(f"{name}/{fname}: no hash known there")
    return why


def _infer_variant(plan: FolderPlan) -> str | None:
    found = {w.variant for s in plan.sources if (w := classify(s.name.split("/")[-1])) is not None and w.variant}
    return found.pop() if len(found) == 1 else None


# --- the plan --------------------------------------------------------------------------------------------
def make_references(
    plan: FolderPlan,
    *,
    exclude: Sequence[str] = (),
    refs: Mapping[str, str] | None = None,
    base: str | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    variant: str | None = None,
) -> PartialPlan:
    """Turn a folder plan into a partial one.

    Referenced: every component in ``exclude``, every component named in ``refs`` (``{name: SPEC}``), and
    with ``base`` every component whose files are all in BASE's same-named component with the same
    sha256 (and, when BASE's model_index.json is at hand, the same class). An excluded component's source
    is ``refs[name]``, else ``refs["*"]``, else ``base``, else none (the loader then requires it as an
    argument). File records come from the local copy; a component with no local copy gets them from its
    source (Hub file metadata, or the HF cache offline), pinned to the commit they were read at.
    ``variant`` must be the one ``plan`` was made with (inferred from the stored files when None).

    Raises:
        DDUFPackError: unknown component names, a bad SPEC, a source whose copy differs from the local one
            (the reference could never resolve), a BASE that cannot be read.
    """
    refs = dict(refs or {})
    planner = _Planner(plan, token=token, local_files_only=local_files_only)
    planner.check_names(set(exclude), "--exclude")
    planner.check_names(set(refs), "--ref")
    planner.variant = variant if variant is not None else _infer_variant(plan)
    parsed, base_spec = _parse_sources(refs, base)
    for name in sorted(set(exclude) | (set(refs) - {"*"})):
        planner.add_explicit(name, _component_folder_spec(parsed.get(name) or parsed.get("*") or base_spec, name))
    if base_spec is not None:
        planner.add_identical_to_base(base_spec)
    planner.keep_previous_references()
    return planner.finish()


def _component_folder_spec(src: Spec | None, name: str) -> Spec | None:
    """A folder SOURCE that is the component folder itself (``--ref vae=/models/sd15/vae``), by the rule the
    loader applies (:func:`~dduf_plus.refs.resolve.component_folder`), as its parent and subfolder."""
    if src is None or src.kind != "folder" or src.subfolder is not None:
        return src
    root = Path(src.location)
    if root.is_dir() and component_folder(root, [name], direct=True) == root:
        return src._replace(location=str(root.parent), subfolder=root.name)
    return src


class Snapshot(NamedTuple):
    repo: str
    revision: str
    subfolder: str | None  # the path inside the snapshot, when the SOURCE pointed into it


def hf_snapshot(path: str | os.PathLike) -> Snapshot | None:
    """``org/name@commit`` for a folder inside a Hugging Face cache snapshot
    (``.../models--org--name/snapshots/<commit>[/sub]``, what ``snapshot_download`` returns), else None."""
    parts = Path(os.path.abspath(path)).parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--") and _COMMIT.fullmatch(parts[i + 1]):
            repo = parts[i - 1][len("models--"):].replace("--", "/")
            rest = "/".join(parts[i + 2:]) or None
            return Snapshot(repo, parts[i + 1], rest) if repo and repo.count("/") <= 1 else None
    return None


def _parse_sources(refs: Mapping[str, str], base: str | None) -> tuple[dict[str, Spec], Spec | None]:
    """The ``refs`` SPECs and BASE parsed; BASE must be a whole pipeline that exists when it is a path."""
    try:
        parsed = {k: parse_spec(v) for k, v in refs.items()}
        base_spec = parse_spec(base) if base else None
    except DDUFError as e:
        raise DDUFPackError(str(e)) from None
    if base_spec is not None and base_spec.subfolder:
        raise DDUFPackError(f"--base {base!r}: BASE is a whole pipeline; give no :SUBFOLDER")
    if base_spec is not None and base_spec.kind in ("folder", "dduf") and not os.path.exists(base_spec.location):
        # BASE is compared with here and now: a missing path is a mistake, never "nothing in common"
        raise DDUFNotFoundError(f"--base {base!r}: {base_spec.location} does not exist", filename=base_spec.location)
    return parsed, base_spec


def reference_record(name: str, type_hint: tuple[str | None, str | None], src: Spec | None, files: FileRecords,
                     revision: str | None, variant: str | None, local_paths: set[str]) -> dict[str, Any]:
    """The reference of component ``name`` to ``src`` recording ``files``; a machine-bound source (a folder or
    .dduf outside the Hugging Face cache) is added to ``local_paths`` (the pack warns about those)."""
    library, cls = type_hint
    sub = (src.subfolder if src else None) or name
    has_variant = variant is not None and any((w := classify(f)) and w.variant == variant for f in files)
    location = None if src is None else src.location
    snap = hf_snapshot(src.location) if src is not None and src.kind == "folder" else None
    if snap is not None and src is not None:  # a folder in the HF cache is its repo at its commit: it travels
        location, revision = snap.repo, snap.revision
        sub = "/".join(p for p in (snap.subfolder, src.subfolder) if p) or name
    elif src is not None and src.kind in ("folder", "dduf"):
        local_paths.add(src.location)
    return {
        "pretrained_model_name_or_path": location,
        "subfolder": sub,
        "revision": revision,
        "variant": variant if has_variant else None,
        "type_hint": [library, cls],
        "files": files,
    }


def compare_with_source(source: _Source, variant: str | None, sub: str, found: tuple[FileRecords, dict[str, Path]],
                        mine: ComponentCopy, type_hint: tuple[str | None, str | None],
                        by_hashes: Callable[[], tuple[str, BaseMatch | None]] | None) -> tuple[str, BaseMatch | None]:
    """``mine`` against the source's ``sub`` (its ``found`` files): by content where the source's bytes are on this
    machine (its other weight variants tried when only the weights differ), else ``by_hashes()``. Returns
    (why not, None) or ("", what a reference records)."""
    theirs = source.open_copy(sub, list(found[0]))
    if theirs is None:
        return by_hashes() if by_hashes is not None else ("its files are not on this machine to compare", None)
    library, cls = type_hint
    others = sorted((source.variants(sub) | {None}) - {variant}, key=str)
    try:
        with theirs:
            first = component_difference(mine, theirs, library=library, cls=cls)
        if first is None:
            return "", BaseMatch(source.records(found), variant, "same content")
        for other in others if first.in_weights else []:
            at = source.component_files(sub, other)
            copy = source.open_copy(sub, list(at[0])) if at is not None else None
            if at is None or copy is None:
                continue
            with copy:
                if component_difference(mine, copy, library=library, cls=cls) is None:
                    return "", BaseMatch(source.records(at), other, "same content")
    except DDUFError as e:  # a weight file that is no valid safetensors (either side): never the same
        return f"cannot be compared: {e}", None
    why = first.text
    if first.dtype_only:  # say what would help
        why += f"; compared with its {', '.join(str(v) for v in others if v)} variant too" if any(others) else \
            "; it has no other variant: pack in its precision"
    return why, None


class BaseComparer:
    """BASE (a folder, a .dduf, a Hub repo) as the other side of content comparisons of components that are not
    in a folder (``save_dduf(pipeline, path, base=BASE)``): what to reference, or why to store."""

    def __init__(self, base: str, *, variant: str | None = None, token: str | bool | None = None,
                 local_files_only: bool = False):
        spec_ = _parse_sources({}, base)[1]
        assert spec_ is not None
        self.spec, self.variant = spec_, variant
        self.source = _Source(spec_, variant=variant, token=token, local_files_only=local_files_only)
        self.local_paths: set[str] = set()

    def reference_for(self, name: str, type_hint: tuple[str | None, str | None],
                      mine: ComponentCopy) -> tuple[str, dict[str, Any] | None]:
        """("", the reference) when ``mine`` is BASE's ``name`` by content, else (why not, None)."""
        found = self.source.component_files(name)
        if found is None:
            return f"BASE {self.spec} has no {name}/", None
        hint = self.source.type_hint(name)
        if hint is not None and tuple(hint) != tuple(type_hint):
            return f"BASE's is {hint[0]}.{hint[1]}, this one {type_hint[0]}.{type_hint[1]}", None
        why, match = compare_with_source(self.source, self.variant, name, found, mine, type_hint, None)
        if match is None:
            return f"differs from BASE {self.spec} ({why})", None
        return "", reference_record(name, type_hint, self.spec, match.files, self.source.revision, match.variant,
                                    self.local_paths)


class _Planner:
    """The state of one :func:`make_references` run: what is stored, what is referenced so far, the report."""

    def __init__(self, plan: FolderPlan, *, token: str | bool | None, local_files_only: bool):
        self.plan, self.root = plan, plan.folder
        self.token, self.local_files_only = token, local_files_only
        self.variant: str | None = None
        self.specs = component_specs(plan.model_index)
        self.real = {n for n, (lib, _c) in self.specs.items() if lib is not None}
        self.stored: dict[str, list[EntrySource]] = {}
        for s in plan.sources:
            self.stored.setdefault(s.name.split("/")[0], []).append(s)
        self.report: list[str] = []
        self.local_paths: set[str] = set()  # machine-bound sources recorded (said so in the report)
        self.references: dict[str, dict[str, Any]] = {}
        self.local_bytes: dict[str, int] = {}
        self._sources: dict[Spec, _Source] = {}

    def check_names(self, names: set[str], what: str = "--exclude/--ref") -> None:
        check_names(sorted(names), self.real, what=what, where=str(self.root / spec.MODEL_INDEX),
                    error=PackNameError, wildcards=("*",))

    def source_for(self, s: Spec) -> _Source:
        key = s._replace(subfolder=None)
        if key not in self._sources:
            self._sources[key] = _Source(key, variant=self.variant, token=self.token,
                                         local_files_only=self.local_files_only)
        return self._sources[key]

    def local_copy(self, name: str) -> dict[str, Path] | None:
        """{filename: path} of the component's files here (the ones the pack would store), None if absent."""
        if name in self.stored:
            chosen = self.stored[name]
        elif (self.root / name).is_dir():
            chosen, _skipped = _plan_component(self.root, name, self.variant)
        else:
            return None
        files = {s.name.split("/", 1)[1]: s.path for s in chosen if s.path is not None}
        for s in chosen:  # a folded tokenizer_config.json: the files on disk are what a reference names
            if s.folded is not None:
                files.update(s.folded.originals)
        return files

    def reference(self, name: str, src: Spec | None, files: FileRecords, revision: str | None,
                  variant: str | None | Literal[False] = False) -> dict[str, Any]:
        return reference_record(name, self.specs[name], src, files, revision,
                                self.variant if variant is False else variant, self.local_paths)

    # --- explicit references (--exclude, --ref) ----------------------------------------------------------
    def add_explicit(self, name: str, src: Spec | None) -> None:
        paths = self.local_copy(name)
        revision = src.revision if src else None
        if paths is not None and _nested(paths):
            raise DDUFPackError(f"{name} cannot be referenced: {_nested(paths)[0]} is in a sub-folder, which a "
                                "reference cannot name; store it (drop --exclude/--ref for it)")
        variant: str | None | Literal[False] = False
        if paths is not None:
            self.local_bytes[name] = sum(p.stat().st_size for p in paths.values())
            files, origin = hash_local_files(paths), "hashes of the local copy"
            if src is not None:
                checked = self._check_against_source(name, src, paths)
                if checked is not None:
                    match, revision = checked
                    files, variant, origin = match.files, match.variant, f"{match.how} as the source"
        elif src is not None:
            files, revision, origin = self._records_from_source(name, src)
        else:
            files, origin = {}, "no local copy: nothing to verify"
        self.references[name] = self.reference(name, src, files, revision, variant)
        where = str(src) if src is not None else "no source (must be passed to load_dduf as an argument)"
        self.report.append(f"referenced {name} -> {where} ({_files(len(files))}, "
                           f"{_human(self.local_bytes.get(name, 0))}; {origin})")

    def _records_from_source(self, name: str, src: Spec) -> tuple[FileRecords, str | None, str]:
        """No local copy: the file records (and the revision they were read at) come from the source."""
        source = self.source_for(src)
        found = source.component_files(src.subfolder or name)
        if found is None:
            raise DDUFPackError(f"{name}: no local copy in {self.root} and {src} has no {src.subfolder or name}/ folder")
        files = {**found[0], **hash_local_files(found[1])}  # files on disk are hashed here (once)
        origin = f"hashes from {source.hub_from or src}"
        if any("sha256" not in r for r in files.values()):
            origin += "; small non-LFS files are verified by size and git blob id after download"
        return files, source.revision, origin

    # --- components identical to BASE -------------------------------------------------------------------
    def add_identical_to_base(self, base_spec: Spec) -> None:
        source = self.source_for(base_spec)
        if base_spec.kind == "hub":
            source.hub_files()  # fetched once; the report says where it came from
            self.report.append(f"BASE {base_spec}: file list from {source.hub_from} at {source.revision}")
        for name in sorted(self.real - set(self.references)):
            paths = self.local_copy(name)
            if paths is None:
                continue
            nested = _nested(paths)
            why, match = ((f"{nested[0]} is in a sub-folder, which a reference cannot name", None) if nested
                          else self._match_base(name, paths, source, base_spec))
            if match is None:
                self.report.append(f"stored {name}: {why}")
                continue
            self.local_bytes[name] = sum(p.stat().st_size for p in paths.values())
            self.references[name] = self.reference(name, base_spec, match.files, source.revision, match.variant)
            variant = f", BASE's {match.variant} variant" if match.variant and match.variant != self.variant else ""
            self.report.append(f"referenced {name} -> {base_spec} ({match.how}{variant}: {_files(len(match.files))} "
                               f"there, {_human(self.local_bytes[name])} here)")

    def _match_base(self, name: str, paths: Mapping[str, Path], source: _Source,
                    base_spec: Spec) -> tuple[str, BaseMatch | None]:
        """(why not, None) or ("", what the reference records): the local ``name`` against BASE's ``name``."""
        found = source.component_files(name)
        if found is None:
            return f"BASE {base_spec} has no {name}/", None
        hint = source.type_hint(name)
        if hint is not None and tuple(hint) != tuple(self.specs[name]):
            return f"BASE's is {hint[0]}.{hint[1]}, this one {self.specs[name][0]}.{self.specs[name][1]}", None
        why, match = self.compare(name, paths, source, name, found)
        return (f"differs from BASE {base_spec} ({why})" if match is None else ""), match

    def compare(self, name: str, paths: Mapping[str, Path], source: _Source, sub: str,
                found: tuple[FileRecords, dict[str, Path]]) -> tuple[str, BaseMatch | None]:
        """The local copy of ``name`` against the source's ``sub`` (:func:`compare_with_source`; by the file
        hashes where the source's bytes are not on this machine)."""
        with ComponentBytes.from_paths(name, paths) as mine:
            return compare_with_source(source, self.variant, sub, found, mine, self.specs[name],
                                       lambda: self._compare_hashes(name, paths, found))

    def _compare_hashes(self, name: str, paths: Mapping[str, Path],
                        found: tuple[FileRecords, dict[str, Path]]) -> tuple[str, BaseMatch | None]:
        files = hash_local_files(paths)
        why = _same_content(name, files, paths, found[0], found[1])
        if why:
            return (f"{why[0]}" + (", ..." if len(why) > 1 else "") + "; compared by file hashes: its files are not "
                    "on this machine to compare by content"), None
        return "", BaseMatch(files, self.variant, "identical bytes")

    def _check_against_source(self, name: str, src: Spec, paths: Mapping[str, Path]) -> tuple[BaseMatch, str | None] | None:
        """Refuse a reference that could never resolve: SPEC's copy is not the local one by content. Returns what
        the reference records and the revision it was compared at, or None (a Hub source that cannot be read
        now: noted, the local copy's hashes recorded)."""
        source, sub = self.source_for(src), src.subfolder or name
        try:
            found = source.component_files(sub)
        except DDUFPackError as e:
            if src.kind != "hub":
                raise
            self.report.append(f"note: {name} not compared with {src} ({e})")
            return None
        if found is None:
            raise DDUFPackError(f"--ref for {name}: {src if src.kind == 'hub' else src.location} has no {sub}/ folder")
        why, match = self.compare(name, paths, source, sub, found)
        if match is None:
            raise DDUFPackError(f"{name} differs from its reference {src}: {why}. The reference could never "
                                f"resolve: store {name} (drop --exclude) or point --ref at a source holding this copy")
        return match, (source.revision if src.kind == "hub" else src.revision)

    # --- the rest ---------------------------------------------------------------------------------------
    def keep_previous_references(self) -> None:
        """References the source model_index already carried (a re-pack of a partial archive)."""
        previous = self.plan.model_index.get(spec.REFERENCES_KEY)
        if not isinstance(previous, dict):
            return
        for name, ref in previous.items():
            if name in self.real and name not in self.references and name not in self.stored and isinstance(ref, dict):
                self.references[name] = ref
                self.report.append(f"kept the existing reference of {name}")

    def finish(self) -> PartialPlan:
        plan, references = self.plan, self.references
        referenced = set(references)
        sources = [s for s in plan.sources if s.name.split("/")[0] not in referenced]
        skipped = list(plan.skipped) + [Skipped(f"{n}/", "referenced") for n in sorted(referenced) if n in self.stored]
        saved = sum(self.local_bytes.values())
        total = sum(s.nbytes for s in plan.sources) + sum(b for n, b in self.local_bytes.items() if n not in self.stored)
        if references:
            pct = f" ({100.0 * saved / total:.1f}% of the component files)" if total else ""
            self.report.append(f"bytes saved: {saved} ({_human(saved)}){pct} by referencing {len(references)} "
                               f"component{'s' if len(references) != 1 else ''}")
        else:
            self.report.append("nothing referenced: the archive is complete")
        warn_local_paths(self.local_paths)
        model_index, raw = _model_index_with(plan, references)
        return PartialPlan(model_index, raw, sources, skipped, references, self.report, saved, self.root)


def warn_local_paths(paths: set[str]) -> None:
    """A warning (stderr, seen with --quiet and --json too) per machine-bound path references record."""
    for path in sorted(paths):
        logger.warning("references record the local path %s: recipients need the same files (found by content "
                       "in their Hugging Face cache, or given with --ref/refs=); for an archive that travels, "
                       "reference the Hub repo this copy came from (--base org/repo)", path)


def _nested(paths: Mapping[str, Path]) -> list[str]:
    """Files of a component in a sub-folder (``additional_chat_templates/NAME.jinja``, folded when stored)."""
    return sorted(f for f in paths if "/" in f)


def _model_index_with(plan: FolderPlan, references: Mapping[str, Any]) -> tuple[dict[str, Any], bytes]:
    return model_index_with(plan.model_index, plan.model_index_bytes, references)


def model_index_with(source: Mapping[str, Any], source_bytes: bytes,
                     references: Mapping[str, Any]) -> tuple[dict[str, Any], bytes]:
    """model_index.json with the references, in diffusers' canonical form; keeps the source text when it
    was not canonical, so ``complete`` can restore it exactly. No references: the source bytes as they are."""
    original = {k: v for k, v in source.items() if k not in (spec.REFERENCES_KEY, ORIGINAL_MODEL_INDEX_KEY)}
    if not references:
        if spec.REFERENCES_KEY in source:
            return original, canonical_model_index_bytes(original)
        return dict(source), source_bytes
    model_index = dict(original)
    model_index[spec.REFERENCES_KEY] = {n: references[n] for n in sorted(references)}
    if source_bytes != canonical_model_index_bytes(original) and spec.REFERENCES_KEY not in source:
        try:
            text = source_bytes.decode("utf-8")
        except UnicodeDecodeError:
            logger.info("model_index.json is not UTF-8: dduf complete will write it in canonical form")
        else:
            model_index[ORIGINAL_MODEL_INDEX_KEY] = {"sha256": hashlib.sha256(source_bytes).hexdigest(), "text": text}
    return model_index, canonical_model_index_bytes(model_index)


def pack_partial(
    folder: str | os.PathLike,
    output: str | os.PathLike,
    *,
    exclude: Sequence[str] = (),
    refs: Mapping[str, str] | None = None,
    base: str | None = None,
    variant: str | None = None,
    quiet: bool = False,
    token: str | bool | None = None,
    local_files_only: bool = False,
) -> PackResult:
    """Pack ``folder`` storing references instead of excluded / BASE-identical components.

    Example:
        >>> pack_partial("my-finetune", "ft.dduf", base="stable-diffusion-v1-5/stable-diffusion-v1-5")

    The report (what was referenced, bytes saved) is logged at INFO on the ``dduf_plus`` logger.

    Raises:
        DDUFPackError: see :func:`plan_folder` and :func:`make_references`.
    """
    started = time.perf_counter()
    named = [n for n in (refs or {}) if n != "*"]
    mi_path = Path(folder) / spec.MODEL_INDEX
    if named and mi_path.is_file():  # a refs= typo is named as one (plan_folder would call it an --exclude)
        specs = component_specs(model_index_object(mi_path.read_bytes(), str(mi_path), DDUFPackError))
        check_names(named, specs, what="--ref", where=str(mi_path), error=PackNameError)
    plan = plan_folder(folder, variant=variant, exclude=sorted(set(exclude) | set(named)))
    partial = make_references(plan, exclude=exclude, refs=refs, base=base, token=token,
                              local_files_only=local_files_only, variant=variant)
    for line in partial.report:
        logger.info("%s", line)
    result = write_archive(output, partial.model_index, partial.model_index_bytes, partial.sources,
                           skipped=partial.skipped, references=partial.references or None, quiet=quiet)
    return result._replace(seconds=time.perf_counter() - started)
