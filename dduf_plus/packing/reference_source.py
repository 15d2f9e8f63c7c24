"""A reference's source as one side of a comparison: its component files and their records (size, sha256, git
blob id), from a folder, a ``.dduf``, a hosted archive, the Hub's file metadata or the Hugging Face cache; their
bytes where they are on this machine; and the comparison of a local copy with them, by content
(:mod:`.identity`) or, where the bytes are elsewhere, by file hashes. No torch here."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Literal, NamedTuple

from ..errors import DDUFError, DDUFPackError
from ..format import spec
from ..format.chat_template import TEMPLATE_FILE
from ..format.json_budget import parse_json_entry
from ..format.pack import FileRegion, LocalFile, file_size
from ..format.structure import component_specs
from ..format.weights import classify, select_weights, variants
from ..refs import cache as _cache
from ..refs.resolve import Spec
from ..remote.hub import HubSourceNotFoundError, cache_only, hub_unreachable
from ..storage.hub_env import is_offline
from .identity import ComponentBytes, ComponentCopy, component_difference

FileRecords = dict[str, dict[str, Any]]


class BaseMatch(NamedTuple):
    """A local component found to be a source's: what its reference records."""

    files: FileRecords  # the source's files (the loader verifies them by these)
    variant: str | None  # the source's weight variant that matched
    how: str  # "identical bytes" or "same content" (re-serialized: other bytes, same tensors and settings)


# --- file identities -------------------------------------------------------------------------------------
def hash_local_files(files: Mapping[str, LocalFile]) -> FileRecords:
    """{filename: {size, sha256[, git_sha1]}} of local files (or an archive's entries); sha256 through the
    verified-hash memory, so packing a fine-tune and loading it later on the same machine hash each referenced
    file once."""
    hv = _cache.verified_hashes()
    out: FileRecords = {}
    for fname, path in sorted(files.items()):
        size = file_size(path)
        rec: dict[str, Any] = {"size": size, "sha256": region_sha256(path) if isinstance(path, FileRegion)
                               else hv.sha256(path)}
        if not _cache.is_lfs_by_default(fname, size):
            rec["git_sha1"] = _git_sha1(path)
        out[fname] = rec
    return out


def _git_sha1(file: LocalFile) -> str:
    return _cache.git_blob_sha1(file.read_bytes()) if isinstance(file, FileRegion) else _cache.git_blob_sha1_file(file)


def region_sha256(region: FileRegion) -> str:
    """sha256 of an archive's entry, through the verified-hash memory (``<archive>#<entry>``), checked against
    the sha256 that archive's index records (H002: a copy that is not what its archive says is never recorded)."""
    def hashed() -> str:
        digest, done = hashlib.sha256(), 0
        with open(region.path, "rb") as f:
            while done < region.length:
                chunk = os.pread(f.fileno(), min(16 << 20, region.length - done), region.offset + done)
                if not chunk:
                    raise DDUFPackError(f"{region}: the file ends inside the entry (it changed)")
                digest.update(chunk)
                done += len(chunk)
        return digest.hexdigest()

    known = _cache.verified_hashes().remembered(region.path, hashed, region.member)
    if region.sha256 is not None and known != region.sha256:
        raise DDUFPackError(f"{region}: H002: sha256 of its bytes differs from its dduf_plus index's (damaged or "
                            "changed)")
    return known


def _hex_sha256(data: memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _archive_records(path: Path, sub: str, variant: str | None) -> tuple[FileRecords, dict[str, Path]] | None:
    """The records of component ``sub`` of the archive at ``path``: each entry's sha256 through the verified-hash
    memory (``<archive>#<entry>``, as :func:`region_sha256` keeps it), so packing against the same BASE archive
    again hashes nothing; small files' git blob id as well."""
    from ..format.archive import DDUFArchive

    hv = _cache.verified_hashes()
    with DDUFArchive(path) as archive:
        if sub not in archive.components or not archive.components[sub].files:
            return None
        before = _cache.stat_key(path)
        records: FileRecords = {}
        for n in pack_selection(list(archive.components[sub].files), variant):
            entry = f"{sub}/{n}"
            view = archive.view(entry)
            try:  # mapped at open: an archive written since then is not remembered
                sha = hv.remembered(path, partial(_hex_sha256, view), entry, since=before)
                rec: dict[str, Any] = {"size": len(view), "sha256": sha}
                if not _cache.is_lfs_by_default(n, len(view)):
                    rec["git_sha1"] = _cache.git_blob_sha1(bytes(view))
            finally:
                view.release()
            records[n] = rec
        return records, {}


def pack_selection(filenames: Sequence[str], variant: str | None) -> list[str]:
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


class ReferenceSource:
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
        if not cache_only(self.local_files_only):
            try:
                return self._files_from_hub()
            except Exception as e:  # network, auth, not found: say so; the cache may still know it
                problems.append(f"Hub metadata unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        found = self._files_from_cache(problems)
        if found is not None:
            return found
        rev = self.spec.revision
        problems.append(f"{self.spec.location}" + (f"@{rev}" if rev else "") + " is not in the Hugging Face cache")
        if why := (not is_offline(self.local_files_only) and hub_unreachable()):
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
            names = pack_selection(sorted(e.name for e in os.scandir(folder) if e.is_file()), self.variant)
            return {n: {"size": (folder / n).stat().st_size} for n in names}, {n: folder / n for n in names}
        if kind == "url":  # a hosted archive: its index records, read by range requests (no entry fetched)
            from ..refs.hosted import hosted_member_records

            found = hosted_member_records(self.spec.location, sub, token=self.token)
            if found is None:
                return None
            records, self.model_index = found
            names = pack_selection(list(records), self.variant)
            return {n: records[n] for n in names}, {}
        if kind == "dduf":
            return _archive_records(Path(self.spec.location), sub, self.variant)
        files = self.hub_files()
        prefix = sub.rstrip("/") + "/"
        records = {p[len(prefix):]: r for p, r in files.items() if p.startswith(prefix) and "/" not in p[len(prefix):]}
        if not records:
            return None
        names = pack_selection(list(records), self.variant)
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
            value = parse_json_entry(raw, spec.MODEL_INDEX)[0] if raw else None  # BASE's: within its budget
            self.model_index = value if isinstance(value, dict) else {}
        specs = component_specs(self.model_index) if isinstance(self.model_index, dict) else {}
        return specs.get(component)


def same_file_hashes(name: str, local: FileRecords, local_paths: Mapping[str, LocalFile], other: FileRecords,
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
            same_inode = isinstance(dst, Path) and os.path.samefile(src, dst)
            o = {**o, "sha256": rec["sha256"] if same_inode else hv.sha256(src)}
        if o.get("sha256"):
            if o["sha256"] != rec["sha256"]:
                why.append(f"{name}/{fname}: sha256 differs")
        elif o.get("git_sha1"):
            mine = rec.get("git_sha1") or _git_sha1(local_paths[fname])
            if o["git_sha1"] != mine:
                why.append(f"{name}/{fname}: git blob id differs")
        else:
            why.append(f"{name}/{fname}: no hash known there")
    return why


def compare_with_source(source: ReferenceSource, variant: str | None, sub: str, found: tuple[FileRecords, dict[str, Path]],
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
