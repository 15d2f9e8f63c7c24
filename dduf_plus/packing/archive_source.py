"""An archive as the source of a pack (``dduf pack IN.dduf -o OUT.dduf --base/--dtype/--quantize/--exclude/--ref``).

The archive is planned as a folder is (:func:`~dduf_plus.format.pack.plan_folder`), but each entry source is a
region of the archive file (:class:`~dduf_plus.format.pack.FileRegion`: path, offset, length): unchanged entries
are copied from there byte for byte (``copy_file_range``), converted and quantized ones read from there; nothing
is extracted. The input is hostile like any archive: every structural, index and quantization rule is checked
before anything is planned (one :class:`~dduf_plus.errors.DDUFValidationError` naming each entry and rule), and
the bytes copied are checked against the archive's own CRC-32 and sha256 as they are written. No torch here."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ..assignments import PackNameError, check_names
from ..errors import DDUFPackError, DDUFUsageError, DDUFValidationError
from ..format import spec
from ..format.archive import DDUFArchive
from ..format.pack import EntrySource, FileRegion, FolderPlan, Skipped
from ..format.structure import component_specs
from ..format.weights import classify, select_weights

# index keys build_index derives from the entries themselves; any other key of a stored component (a dtype
# conversion's record, a folded chat template's record) is carried into the new archive's index
DERIVED_KEYS = frozenset({"library", "class", "files", "summary", "variants", "external"})
ZIP_MAGIC = b"PK\x03\x04"


class ArchivePlan(NamedTuple):
    plan: FolderPlan  # sources are regions of the archive; ``held`` has every component's, excluded ones too
    references: dict[str, Any]  # the archive's own references (a partial archive keeps them)
    carried: dict[str, dict[str, Any]]  # index keys of its components build_index does not derive


def is_archive_source(source: str | os.PathLike) -> bool:
    """A local file that is a DDUF archive: named ``*.dduf``, or a ZIP (a ``.safetensors`` checkpoint is not)."""
    text = os.fspath(source)
    if not os.path.isfile(text) or text.endswith(".safetensors"):
        return False
    if text.endswith(".dduf"):
        return True
    try:
        with open(text, "rb") as f:
            return f.read(4) == ZIP_MAGIC
    except OSError:
        return False


def check_not_same(source: str | os.PathLike, output: str | os.PathLike) -> None:
    """The output may not be the input archive (nor a link to it): refused before any work.

    Raises:
        DDUFUsageError: ``output`` is ``source``.
    """
    out = Path(output)
    same = out.exists() and os.path.samefile(source, out)
    if same or os.path.realpath(source) == os.path.realpath(out):
        raise DDUFUsageError(f"{output}: is the input archive {source}; write the re-packed archive to another path "
                             "(then move it over the input if you mean to replace it)")


def plan_archive(path: str | os.PathLike, *, variant: str | None = None, exclude: Sequence[str] = ()) -> ArchivePlan:
    """What a pack of the archive at ``path`` stores (the chosen ``variant``'s weights, every other entry of each
    component, ``exclude`` left out) as regions of the archive, after checking every rule ``dduf validate`` checks
    (headers and records, no hashing: the bytes copied are checked as they are written).

    Raises:
        DDUFValidationError: the archive breaks a rule (each error with its code and entry).
        DDUFPackError: an unknown ``--exclude`` name, or a ``variant`` no component has.
    """
    from ..format.validate import validate

    root = Path(path)
    report = validate(root)
    if report.errors:
        raise DDUFValidationError(str(root), report.errors)
    with DDUFArchive(root) as archive:
        model_index, raw = archive.model_index, archive.read_bytes(spec.MODEL_INDEX)
        check_names(exclude, component_specs(model_index), what="--exclude", where=f"{root}#{spec.MODEL_INDEX}",
                    error=PackNameError)
        held: dict[str, list[EntrySource]] = {}
        skipped: list[Skipped] = []
        for name, component in sorted(archive.components.items()):
            if not component.files:
                continue  # a referenced component (kept as a reference) or a config-less null one
            chosen, other_variants = _select(component.files, variant)
            skipped.extend(Skipped(f"{name}/{f}", "weights of another variant") for f in other_variants)
            held[name] = [_region_source(archive, root, f"{name}/{f}") for f in chosen]
        _check_variant(variant, held, skipped, root)
        sources = [s for name, group in sorted(held.items()) if name not in exclude for s in group]
        skipped.extend(Skipped(f"{name}/", "excluded") for name in sorted(set(exclude) & set(held)))
        carried = {n: {k: v for k, v in c.items() if k not in DERIVED_KEYS}
                   for n, c in (archive.index.get("components") or {}).items() if isinstance(c, dict)}
        plan = FolderPlan(model_index, raw, sources, skipped, root, held=held)
        return ArchivePlan(plan, dict(archive.references), {n: c for n, c in carried.items() if c})


def _select(files: Sequence[str], variant: str | None) -> tuple[list[str], list[str]]:
    """(entries a pack keeps, weights of other variants): the rule of a folder's plan."""
    weights = set(select_weights(list(files), variant))
    chosen = [f for f in files if classify(f) is None or f in weights]
    return chosen, [f for f in files if f not in chosen]


def _region_source(archive: DDUFArchive, root: Path, entry: str) -> EntrySource:
    e = archive.entry(entry)
    return EntrySource(entry, header=archive.headers.get(entry),
                       region=FileRegion(root, e.offset, e.length, entry, e.crc32, e.sha256))


def _check_variant(variant: str | None, held: dict[str, list[EntrySource]], skipped: list[Skipped], root: Path) -> None:
    """``variant`` must be some component's, as for a folder (the loader refuses such an archive)."""
    if not variant:
        return
    names = [s.name.rsplit("/", 1)[-1] for group in held.values() for s in group]
    if any((w := classify(n)) and w.variant == variant for n in names):
        return
    present = sorted({w.variant for s in skipped if (w := classify(s.path.rsplit("/", 1)[-1])) and w.variant})
    raise DDUFPackError(f"--variant {variant}: no component of {root} has weights of variant {variant!r} "
                        f"(variants present: {', '.join(present) or 'none'}; pack without --variant for the default)")
