"""A diffusers pipeline folder (or a Hub folder repo's snapshot) as ``load_dduf`` sees an archive.

:class:`FolderPipeline` scans the folder once and presents what an archive packed from it would hold
(``model_index.json`` and, per component named there, its files of the types DDUF allows: configs, tokenizer
files, safetensors weights), so the one loader in ``pipeline.py`` builds it: the same dtype rules
(``torch_dtype="auto"`` from the safetensors headers), zero-copy views of each weight file's memory map
(``FolderComponentFiles``), the precision bridge, the same class rules and the same refusals with the same
rule codes (``load_findings``' checks run on the folder's files: D007, D011, D013, D014, D015).

Untrusted like an archive: ``model_index.json`` and every config go through the budgeted JSON reader; a file
whose real path leaves the folder (a symlink to ``/etc`` or to another tree) is refused (Z008, the rule for an
archive entry escaping the archive); files of other kinds (pickles, ONNX, READMEs, hidden files, sub-folders)
are never read, as ``dduf pack`` never stores them. In a Hugging Face cache snapshot
(``models--org--name/snapshots/<commit>``) files are links into the repo's ``blobs/``: the repo's cache
folder is the boundary there."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple, cast

from ..errors import DDUFIOError, DDUFNotFoundError, DDUFValidationError
from ..format import spec
from ..format.archive import Component
from ..format.findings import Finding, finding
from ..format.json_budget import over_size, read_json
from ..format.pipeline_kinds import LIST_LIBRARY, alias_config, list_owners, part_name
from ..format.source_folder import boundary_of, escape_message, is_inside
from ..format.tokenizer_budget import budget_findings
from ..format.validate import json_entry_findings
from ..storage.confined import component_name_problem, name_problem
from ..storage.fd_io import open_regular
from .files import FolderComponentFiles, materialize_files, small_files

logger = logging.getLogger(__name__)


FOLDER = "pipeline folder"  # what a folder is called in a DDUFValidationError ("is not a valid ...")


class FolderEntry(NamedTuple):
    """One file of the folder as an archive entry: what validate's entry checks read."""

    name: str  # "unet/config.json"
    length: int
    path: Path  # the real path (inside the folder's boundary)
    offset: int = 0


class FolderPipeline:
    """A diffusers pipeline folder with the attributes the loader reads from a :class:`DDUFArchive`.

    Raises:
        DDUFNotFoundError: ``root`` has no ``model_index.json``.
        DDUFValidationError: ``model_index.json`` over its budget or not a JSON object (D013, D002), or a
            component's file escaping the folder (Z008).
    """

    mmap = None  # per-file maps (FolderComponentFiles): no archive-wide read-ahead
    index = None  # no dduf_plus index: a folder records no hashes
    stored_index = None
    references: dict[str, Any] = {}  # a folder stores every component it names, or lacks it

    def __init__(self, root: str | os.PathLike, display: str | None = None):
        self.root = Path(root)
        self.path = display or os.fspath(root)  # messages and the pipeline's _name_or_path
        self._boundary = boundary_of(self.root)
        self.problems: list[Finding] = []
        mi = self.root / spec.MODEL_INDEX
        if not mi.is_file():
            raise DDUFNotFoundError(f"{self.path}: no {spec.MODEL_INDEX} (not a diffusers pipeline folder)", str(mi))
        mi_entry = self._entry(spec.MODEL_INDEX, mi)
        if self.problems:
            raise DDUFValidationError(self.path, self.problems, kind=FOLDER)
        self.entries: dict[str, FolderEntry] = {spec.MODEL_INDEX: mi_entry}
        self.model_index = self._model_index(mi_entry)
        self.components: dict[str, Component] = {}
        for name, value in self.model_index.items():
            if name.startswith("_") or not (isinstance(value, list) and len(value) == 2):
                continue
            library, class_name = value
            files = self._scan_component(name) if library is not None else ()
            self.components[name] = Component(name, library, class_name, files, None)
        self._scan_list_parts()
        if any(p.code == "Z008" for p in self.problems):
            raise DDUFValidationError(self.path, self.problems, kind=FOLDER)  # before a byte of such a file is read

    def _scan_list_parts(self) -> None:
        """A list component's further folders (``controlnet_1``...: diffusers' Multi-ControlNet layout, which
        model_index.json does not name), as the archive packed from the folder names them."""
        for owner, part_class in list_owners(self.model_index).items():
            index = 1
            while part_name(owner, index) not in self.components and (self.root / part_name(owner, index)).is_dir():
                part = part_name(owner, index)
                self.components[part] = Component(part, LIST_LIBRARY, part_class, self._scan_component(part), None)
                index += 1

    def _model_index(self, entry: FolderEntry) -> dict[str, Any]:
        why = over_size(entry.length, spec.MODEL_INDEX)
        if why is not None:
            raise DDUFValidationError(self.path, [finding("D013", spec.MODEL_INDEX, why)], kind=FOLDER)
        try:
            value = read_json(self.read_bytes(spec.MODEL_INDEX), spec.MODEL_INDEX, where=self.path, parse_code="D002")
        except DDUFValidationError:
            raise
        except Exception as e:  # DDUFFormatError with the code: as the archive's opening reports it
            code = getattr(e, "code", None) or "D002"
            raise DDUFValidationError(self.path, [finding(code, spec.MODEL_INDEX, str(e))], kind=FOLDER) from None
        if not isinstance(value, dict):
            raise DDUFValidationError(self.path, [finding("D002", spec.MODEL_INDEX, "is not a JSON object")], kind=FOLDER)
        return value

    def _entry(self, name: str, path: Path) -> FolderEntry:
        """``name``'s record; a real path outside the boundary is a Z008 problem (never read)."""
        real = Path(os.path.realpath(path))
        if not is_inside(real, self._boundary):  # the one boundary rule, shared with dduf pack
            self.problems.append(finding("Z008", name, escape_message(real, self._boundary,
                                                                      "copy the file in, or pass the component")))
        try:
            length = os.stat(real).st_size
        except OSError as e:
            raise DDUFIOError(f"{self.path}: cannot read {name}: {e.strerror or e}") from None
        return FolderEntry(name, length, real)

    def _scan_component(self, name: str) -> tuple[str, ...]:
        """The files of ``name``'s folder an archive would hold (allowed types, not hidden), each recorded."""
        why = component_name_problem(name)
        if why is not None:
            self.problems.append(finding("D012", name, f"component name {name!r} {why}"))
            return ()
        folder = self.root / name
        if not folder.is_dir():
            return ()
        files = []
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.name.startswith(".") or not entry.name.endswith(spec.ALLOWED_EXTENSIONS) \
                    or name_problem(entry.name) is not None:
                continue
            try:
                regular = stat.S_ISREG(os.stat(entry.path).st_mode)  # follows links: a link to a file is one
            except OSError:
                regular = False
            if regular:
                files.append(entry.name)
                self.entries[f"{name}/{entry.name}"] = self._entry(f"{name}/{entry.name}", Path(entry.path))
        if files and not any(f in spec.CONFIG_FILES for f in files) and alias_config(files) is None:
            self.problems.append(finding("D006", name, f"component folder has no config file (one of "
                                         f"{', '.join(spec.CONFIG_FILES)})"))
        return tuple(files)

    # --- what the loader asks ------------------------------------------------------------------------
    def read_bytes(self, name: str) -> bytes:
        entry = self.entries.get(name)
        if entry is None:
            raise DDUFIOError(f"{self.path}: {name} is not a file the folder's scan kept")
        try:
            opened = open_regular(entry.path)  # a FIFO put in its place since the scan: refused, not waited on
            if opened is None:
                raise DDUFIOError(f"{self.path}: {name} is no longer a regular file")
            with open(opened[0], "rb") as f:
                data = f.read(entry.length + 1)  # the scan's size: a file grown since is refused, not read on
        except OSError as e:
            raise DDUFIOError(f"{self.path}: cannot read {name}: {e.strerror or e}") from None
        if len(data) != entry.length:
            raise DDUFIOError(f"{self.path}: {name} changed since the folder was scanned ({entry.length} bytes "
                              f"then, {len(data) if len(data) <= entry.length else 'more'} now)")
        return data

    def findings(self) -> list[Finding]:
        """What ``load_findings`` checks on an archive, on the folder's files, with the same codes."""
        view = cast(Any, self)  # the attributes validate's entry checks read (entries, name, length)
        return [f for f in (self.problems
                            + json_entry_findings(view, lambda e: self.read_bytes(e.name), verify=False)
                            + budget_findings(((n, e.length) for n, e in self.entries.items()), self.read_bytes))
                if f.severity == "error"]

    def component_files(self, name: str, *, use_mmap: bool = True) -> PipelineFolderFiles:
        return PipelineFolderFiles(self, name, use_mmap=use_mmap)

    def close(self) -> None:
        pass  # each component's maps stay with its tensors


class PipelineFolderFiles(FolderComponentFiles):
    """One component of a :class:`FolderPipeline`: only the files its scan kept (the ones an archive would
    hold), read at their checked real paths; weights memory-mapped per file (zero-copy views)."""

    def __init__(self, pipeline: FolderPipeline, name: str, *, use_mmap: bool = True):
        super().__init__(pipeline.root / name, name, use_mmap=use_mmap)
        self.pipeline = pipeline
        self.description = f"{pipeline.path}/{name}"
        self._listing = list(pipeline.components[name].files)

    def __repr__(self) -> str:
        return f"PipelineFolderFiles({self.description!r})"

    def listdir(self) -> list[str]:
        return list(self._listing)

    def read_bytes(self, filename: str) -> bytes:
        if filename not in self._listing:
            return super().read_bytes(filename)  # the error naming what there is
        return self.pipeline.read_bytes(f"{self.name}/{filename}")

    def local_dir(self, filenames: Iterable[str] | None = None) -> str:
        """The folder itself when it holds exactly the kept files (budgets checked); else, as for an archive,
        a content-keyed copy of its small non-weight files: a tokenizer never sees anything else."""
        try:
            visible = {e.name for e in os.scandir(self.path) if not e.name.startswith(".")}
        except OSError:
            visible = set()
        if visible == set(self._listing) and filenames is None:
            return super().local_dir(None)
        entries = self.pipeline.entries
        return materialize_files(small_files(self, filenames, lambda f: entries[f"{self.name}/{f}"].length))


def hub_pipeline(source: str, dduf_file: str | None = None, *, revision: str | None = None,
                 variant: str | None = None, token: str | bool | None = None,
                 cache_dir: str | os.PathLike | None = None, local_files_only: bool = False) -> tuple[str, Path]:
    """What the Hub repo ``source`` (``org/name[@revision]``) holds, as ``("archive", path)`` or ``("folder",
    snapshot)``: ``dduf_file`` when given; else the one ``.dduf`` the repo holds (an archive wins over a folder
    layout in the same repo: it is what ``load_dduf("org/name")`` always loaded, and a single verified file);
    else, for a repo with a ``model_index.json`` and no archive, its folder layout, of which only the files the
    pipeline needs for ``variant`` are downloaded (:func:`~dduf_plus.remote.hub.hub_folder_for_pack`, the files
    ``dduf pack org/name`` fetches). Offline (``HF_HUB_OFFLINE``, ``local_files_only``) from the cache only.
    Imports no torch (``dduf info`` and ``inspect_dtypes`` use it)."""
    from ..errors import DDUFUsageError
    from ..remote.hub import DDUF_SUFFIXES, hub_archive, hub_folder_for_pack, list_repo_files, split_revision

    repo, at = split_revision(source)
    if at is not None and revision is not None and at != revision:
        raise DDUFUsageError(f"{source}: the revision after '@' and revision={revision!r} disagree; give one")
    revision = at or revision
    if dduf_file is None:
        files = list_repo_files(repo, revision=revision, token=token, cache_dir=cache_dir,
                                local_files_only=local_files_only)
        archives = [f for f in files if f.endswith(DDUF_SUFFIXES)]
        if len(archives) == 1:
            dduf_file = archives[0]
        elif not archives and spec.MODEL_INDEX in files:
            return "folder", hub_folder_for_pack(repo, revision=revision, variant=variant, token=token,
                                                 cache_dir=cache_dir, local_files_only=local_files_only)
    return "archive", hub_archive(repo, dduf_file, revision=revision, token=token, cache_dir=cache_dir,
                                  local_files_only=local_files_only)


__all__ = ["FolderPipeline", "PipelineFolderFiles", "boundary_of", "hub_pipeline"]
