"""Single-file checkpoints in: ``pack(CKPT.safetensors, OUT, base=BASE)``.

A single-file checkpoint (A1111 / LDM / SGM key layout: ``model.diffusion_model.*``, ``first_stage_model.*``,
``cond_stage_model.*`` / ``conditioner.embedders.N.*``) becomes a partial archive against BASE, a diffusers
pipeline folder or a Hub repo (offline from the cache): the architecture is detected from the keys with
diffusers' single-file machinery (``infer_diffusers_model_type``), each component the file holds is converted
to diffusers' layout with diffusers' own mapping functions, one component at a time, from zero-copy views of
the memory-mapped file; a converted component whose tensors are identical to BASE's (names, dtypes, shapes,
bytes) becomes a content-verified reference to BASE, as do the components the file does not hold (and the
tokenizers and scheduler); only what differs is stored, written deterministically and streamed.

The file is untrusted: its header is parsed with the format layer's budgets before any byte is mapped."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import DDUFPackError
from ..format.pack import EntrySource, FolderPlan, PackResult, write_archive
from ..format.structure import component_specs
from ..format.weights import weights_name
from .mapped_views import mapped
from .partial import make_references, model_index_with
from .single_file_base import Base, BaseTensors, base_tensors, check_base, open_base, read_base_json
from .single_file_convert import (
    Job,
    check_declared,
    component_chunks,
    component_views,
    converted_or_refused,
    file_header,
    fit,
    identical,
    identical_variant,
)
from .single_file_layout import (
    FAMILIES,
    describe_checkpoint,
    detect_architecture,
    family_for,
    held_tensors,
    is_single_file,
    quick_architecture,
    read_checkpoint_header,
    refuse_scaled_fp8,
    unconverted_tensor,
)

logger = logging.getLogger(__name__)

# The layout names are re-exported: callers and tests import them from here.
__all__ = ["FAMILIES", "describe_checkpoint", "detect_architecture", "is_single_file", "pack_single_file",
           "plan_single_file", "quick_architecture", "read_checkpoint_header"]


_HOSTED = "not compared: BASE is hosted, comparing would download its weights"


def _component(job: Job, base: Base, theirs: BaseTensors,
               where: str) -> tuple[list[EntrySource], str, str | None]:
    """Convert one component; its entry sources when it differs from BASE (none when identical), a line
    for the report and the BASE variant it is identical to (an fp16 checkpoint, BASE's fp16 files)."""
    check_declared(job, theirs, where)  # shapes against BASE's, conversion memory bounded: nothing allocated
    with mapped(job.checkpoint) as mm:
        views = component_views(job, mm)
        converted = converted_or_refused(job, views, where)
        dropped = fit(job.name, converted, theirs, where)
        why = _HOSTED if base.hosted else identical(converted, theirs, mm)
        library = component_specs(base.model_index)[job.name][0]
        entry = f"{job.name}/{weights_name(library)}"
        head, header, planned, size = file_header(converted, entry)
        nbytes = sum(t.numel() * t.element_size() for t in converted.values())
        variant = identical_variant(job.name, converted, base, mm) if why not in (None, _HOSTED) else None
        converted.clear()
        views.clear()
    note = f"; dropped {len(dropped)} tensor(s) BASE's model has no place for ({dropped[0]}...)" if dropped else ""
    if why is None or variant is not None:
        which = f"BASE's {variant} variant" if variant else "BASE's"
        return [], f"{job.name}: {len(header.tensors)} tensors identical to {which} -> referenced{note}", variant
    config = f"{job.name}/config.json"
    config_source = (EntrySource(config, data=base.read(job.name, "config.json")) if base.archive is not None
                     else EntrySource(config, path=base.folder / config))
    sources = [config_source,
               EntrySource(entry, size=size, chunks=lambda: component_chunks(job, head, planned), header=header)]
    return sources, f"{job.name}: converted, {len(header.tensors)} tensors, {nbytes} bytes, stored ({why}){note}", None


def pack_single_file(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    base: str | os.PathLike | None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    quiet: bool = False,
    fsync: bool = True,
) -> tuple[PackResult, Any]:
    """Pack a single-file checkpoint as a partial archive against ``base``. Returns the result and the
    reference plan (``.report``: the architecture found, what was stored and referenced).

    Raises:
        DDUFPackError: no BASE, an unknown or unsupported architecture, a BASE of another family, a
            component that does not fit BASE's configs, a broken file; nothing is written then.
    """
    started = time.perf_counter()
    prepared = _prepare(checkpoint, base, token, local_files_only)
    try:
        return _write(prepared, output, token=token, local_files_only=local_files_only, quiet=quiet, fsync=fsync,
                      started=started)
    finally:
        if prepared.base.archive is not None:
            prepared.base.archive.close()


class _Prepared(NamedTuple):
    base: Base
    sources: list[EntrySource]  # what differs from BASE: stored
    by_variant: dict[str, list[str]]  # components identical to one of BASE's variants
    report: list[str]
    where: str
    model_type: str


def _prepare(checkpoint: str | os.PathLike, base: str | os.PathLike | None, token: str | bool | None,
             local_files_only: bool) -> _Prepared:
    """Detect, check BASE, convert and compare every component the checkpoint holds (nothing written)."""
    path = Path(checkpoint)
    where = str(path)
    if not base:
        raise DDUFPackError(f"{where} is a single-file checkpoint: give --base BASE (a diffusers pipeline folder "
                            "or Hub repo of the same family) for its configs, tokenizers and scheduler")
    header = read_checkpoint_header(path)
    refuse_scaled_fp8(header, where)
    model_type = detect_architecture(header, where)
    family = family_for(model_type, where)
    unconverted = unconverted_tensor(header, family)
    if unconverted is not None:  # before BASE is opened or any tensor viewed
        raise DDUFPackError(f"{where}: {unconverted}")
    the_base = open_base(os.fspath(base), token, local_files_only)
    check_base(family, model_type, the_base, where)
    held = held_tensors(header, family)
    if not held:  # e.g. an MMDiT's bare keys: diffusers detects them, its pipeline loader reads prefixed ones
        prefixes = ", ".join(sorted({c.prefix for c in family.components.values()}))
        raise DDUFPackError(f"{where}: detected {family.name} ({model_type}) but none of its keys is under a "
                            f"component's prefix of that layout ({prefixes})")
    absent = sorted(set(family.components) - set(held))
    report = [f"detected {family.name} ({model_type}) from the keys of {path.name}; it holds "
              f"{', '.join(held) or 'no component'}" + (f", not {', '.join(absent)}" if absent else "")]
    sources: list[EntrySource] = []
    by_variant: dict[str, list[str]] = {}
    for name in sorted(held):
        theirs = base_tensors(the_base, name)
        config = read_base_json(the_base, name)
        job = Job(path, header, name, family.components[name], config, set(theirs.tensors))
        stored, line, variant = _component(job, the_base, theirs, where)
        sources.extend(stored)
        report.append(line)
        if variant is not None:
            by_variant.setdefault(variant, []).append(name)
    return _Prepared(the_base, sources, by_variant, report, where, model_type)


def plan_single_file(checkpoint: str | os.PathLike, base: str | os.PathLike, *, token: str | bool | None = None,
                     local_files_only: bool = False) -> dict[str, Any]:
    """What :func:`pack_single_file` would store and reference against ``base``, without writing anything
    (``dduf info CKPT.safetensors --base BASE``): {architecture, stored: {component: bytes}, referenced:
    {component: variant or None}, report}. Converts and compares like a pack (reads the tensors)."""
    prepared = _prepare(checkpoint, base, token, local_files_only)
    if prepared.base.archive is not None:
        prepared.base.archive.close()
    stored: dict[str, int] = {}
    for source in prepared.sources:
        name = source.name.split("/")[0]
        stored[name] = stored.get(name, 0) + source.nbytes
    in_variant = {n: v for v, names in prepared.by_variant.items() for n in names}
    real = [n for n, (lib, _c) in component_specs(prepared.base.model_index).items() if lib is not None]
    return {"architecture": prepared.model_type, "base": prepared.base.spec, "stored": stored,
            "referenced": {n: in_variant.get(n) for n in sorted(real) if n not in stored},
            "report": prepared.report}


def _write(prepared: _Prepared, output: str | os.PathLike, *, token: str | bool | None, local_files_only: bool,
           quiet: bool, fsync: bool, started: float) -> tuple[PackResult, Any]:
    """Reference everything not stored to BASE (content-verified, as ``--base`` does) and write."""
    sources, base, report, by_variant, where = (prepared.sources, prepared.base, prepared.report,
                                                prepared.by_variant, prepared.where)
    stored = {s.name.split("/")[0] for s in sources}
    if not stored:
        raise DDUFPackError(f"{where}: every component it holds is identical to --base {base.spec}: the archive "
                            "would hold no component (nothing to ship); load or share BASE itself")
    real = [n for n, (lib, _c) in component_specs(base.model_index).items() if lib is not None]
    plan = FolderPlan(base.model_index, base.model_index_bytes, sources, [], base.folder)
    in_variant = {n for names in by_variant.values() for n in names}
    partial = make_references(plan, exclude=sorted(set(real) - stored - in_variant), refs={"*": base.spec},
                              token=token, local_files_only=local_files_only)
    references, lines = dict(partial.references), list(partial.report)
    for variant, names in sorted(by_variant.items()):  # references that record BASE's variant files
        extra = make_references(plan, exclude=sorted(names), refs={"*": base.spec}, token=token,
                                local_files_only=local_files_only, variant=variant)
        references.update({n: extra.references[n] for n in names})
        lines[-1:-1] = [line for line in extra.report if line.startswith("referenced ")]
    model_index, raw = model_index_with(plan.model_index, plan.model_index_bytes, references)
    partial = partial._replace(report=report + lines, references=references, model_index=model_index,
                               model_index_bytes=raw)
    for line in partial.report:
        logger.info("%s", line)
    result = write_archive(output, partial.model_index, partial.model_index_bytes, partial.sources,
                           skipped=partial.skipped, references=partial.references or None, quiet=quiet, fsync=fsync)
    return result._replace(seconds=time.perf_counter() - started), partial
