"""The BASE a single-file checkpoint is packed against: a diffusers pipeline folder, its Hub repo (the cached
snapshot), or a complete ``.dduf`` (local or hosted); its configs, weight variants and tensor headers, which the
converted components are checked and compared against."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import DDUFError, DDUFNotFoundError, DDUFPackError
from ..format import spec
from ..format.json_budget import read_json
from ..format.safetensors_header import TensorInfo, read_file_header
from ..format.structure import component_specs, model_index_object
from ..format.weights import classify, select_weights, variants
from .single_file_layout import FAMILIES, Family

if TYPE_CHECKING:  # pragma: no cover
    from ..format.archive import DDUFArchive

__all__ = ["Base", "BaseTensors", "base_tensors", "base_variants", "check_base", "open_base", "read_base_json"]


class Base(NamedTuple):
    folder: Path  # a local folder holding BASE's files (the folder, or its Hugging Face cache snapshot), or the .dduf
    spec: str  # what the references name: the folder, the repo id[@revision], the archive
    model_index: dict[str, Any]
    model_index_bytes: bytes
    archive: DDUFArchive | None = None  # open when BASE is a .dduf
    hosted: bool = False  # BASE is a hosted .dduf (a URL): configs and headers by range reads, weights not compared

    def files(self, name: str) -> list[str]:
        """The file names of BASE's component folder ``name``."""
        if self.archive is not None:
            comps = self.archive.components
            return sorted(comps[name].files) if name in comps else []
        return _listing(self.folder / name)

    def read(self, name: str, filename: str) -> bytes:
        if self.archive is not None:
            return bytes(self.archive.read_bytes(f"{name}/{filename}"))
        return (self.folder / name / filename).read_bytes()


def open_base(base: str, token: str | bool | None, local_files_only: bool) -> Base:
    from ..refs.resolve import parse_spec

    try:
        kind = parse_spec(base).kind
    except DDUFError as e:
        raise DDUFPackError(f"--base {base!r}: {e}") from None
    if kind == "url":
        from ..storage.hub_env import is_offline

        if is_offline(local_files_only):  # as hosted references are never fetched then
            raise DDUFPackError(f"--base {base}: a hosted archive is read over the network, which HF_HUB_OFFLINE / "
                                "local_files_only forbids; give a local copy of it")
    if kind in ("dduf", "url"):
        return _open_base_archive(base, token if kind == "url" else None)
    if kind == "folder":
        folder = Path(base)
        if not folder.is_dir():
            raise DDUFNotFoundError(f"--base {base!r}: {folder} does not exist", str(folder))
    else:
        folder = _hub_base_folder(base, token, local_files_only)
    mi_path = folder / spec.MODEL_INDEX
    if not mi_path.is_file():
        raise DDUFPackError(f"--base {base!r}: {folder} has no model_index.json (BASE is a diffusers pipeline)")
    raw = mi_path.read_bytes()
    return Base(folder, base, model_index_object(raw, str(mi_path), DDUFPackError), raw)


def _open_base_archive(base: str, token: str | bool | None = None) -> Base:
    """BASE as a local ``.dduf`` or a hosted one (a URL: its directory, index and the JSON entries read by range
    requests, with the storage layer's budgets): opened with the strict reader (refused if ``dduf validate``
    would refuse it)."""
    from ..format.archive import DDUFArchive
    from ..storage.urls import is_url

    hosted = is_url(base)
    if not hosted and not os.path.isfile(base):
        raise DDUFNotFoundError(f"--base {base!r}: {base} does not exist", base)
    options: dict[str, Any] = {"token": token} if token not in (None, False) and base.startswith("hf://") else {}
    archive = DDUFArchive(base, **options)
    if archive.references:
        archive.close()
        raise DDUFPackError(f"--base {base}: a partial archive (it references components elsewhere); use a "
                            "complete one (dduf complete) or the folder or repo it references")
    raw = bytes(archive.read_bytes(spec.MODEL_INDEX))
    return Base(Path(base), base, model_index_object(raw, f"{base}:{spec.MODEL_INDEX}", DDUFPackError), raw, archive,
                 hosted)


def _hub_base_folder(base: str, token: str | bool | None, local_files_only: bool) -> Path:
    """BASE ``org/repo[@revision]``: its snapshot in the Hugging Face cache (the one the references are checked
    against, as ``dduf pack --base`` reads it), else what ``dduf pack org/repo`` would download."""
    from ..refs import cache as _cache
    from ..remote.hub import hub_folder_for_pack, split_revision

    repo, revision = split_revision(base)
    for cache in _cache.hf_cache_dirs(None):
        snap = _cache.snapshot_dir(cache, repo, revision)
        if snap is not None and (snap / spec.MODEL_INDEX).is_file():
            return snap
    # (the Hub download pack_source does, called directly: packing/pack.py imports this module's users)
    return Path(hub_folder_for_pack(repo, revision=revision, token=token, local_files_only=local_files_only,
                                    quiet=True))


def check_base(family: Family, model_type: str, base: Base, where: str) -> None:
    """Refuse a BASE of another pipeline family (an SDXL checkpoint against an SD 1.5 base)."""
    cls = base.model_index.get("_class_name")
    if cls not in family.pipelines:
        others = [f.name for f in FAMILIES.values() if cls in f.pipelines]
        hint = f" (a pipeline for {' / '.join(others)} checkpoints)" if others else ""
        raise DDUFPackError(f"{where} is an {family.name} checkpoint ({model_type}, detected from its keys) but "
                            f"--base {base.spec} is a {cls}{hint}: use a {family.name} base "
                            f"({' or '.join(family.pipelines)})")
    specs = component_specs(base.model_index)
    missing = [n for n in family.components if specs.get(n, (None, None))[0] is None]
    if missing:
        raise DDUFPackError(f"--base {base.spec}: its model_index.json has no {', '.join(missing)}, which a "
                            f"{family.name} pipeline needs")


class BaseTensors(NamedTuple):
    tensors: dict[str, tuple[Path, int, TensorInfo]]  # name -> (file, data start, info)
    files: list[str]


def base_variants(base: Base, name: str) -> list[str]:
    """The weight variants (``fp16``...) BASE's component ``name`` has files of."""
    return sorted(variants(base.files(name)))


def _listing(folder: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(folder) if e.is_file()) if folder.is_dir() else []


def base_tensors(base: Base, name: str, variant: str | None = None) -> BaseTensors:
    """BASE's weights of component ``name`` (the default ones, or ``variant``'s; every shard), from the headers."""
    folder = base.folder / name
    chosen = select_weights(base.files(name), variant)
    weights = [f for f in chosen if f.endswith(".safetensors")  # variant None: a BASE of variant files only too
               and (variant is None or ((w := classify(f)) is not None and w.variant == variant))]
    if not weights:
        where = "" if Path(base.spec) == base.folder else f" (the copy in {base.folder}: download it first)"
        raise DDUFPackError(f"--base {base.spec}: {name}/ holds no safetensors weights to compare with{where}")
    out: dict[str, tuple[Path, int, TensorInfo]] = {}
    for f in weights:
        if base.archive is not None:  # the whole archive is mapped; tensors at the entry's offset
            entry = base.archive.entry(f"{name}/{f}")
            header = base.archive.headers[f"{name}/{f}"]
            path, start = base.folder, entry.offset + header.data_start
        else:
            header = read_file_header(folder / f, f"{name}/{f}", DDUFPackError)
            path, start = folder / f, header.data_start
        for t in header.tensors.values():
            out[t.name] = (path, start, t)
    return BaseTensors(out, weights)


def read_base_json(base: Base, name: str) -> dict[str, Any]:
    """BASE's ``name/config.json``."""
    try:
        value = read_json(base.read(name, "config.json"), f"{name}/config.json", where=f"--base {base.spec}")
    except (OSError, DDUFError) as e:
        raise DDUFPackError(f"--base {base.spec}: {name}/config.json cannot be read as JSON ({e})") from None
    if not isinstance(value, dict):
        raise DDUFPackError(f"--base {base.spec}: {name}/config.json is not a JSON object")
    return value

