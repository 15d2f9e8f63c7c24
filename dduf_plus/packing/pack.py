"""``pack``: one entry point for every way of writing a folder as DDUF (plain, partial, converted).

Torch is imported only when a dtype conversion is asked for."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from ..errors import DDUFPackError, path_argument
from ..format.pack import PackResult, check_output, plan_folder, write_archive
from ..format.quantization import QMAP_NAME, quanto_index_record
from .class_names import warn_unknown_classes
from .unsaved import why_not_saved

logger = logging.getLogger(__name__)


def pack(
    folder: str | os.PathLike,
    output: str | os.PathLike,
    *,
    variant: str | None = None,
    exclude: Sequence[str] = (),
    refs: Mapping[str, str] | None = None,
    base: str | None = None,
    dtype: str | Mapping[str, str] | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    quiet: bool = False,
    fsync: bool = True,
    quantize: Sequence[str] | Mapping[str, Any] | None = None,
) -> tuple[PackResult, Any]:
    """Pack ``folder`` into ``output``. Returns the result and, for partial packs, the reference plan.
    ``folder`` may also be a single-file ``.safetensors`` checkpoint (SD 1.x/2.x, SDXL; original key layout),
    packed against ``base`` (:func:`dduf_plus.packing.single_file.pack_single_file`).
    ``folder`` may be a Hub repo id ``org/name[@revision]`` (an existing local path wins): only the files the
    archive stores are downloaded, into the Hugging Face cache (offline: taken from it).
    ``folder`` may be a ``.dduf`` archive (:mod:`dduf_plus.packing.archive_source`): re-based (``base``), converted,
    quantized, with components excluded or referenced, by the same rules as a folder, its entries copied from the
    archive unchanged (nothing extracted); a partial archive keeps its references unless ``base``/``refs`` change
    them. ``output`` may not be that archive.
    ``fsync=False`` skips the flush to disk before the atomic rename.
    ``quantize={"unet": "bnb-nf4"}`` (or ``["unet=bnb-nf4"]``; a diffusers quantization config object as the value
    also works) quantizes that component while packing, from the full-precision source a batch of tensors at a
    time, exactly as diffusers would have saved it quantized (:mod:`dduf_plus.packing.quantize`); ``dtype`` for
    it is the ``torch_dtype`` of its unquantized layers.

    Raises:
        DDUFPackError: the folder holds something DDUF cannot, or a reference cannot be made.
    """
    from .archive_source import is_archive_source
    from .lora import is_lora_file, pack_lora
    from .single_file import is_single_file

    folder, output = path_argument(folder, "pack(folder=...)"), path_argument(output, "pack(output=...)")
    quantize = _quantize_arg(quantize)
    if is_lora_file(folder):  # a LoRA: stored under _lora/, every component of BASE referenced
        _lora_options_unused(folder, variant=variant, exclude=exclude, refs=refs, dtype=dtype, quantize=quantize)
        return pack_lora([folder], output, base=base, token=token, local_files_only=local_files_only, quiet=quiet,
                         fsync=fsync)
    if os.fspath(folder).endswith(".zst") and os.path.isfile(folder):
        raise DDUFPackError(f"{folder}: a compressed archive; run dduf decompress first, then pack the .dduf")
    if is_archive_source(folder):
        return _pack_archive(folder, output, variant=variant, exclude=exclude, refs=dict(refs or {}), base=base,
                             dtype=dtype, token=token, local_files_only=local_files_only, quiet=quiet, fsync=fsync,
                             quantize=quantize)
    if is_single_file(folder):  # a single-file checkpoint (original key layout): converted, referenced to BASE
        if quantize:
            raise DDUFPackError(f"{folder}: quantize cannot be used with a single-file checkpoint (only base=)")
        return _pack_checkpoint(folder, output, variant=variant, exclude=exclude, refs=refs, base=base, dtype=dtype,
                                token=token, local_files_only=local_files_only, quiet=quiet, fsync=fsync)
    refs = dict(refs or {})
    folder = pack_source(folder, variant=variant, token=token, local_files_only=local_files_only, quiet=quiet)
    plan = plan_folder(folder, variant=variant, exclude=[n for n in exclude], unsaved=why_not_saved)
    check_output(output, plan)  # -o FOLDER/vae/config.json --force would replace a source with the archive
    warn_unknown_classes(plan.model_index)  # a typo'd class name, said before the work (the written archive is D017)
    return _pack_plan(plan, output, variant=variant, exclude=exclude, refs=refs, base=base, dtype=dtype,
                      token=token, local_files_only=local_files_only, quiet=quiet, fsync=fsync, quantize=quantize)


def _lora_options_unused(source: str | os.PathLike, **options: Any) -> None:
    """A LoRA file packs with ``base=`` only: the folder options would silently do nothing."""
    used = [n for n, v in options.items() if v]
    if used:
        raise DDUFPackError(f"{source}: a LoRA file packs with base= only ({', '.join(used)} do not apply)")


def _quantize_arg(quantize: Sequence[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """``quantize=`` checked before any work (scheme names, torch-free)."""
    if not quantize:
        return {}
    from .quantize import parse_quantize

    return parse_quantize(quantize)


def _pack_archive(archive: str | os.PathLike, output: str | os.PathLike, *, variant: str | None,
                  exclude: Sequence[str], refs: dict[str, str], base: str | None, dtype: str | Mapping[str, str] | None,
                  token: str | bool | None, local_files_only: bool, quiet: bool, fsync: bool,
                  quantize: Mapping[str, Any]) -> tuple[PackResult, Any]:
    """:func:`pack` of a ``.dduf`` (:mod:`.archive_source`): planned from its entries, then as a folder."""
    from .archive_source import check_not_same, plan_archive

    check_not_same(archive, output)
    planned = plan_archive(archive, variant=variant, exclude=exclude)
    # a component the input already references is excluded already: its reference stays (not one with no source)
    exclude = [n for n in exclude if n not in planned.references or n in (planned.plan.held or {})]
    warn_unknown_classes(planned.plan.model_index)
    return _pack_plan(planned.plan, output, variant=variant, exclude=exclude, refs=refs, base=base, dtype=dtype,
                      token=token, local_files_only=local_files_only, quiet=quiet, fsync=fsync, quantize=quantize,
                      kept=planned.references, carried=planned.carried)


def _pack_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike, *, variant: str | None,
                     exclude: Sequence[str], refs: Mapping[str, str] | None, base: str | None,
                     dtype: str | Mapping[str, str] | None, token: str | bool | None, local_files_only: bool,
                     quiet: bool, fsync: bool) -> tuple[PackResult, Any]:
    """:func:`pack` of a single-file checkpoint (:mod:`dduf_plus.packing.single_file`): only ``base`` applies."""
    from .single_file import pack_single_file

    used = [name for name, value in (("variant", variant), ("exclude", exclude), ("refs", refs), ("dtype", dtype))
            if value]
    if used:
        raise DDUFPackError(f"{checkpoint}: {', '.join(used)} cannot be used with a single-file checkpoint (only base=)")
    return pack_single_file(checkpoint, output, base=base, token=token, local_files_only=local_files_only,
                            quiet=quiet, fsync=fsync)


def _pack_plan(plan: Any, output: str | os.PathLike, *, variant: str | None, exclude: Sequence[str],
               refs: dict[str, str], base: str | None, dtype: str | Mapping[str, str] | None,
               token: str | bool | None, local_files_only: bool, quiet: bool, fsync: bool,
               quantize: Mapping[str, Any] | None = None, kept: Mapping[str, Any] | None = None,
               carried: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[PackResult, Any]:
    """:func:`pack` once the folder (or archive) is planned. An archive's plan brings the references it ``kept``
    (written as they are when no reference changes) and the index keys ``carried`` from its index."""
    model_index, model_index_bytes, sources = plan.model_index, plan.model_index_bytes, plan.sources
    references = dict(kept) if kept else None
    partial = None
    if exclude or refs or base:
        from .partial import make_references

        partial = make_references(plan, exclude=exclude, refs=refs, base=base, token=token,
                                  local_files_only=local_files_only, variant=variant)
        model_index, model_index_bytes = partial.model_index, partial.model_index_bytes
        sources, references = partial.sources, partial.references
        _check_partial(partial, base=base, dtype=dtype)
        for line in partial.report:  # what is referenced and why the rest is stored: said once (the CLI shows it)
            logger.info("%s", line)
    elif references:  # a partial archive re-packed as it is: a --dtype for a referenced component is refused too
        _check_partial(SimpleNamespace(references=references, sources=sources), base=None, dtype=dtype)
    extra: dict[str, Any] | None = _quanto_records(sources)
    touched: set[str] = set(quantize or ())
    if quantize:
        sources, dtype, records = _quantized(plan._replace(sources=sources, model_index=model_index), quantize,
                                             dtype, partial)
        extra = {**(extra or {}), **records}
    if dtype:
        from .convert import convert_sources

        sources, converted = convert_sources(plan._replace(sources=sources, model_index=model_index), dtype)
        extra = dict(extra or {})
        for name, record in converted.items():
            extra[name] = {**extra.get(name, {}), **record}
        touched |= set(converted)
    if carried:
        extra = _with_carried(extra, carried, sources, touched)
    skipped = partial.skipped if partial is not None else plan.skipped
    result = write_archive(output, model_index, model_index_bytes, sources, skipped=skipped,
                           references=references, extra_components=extra, quiet=quiet, fsync=fsync)
    return result, partial


def _with_carried(extra: Mapping[str, Any] | None, carried: Mapping[str, Mapping[str, Any]],
                  sources: Sequence[Any], touched: set[str]) -> dict[str, Any] | None:
    """The index records of the input archive's components that are still stored, under the ones this pack made:
    a component it converted or quantized keeps only its folded chat template's record (the others described
    the bytes it had)."""
    from ..format.chat_template import INDEX_KEY

    stored = {s.name.split("/")[0] for s in sources if "/" in s.name}
    out = {name: dict(record) for name, record in (extra or {}).items()}
    for name, record in carried.items():
        if name not in stored:
            continue
        kept = record if name not in touched else {k: v for k, v in record.items() if k == INDEX_KEY}
        out[name] = {**kept, **out.get(name, {})}
    return out or None


def _quantized(plan: Any, quantize: Mapping[str, Any], dtype: str | Mapping[str, str] | None, partial: Any
               ) -> tuple[list[Any], str | Mapping[str, str] | None, dict[str, Any]]:
    """(sources with the ``quantize`` components quantized, the ``dtype`` left for the others, their records)."""
    from .quantize import quantize_sources

    referenced = sorted(set(quantize) & set(getattr(partial, "references", None) or {}))
    if referenced:
        raise DDUFPackError(f"--quantize names {', '.join(referenced)}, stored as a reference (not in the archive); "
                            "store it to quantize it (no --exclude/--ref for it; without --base)")
    sources, records = quantize_sources(plan, quantize, dtype=dtype)
    if isinstance(dtype, Mapping):  # applied as the quantized components' torch_dtype: not converted again
        dtype = {k: v for k, v in dtype.items() if k not in quantize} or None
    return sources, dtype, records


def _check_partial(partial: Any, *, base: str | None, dtype: str | Mapping[str, str] | None) -> None:
    """What a partial pack must not do silently: hold no component at all (SRC is BASE), or leave a
    ``--dtype`` unapplied because the component became a reference.

    Raises:
        DDUFPackError: nothing is stored, or ``--dtype`` names a component that is referenced.
    """
    from ..dtype_names import DEFAULT_KEY

    referenced = sorted(partial.references)
    stored = {s.name.split("/")[0] for s in partial.sources if "/" in s.name}
    if base and referenced and not stored:
        raise DDUFPackError(f"every component is identical to --base {base}: the archive would hold no component "
                            "(nothing to ship); load or share BASE itself")
    if not dtype or not referenced:
        return
    named = {k for k in dtype if k != DEFAULT_KEY} if isinstance(dtype, Mapping) else set()
    clash = sorted(named & set(referenced))
    if clash:
        raise DDUFPackError(f"--dtype names {', '.join(clash)}, which {'is' if len(clash) == 1 else 'are'} stored "
                            "as a reference (not in the archive), so cannot be converted; drop that --dtype, or "
                            f"store {'it' if len(clash) == 1 else 'them'} (no --exclude/--ref for it; without --base)")
    default = dtype.get(DEFAULT_KEY) if isinstance(dtype, Mapping) else dtype
    left = [n for n in referenced if n not in named  # components with weights: a dtype means nothing to others
            and any(f.endswith(".safetensors") for f in partial.references[n].get("files") or ())]
    if default and left:
        logger.warning("--dtype %s not applied to %s: referenced, not stored, so loaded as the source stores %s",
                       default, ", ".join(left), "it" if len(left) == 1 else "them")


def hub_source(source: str | os.PathLike) -> tuple[str, str | None] | None:
    """(repo id, revision) when ``source`` names a Hub repo (``org/name[@revision]``) and no local path;
    None for a local path (an existing one always wins) or anything else."""
    from ..remote.hub import hub_repo_of

    return hub_repo_of(source)


def pack_source(source: str | os.PathLike, *, variant: str | None = None, token: str | bool | None = None,
                local_files_only: bool = False, cache_dir: str | os.PathLike | None = None,
                quiet: bool | None = None) -> str | os.PathLike:
    """The folder to pack: ``source`` itself, or for a Hub repo id the cached snapshot holding only the files
    the archive will store (:func:`dduf_plus.remote.hub.hub_folder_for_pack`)."""
    hub = hub_source(source)
    if hub is None:
        return source
    from ..remote.hub import hub_folder_for_pack

    return hub_folder_for_pack(hub[0], revision=hub[1], variant=variant, token=token, cache_dir=cache_dir,
                               local_files_only=local_files_only, quiet=True if quiet else None)


def _quanto_records(sources: Sequence[Any]) -> dict[str, Any] | None:
    """Index records for components quantized with optimum-quanto (they ship ``quanto_qmap.json``)."""
    records = {}
    for source in sources:
        component, _, filename = source.name.partition("/")
        if filename == QMAP_NAME and source.file is not None:  # a file, or an input archive's entry
            try:
                records[component] = quanto_index_record(source_json(source))
            except ValueError as e:
                raise DDUFPackError(f"{source.file}: not valid JSON ({e})") from None
    records.update(_backend_records(sources))
    return records or None


def source_json(source: Any, raw: bytes | None = None) -> Any:
    """The parsed JSON of a source file (``raw``: its bytes, read already), through the budgeted reader: a folder
    is untrusted, and 100,000 nested brackets would overflow ``json.loads``' recursion (a RecursionError, no
    DDUFError).

    Raises:
        DDUFPackError: over its D013 budget, or not JSON (D007), naming the file.
    """
    from ..format.json_budget import parse_json_entry

    value, code, why = parse_json_entry(source.read_bytes() if raw is None else raw, source.name)
    if code is not None:
        raise DDUFPackError(f"{source.file}: {code} {why}")
    return value


def _backend_records(sources: Sequence[Any]) -> dict[str, Any]:
    """Index records of components a diffusers quantizer saved (torchao, bitsandbytes): backend, scheme and
    which tensors are quantized data vs scales, from config.json and the safetensors headers (torch-free).
    A component that is not self-consistent (a Q0xx rule) is refused: it would not load."""
    from ..format import quant_rules
    from ..format.safetensors_header import read_file_header

    by_component: dict[str, dict[str, Any]] = {}
    for source in sources:
        component, _, filename = source.name.partition("/")
        if source.file is not None and "/" not in filename:
            by_component.setdefault(component, {})[filename] = source
    records: dict[str, Any] = {}
    for component, files in by_component.items():
        config_source = files.get("config.json")
        raw = config_source.read_bytes() if config_source is not None else b""
        if config_source is None or b"quantization_config" not in raw:
            continue
        try:
            config = source_json(config_source, raw)
            headers = [s.header if s.header is not None else read_file_header(s.path, s.name, DDUFPackError)
                       for name, s in sorted(files.items()) if name.endswith(".safetensors")]
            record = quant_rules.index_record(config, headers)
        except ValueError as e:  # QuantError, or a config that is not JSON
            raise DDUFPackError(f"{config_source.file}: {getattr(e, 'code', 'D007')}: {e}") from None
        if record is not None:
            records[component] = record
    return records
