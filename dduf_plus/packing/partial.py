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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from ..assignments import PackNameError, check_names
from ..errors import DDUFError, DDUFNotFoundError, DDUFPackError
from ..format import spec
from ..format.pack import (
    EntrySource,
    FolderPlan,
    LocalFile,
    PackResult,
    Skipped,
    file_size,
    plan_component,
    plan_folder,
    write_archive,
)
from ..format.references import is_local_path
from ..format.structure import component_specs, model_index_object
from ..format.weights import classify
from ..refs.resolve import Spec, component_folder, parse_ref_args, parse_spec
from ..sizes import format_size
from .identity import ComponentBytes, ComponentCopy
from .reference_source import (
    BaseMatch,
    FileRecords,
    ReferenceSource,
    compare_with_source,
    hash_local_files,
    same_file_hashes,
)
from .tensor_records import reference_tensors

logger = logging.getLogger(__name__)

__all__ = ["ORIGINAL_MODEL_INDEX_KEY", "BaseComparer", "PartialPlan", "make_references", "pack_partial",
           "parse_ref_args", "canonical_model_index_bytes", "model_index_with", "warn_local_paths"]

# Set only when the source model_index.json is not in diffusers' canonical form: its exact text, so that
# ``dduf complete`` can restore it and equal a direct full pack byte for byte.
ORIGINAL_MODEL_INDEX_KEY = "_dduf_plus_original_model_index"

_COMMIT = re.compile(r"[0-9a-f]{40}")


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
                     revision: str | None, variant: str | None, local_paths: set[str],
                     local: Mapping[str, LocalFile] | None = None) -> dict[str, Any]:
    """The reference of component ``name`` to ``src`` recording ``files``; a machine-bound source (a folder or
    .dduf outside the Hugging Face cache) is added to ``local_paths`` (the pack warns about those). The digest
    of its tensors (how app model folders find it) comes from the source's bytes where they are on this
    machine, else from ``local``, the copy found identical to them."""
    library, cls = type_hint
    sub = (src.subfolder if src else None) or name
    has_variant = variant is not None and any((w := classify(f)) and w.variant == variant for f in files)
    location = None if src is None else src.location
    found_by = reference_tensors(src, sub, files, revision, local)  # app model folders find it by this
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
        **found_by,
    }


class BaseComparer:
    """BASE (a folder, a .dduf, a Hub repo) as the other side of content comparisons of components that are not
    in a folder (``save_dduf(pipeline, path, base=BASE)``): what to reference, or why to store."""

    def __init__(self, base: str, *, variant: str | None = None, token: str | bool | None = None,
                 local_files_only: bool = False):
        spec_ = _parse_sources({}, base)[1]
        assert spec_ is not None
        self.spec, self.variant = spec_, variant
        self.source = ReferenceSource(spec_, variant=variant, token=token, local_files_only=local_files_only)
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
        self._sources: dict[Spec, ReferenceSource] = {}

    def check_names(self, names: set[str], what: str = "--exclude/--ref") -> None:
        check_names(sorted(names), self.real, what=what, where=str(self.root / spec.MODEL_INDEX),
                    error=PackNameError, wildcards=("*",))

    def source_for(self, s: Spec) -> ReferenceSource:
        key = s._replace(subfolder=None)
        if key not in self._sources:
            self._sources[key] = ReferenceSource(key, variant=self.variant, token=self.token,
                                         local_files_only=self.local_files_only)
        return self._sources[key]

    def local_copy(self, name: str) -> dict[str, LocalFile] | None:
        """{filename: path} of the component's files here (the ones the pack would store), None if absent; for an
        archive's plan, regions of the archive (its entries)."""
        if name in self.stored:
            chosen = self.stored[name]
        elif self.plan.held is not None:
            if not self.plan.held.get(name):
                return None
            chosen = self.plan.held[name]
        elif (self.root / name).is_dir():
            chosen, _skipped = plan_component(self.root, name, self.variant)
        else:
            return None
        files: dict[str, LocalFile] = {s.name.split("/", 1)[1]: s.file for s in chosen if s.file is not None}
        for s in chosen:  # a folded tokenizer_config.json: the files on disk are what a reference names
            if s.folded is not None:
                files.update(s.folded.originals)
        return files

    def reference(self, name: str, src: Spec | None, files: FileRecords, revision: str | None,
                  variant: str | None | Literal[False] = False) -> dict[str, Any]:
        return reference_record(name, self.specs[name], src, files, revision,
                                self.variant if variant is False else variant, self.local_paths,
                                self.local_copy(name))

    # --- explicit references (--exclude, --ref) ----------------------------------------------------------
    def add_explicit(self, name: str, src: Spec | None) -> None:
        paths = self.local_copy(name)
        revision = src.revision if src else None
        if paths is not None and _nested(paths):
            raise DDUFPackError(f"{name} cannot be referenced: {_nested(paths)[0]} is in a sub-folder, which a "
                                "reference cannot name; store it (drop --exclude/--ref for it)")
        variant: str | None | Literal[False] = False
        if paths is not None:
            self.local_bytes[name] = sum(map(file_size, paths.values()))
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
                           f"{format_size(self.local_bytes.get(name, 0))}; {origin})")

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
            self.local_bytes[name] = sum(map(file_size, paths.values()))
            self.references[name] = self.reference(name, base_spec, match.files, source.revision, match.variant)
            variant = f", BASE's {match.variant} variant" if match.variant and match.variant != self.variant else ""
            self.report.append(f"referenced {name} -> {base_spec} ({match.how}{variant}: {_files(len(match.files))} "
                               f"there, {format_size(self.local_bytes[name])} here)")

    def _match_base(self, name: str, paths: Mapping[str, LocalFile], source: ReferenceSource,
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

    def compare(self, name: str, paths: Mapping[str, LocalFile], source: ReferenceSource, sub: str,
                found: tuple[FileRecords, dict[str, Path]]) -> tuple[str, BaseMatch | None]:
        """The local copy of ``name`` against the source's ``sub`` (:func:`compare_with_source`; by the file
        hashes where the source's bytes are not on this machine)."""
        with ComponentBytes.from_paths(name, paths) as mine:
            return compare_with_source(source, self.variant, sub, found, mine, self.specs[name],
                                       lambda: self._compare_hashes(name, paths, found))

    def _compare_hashes(self, name: str, paths: Mapping[str, LocalFile],
                        found: tuple[FileRecords, dict[str, Path]]) -> tuple[str, BaseMatch | None]:
        files = hash_local_files(paths)
        why = same_file_hashes(name, files, paths, found[0], found[1])
        if why:
            return (f"{why[0]}" + (", ..." if len(why) > 1 else "") + "; compared by file hashes: its files are not "
                    "on this machine to compare by content"), None
        return "", BaseMatch(files, self.variant, "identical bytes")

    def _check_against_source(self, name: str, src: Spec, paths: Mapping[str, LocalFile]) -> tuple[BaseMatch, str | None] | None:
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
                source = ref.get("pretrained_model_name_or_path")
                if isinstance(source, str) and is_local_path(source):
                    self.local_paths.add(source)

    def finish(self) -> PartialPlan:
        plan, references = self.plan, self.references
        referenced = set(references)
        sources = [s for s in plan.sources if s.name.split("/")[0] not in referenced]
        skipped = list(plan.skipped) + [Skipped(f"{n}/", "referenced") for n in sorted(referenced) if n in self.stored]
        saved = sum(self.local_bytes.values())
        total = sum(s.nbytes for s in plan.sources) + sum(b for n, b in self.local_bytes.items() if n not in self.stored)
        if references:
            pct = f" ({100.0 * saved / total:.1f}% of the component files)" if total else ""
            self.report.append(f"bytes saved: {saved} ({format_size(saved)}){pct} by referencing {len(references)} "
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


def _nested(paths: Mapping[str, LocalFile]) -> list[str]:
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
    if isinstance(source.get(ORIGINAL_MODEL_INDEX_KEY), dict):  # a partial re-packed: the text it recorded stays
        model_index[ORIGINAL_MODEL_INDEX_KEY] = source[ORIGINAL_MODEL_INDEX_KEY]
    elif source_bytes != canonical_model_index_bytes(original) and spec.REFERENCES_KEY not in source:
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
