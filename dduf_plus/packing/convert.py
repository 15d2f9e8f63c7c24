"""Pack-time dtype conversion: write a pipeline's weights in another precision while packing.

``dduf pack SRC -o OUT --dtype bfloat16`` (or ``--dtype unet=float8_e4m3fn``) goes through
:func:`convert_sources`: each safetensors file of a converted component is rewritten tensor by tensor, in
slices of at most 64 MiB read from a private mmap of the source, so peak memory stays about one slice
whatever the model size. The new safetensors header is computed before any data, so the entry's size is
known up front and the writer streams it straight into the archive (with the usual 4096-byte alignment).

What is converted, and what is left alone:

- floating tensors (float16/bfloat16/float32/float64, float8 when up-casting) go to the target dtype;
- integer, bool, complex and packed (float4/6, e8m0) tensors are copied unchanged;
- tensors of modules the model class keeps in fp32 keep their dtype: diffusers' ``_keep_in_fp32_modules``
  (always, as diffusers does), transformers' ``_keep_in_fp32_modules_strict`` (for fp16/bf16/fp8 targets)
  and ``_keep_in_fp32_modules`` (for fp16 and fp8 targets: transformers applies it to fp16 only);
- a file whose tensors would all stay as they are is packed byte-identical (no rewrite).

fp8 storage (``float8_e4m3fn`` / ``float8_e5m2``) is not a compute dtype: only the weights of the layers
diffusers' layerwise casting would hook (Linear/Conv/Embedding outside its skip patterns: ``norm``,
``pos_embed``, ``patch_embed``, ``proj_in/out``, the class' ``_skip_layerwise_casting_patterns`` and
keep-in-fp32 modules) are stored as fp8; every other floating tensor is stored in the compute dtype. The
component's index record then carries ``storage_dtype``, ``compute_dtype`` and the skip patterns used, and
the loader restores it with ``enable_layerwise_casting`` (see :func:`apply_fp8_storage`). Values beyond the
fp8 range are saturated (clamped to ±max) rather than turned into NaN, and counted in the log.

fp8 storage applies to diffusers models (the loader restores it with diffusers' layerwise casting): naming
a transformers component (``--dtype text_encoder=float8_e4m3fn``) is an error; under a default fp8 target a
transformers component is stored in the given compute dtype, or left alone when none is given.

Quantized components are not re-quantized: in an optimum-quanto component (``quanto_qmap.json``) the
quantized values (``*._data``) are left alone and only scales, biases and unquantized layers convert;
other quantized components (diffusers ``quantization_config``) and fp8 targets for any quantized
component are packed unchanged, or refused when ``--dtype`` names them.

The model class's module tree comes from a skeleton built from the component's config on the meta device,
within the construction budget of the weights the folder stores (:mod:`dduf_plus.torchkit.meta_model`): a
config asking for far more (``num_layers: 3000`` over two stored layers) is a :class:`DDUFPackError`
within a second or so, not a minute of construction; such an archive would not load anyway.

Converted entries are no longer byte-identical to the source files: the index records the new sha256 and
the source file's as ``source_sha256``. Shard indexes (``*.safetensors.index.json``) keep their
``weight_map`` and get ``metadata.total_size`` recomputed."""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import mmap
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..assignments import PackNameError, check_names
from ..dtype_names import (  # noqa: F401 - re-exported: the dtype names and grammar live in a torch-free module
    ALIASES,
    COMPUTE_DTYPES,
    DEFAULT_KEY,
    FP8,
    STORAGE_DTYPES,
    Target,
    parse_dtype_args,
)
from ..dtype_names import parse_target as _parse_target_name
from ..errors import DDUFLoadError, DDUFPackError
from ..format import spec
from ..format.index import summarize
from ..format.json_budget import parse_json_entry
from ..format.pack import EntrySource, FileRegion, FolderPlan, PackResult, plan_folder, write_archive
from ..format.quantization import QMAP_NAME as QUANTO_QMAP
from ..format.safetensors_header import SafetensorsHeader, TensorInfo, parse_header
from ..format.structure import component_specs
from ..format.weights import classify
from ..format.writer import open_source_file
from ..torchkit.meta_model import ConstructionBudgetError, StoredTensors, is_diffusers_model, meta_model
from .reference_source import region_sha256

logger = logging.getLogger(__name__)

SLICE_BYTES = 64 << 20  # source bytes converted at a time: bounds peak memory for huge tensors
# Source dtypes torch converts elementwise. float8_e8m0fnu (a scale format) and the packed 4/6-bit
# types are left as they are: converting them would change their meaning, not their precision.
CONVERTIBLE = frozenset({"float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"})
# diffusers.hooks.layerwise_casting.DEFAULT_SKIP_MODULES_PATTERN, in case a diffusers without it is installed
_FALLBACK_SKIP_PATTERNS = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")


# --- the --dtype argument ----------------------------------------------------------------------------


def parse_target(value: str | torch.dtype, what: str | None = None) -> Target:
    """``"bfloat16"`` / ``"bf16"`` / ``torch.bfloat16`` / ``"float8_e4m3fn:float16"`` -> :class:`Target`."""
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if not isinstance(value, str):
        raise DDUFPackError(f"{what or 'dtype'}: {value!r} is not a dtype name")
    return _parse_target_name(value, what or f"--dtype {value}")


def parse_dtype_spec(dtype: str | torch.dtype | Mapping[str, Any]) -> dict[str, Target]:
    """Normalise the ``dtype`` argument: one dtype for every component, or ``{component: dtype}`` with an
    optional ``"default"`` (``"*"`` is accepted for it) for the components not named.

    Example:
        >>> parse_dtype_spec({"unet": "float8_e4m3fn:float16", "default": "bf16"})
        {'unet': Target(storage='float8_e4m3fn', compute='float16'), 'default': Target(storage='bfloat16', compute=None)}
    """
    if isinstance(dtype, Mapping):
        out = {}
        for key, value in dtype.items():
            key = DEFAULT_KEY if key == "*" else key
            out[key] = parse_target(value, f"--dtype {key}={value}" if isinstance(value, str) else f"--dtype {key}")
        return out
    return {DEFAULT_KEY: parse_target(dtype)}


# --- what a model class keeps in fp32 / what layerwise casting touches --------------------------------


class ComponentRules:
    """The dtype decisions for one component, derived from its model class (when it can be imported)."""

    def __init__(self, component: str, library: str | None, class_name: str | None, config: dict[str, Any] | None,
                 stored: StoredTensors | None = None):
        """``stored``: the tensors the component's weight files hold; the model is built within their
        construction budget (a config asking for far more is refused: the archive would not load)."""
        self.component = component
        self.library, self.class_name = library, class_name
        self.cls = import_class(library, class_name)
        self.model: torch.nn.Module | None = None
        if self.cls is not None and config is not None:
            try:
                self.model = meta_model(self.cls, config, component, stored or {})
            except ConstructionBudgetError as e:
                raise DDUFPackError(f"{e}; its weights do not fit its config, so the packed archive would not "
                                    "load either") from None
            except DDUFLoadError as e:  # arbitrary model code; a failure only loses precision rules
                logger.info("%s: precision rules from the class alone", e)
        source = self.model if self.model is not None else self.cls
        self.is_diffusers = is_diffusers_model(self.cls)
        self.keep_fp32 = sorted(_as_list(getattr(source, "_keep_in_fp32_modules", None)))
        self.keep_fp32_strict = sorted(_as_list(getattr(source, "_keep_in_fp32_modules_strict", None)))
        self.skip_casting = sorted(_as_list(getattr(source, "_skip_layerwise_casting_patterns", None)))

    def keeps(self, tensor_name: str, target: str) -> bool:
        """Whether ``tensor_name`` stays in its dtype for ``target`` (the class keeps it in fp32)."""
        if self.is_diffusers:
            # diffusers' rule (model_loading_utils.load_model_dict_into_meta): a path component matches.
            parts = tensor_name.split(".")
            return any(m in parts for m in self.keep_fp32)
        patterns = list(self.keep_fp32_strict) if target != "float32" else []
        if target in ("float16",) + FP8:
            patterns += self.keep_fp32  # transformers applies the non-strict list to fp16 only
        # transformers' rule (core_model_loading: a regex search of the glob over the key).
        return any(re.search(p.replace("*", ".*"), tensor_name) for p in patterns)

    def skip_patterns(self) -> list[str]:
        """The skip patterns ``enable_layerwise_casting`` uses for this class."""
        try:
            from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN as default
        except ImportError:  # pragma: no cover - older diffusers
            default = _FALLBACK_SKIP_PATTERNS
        return sorted(set(default) | set(self.keep_fp32) | set(self.keep_fp32_strict) | set(self.skip_casting))

    def layerwise_cast_tensors(self) -> set[str]:
        """State-dict names of the tensors diffusers' layerwise casting stores in the storage dtype: the
        parameters and floating buffers of every supported leaf layer whose name no skip pattern matches."""
        if self.model is None:
            raise DDUFPackError(
                f"{self.component}: float8 storage needs the model class to decide which layers are cast "
                f"({self.library}.{self.class_name} could not be built from its config)")
        try:
            from diffusers.hooks._common import _GO_LC_SUPPORTED_PYTORCH_LAYERS as supported
        except ImportError:  # pragma: no cover
            supported = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d,
                         torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d, torch.nn.Linear, torch.nn.Embedding)
        patterns = self.skip_patterns()
        out: set[str] = set()

        def walk(module: torch.nn.Module, prefix: str) -> None:
            # Same traversal as diffusers.hooks.layerwise_casting._apply_layerwise_casting.
            if any(re.search(p, prefix) for p in patterns):
                return
            if isinstance(module, supported):
                for name, _ in module.named_parameters(remove_duplicate=False):
                    out.add(f"{prefix}.{name}" if prefix else name)
                for name, buf in module.named_buffers(remove_duplicate=False):
                    if buf.is_floating_point():
                        out.add(f"{prefix}.{name}" if prefix else name)
                return
            for name, child in module.named_children():
                walk(child, f"{prefix}.{name}" if prefix else name)

        walk(self.model, "")
        return out


def _as_list(value: Any) -> list[str]:
    if not value:
        return []
    if isinstance(value, str):
        return [value]
    return [v for v in value if isinstance(v, str)]


def import_class(library: str | None, class_name: str | None) -> type[Any] | None:
    if not library or not class_name:
        return None
    try:
        return getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError) as e:
        logger.info("cannot import %s.%s (%s): keep-in-fp32 rules unknown", library, class_name, e)
        return None


# --- safetensors rewriting ---------------------------------------------------------------------------


class _Planned(NamedTuple):
    info: TensorInfo
    dtype: str  # dtype written
    begin: int  # in the new data section
    end: int


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * spec.DTYPE_BY_TORCH[dtype].bits // 8


def _itemsize(dtype: str) -> int:
    return max(1, spec.DTYPE_BY_TORCH[dtype].bits // 8)


def plan_file(header: SafetensorsHeader, dtype_for: Mapping[str, str]) -> tuple[bytes, list[_Planned], int]:
    """New header bytes, tensor placements and total file size, for writing ``header``'s tensors with
    the dtypes in ``dtype_for`` (name -> dtype; missing names keep theirs). Tensors whose size is a
    multiple of 64 bytes come first, so they all start 64-byte aligned in the (page-aligned) data section;
    within each group widest element first (as safetensors does), which keeps every tensor aligned to its
    element size without padding (safetensors forbids holes)."""
    def key(t: TensorInfo) -> tuple[bool, int, str]:
        dtype = dtype_for.get(t.name, t.dtype)
        return _nbytes(t.shape, dtype) % 64 != 0, -_itemsize(dtype), t.name

    order = sorted(header.tensors.values(), key=key)
    planned, position = [], 0
    for info in order:
        dtype = dtype_for.get(info.name, info.dtype)
        size = _nbytes(info.shape, dtype)
        planned.append(_Planned(info, dtype, position, position + size))
        position += size
    record: dict[str, Any] = {}
    if header.metadata is not None:
        record[spec.SAFETENSORS_METADATA_KEY] = header.metadata
    for p in planned:
        record[p.info.name] = {"dtype": spec.DTYPE_BY_TORCH[p.dtype].safetensors, "shape": list(p.info.shape),
                               "data_offsets": [p.begin, p.end]}
    raw = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header so the data section is 8-byte aligned
    return raw, planned, 8 + len(raw) + position


def _tensor_chunks(path: Path, header: SafetensorsHeader, planned: list[_Planned], head: bytes,
                   entry: str, base: int = 0) -> Iterator[Any]:
    """The new file's bytes: header, then each tensor converted slice by slice from a private mmap of the
    source (whose safetensors file starts at ``base``: an entry of an archive being re-packed). Source pages are dropped from this process once converted (MADV_DONTNEED) so that RSS stays
    about one slice, not the whole file."""
    yield head
    clipped = [0]
    with open(open_source_file(entry, path)[0], "rb") as f:  # a regular file only, never waited on
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # writable for torch.frombuffer, never written
        try:
            for p in planned:
                start = base + header.data_start + p.info.begin
                if start + p.info.nbytes > size:
                    raise DDUFPackError(f"{entry}: {path} ends inside tensor {p.info.name} (it changed)")
                yield from _convert_tensor(mm, start, p, clipped)
                if hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                    page = start // mmap.PAGESIZE * mmap.PAGESIZE
                    mm.madvise(mmap.MADV_DONTNEED, page, start + p.info.nbytes - page)
        finally:
            try:
                mm.close()
            except BufferError:  # a consumer kept a view: the map goes with it
                pass
    if clipped[0]:
        logger.warning("%s: %d values beyond the float8 range were saturated to ±max", entry, clipped[0])


def _convert_tensor(mm: mmap.mmap, start: int, p: _Planned, clipped: list[int]) -> Iterator[Any]:
    nbytes = p.info.nbytes
    if p.dtype == p.info.dtype:
        for at in range(0, nbytes, SLICE_BYTES):
            view = memoryview(mm)[start + at : start + min(nbytes, at + SLICE_BYTES)]
            yield view
            view.release()
        return
    src_dtype = getattr(torch, p.info.dtype)
    dst_dtype = getattr(torch, p.dtype)
    width = _itemsize(p.info.dtype)
    per_slice = max(1, SLICE_BYTES // width)
    numel = nbytes // width
    fp8_max = torch.finfo(dst_dtype).max if p.dtype in FP8 else None
    for first in range(0, numel, per_slice):
        count = min(per_slice, numel - first)
        offset = start + first * width
        if offset % width:  # misaligned by a foreign writer: copy the slice first
            source = torch.frombuffer(bytearray(mm[offset : offset + count * width]), dtype=src_dtype)
        else:
            source = torch.frombuffer(mm, dtype=src_dtype, count=count, offset=offset)
        if fp8_max is not None:
            over = source.abs() > fp8_max
            if bool(over.any()):
                clipped[0] += int(over.sum())
                source = source.clamp(-fp8_max, fp8_max)  # saturate: plain casting gives NaN past the range
            del over
        converted = source.to(dst_dtype)
        del source
        yield converted.view(torch.uint8).numpy()
        del converted


def _file_sha256(path: Path) -> str:
    """sha256 of a source file. In the Hugging Face cache a weight file is a link to ``blobs/<sha256>``:
    the name is that digest (the LFS oid), so it is not read again."""
    resolved = path.resolve()
    if resolved.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", resolved.name):
        return resolved.name
    digest = hashlib.sha256()
    with open(open_source_file(str(path), resolved)[0], "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# --- components --------------------------------------------------------------------------------------


def _read_config(sources: list[EntrySource], component: str) -> dict[str, Any] | None:
    for source in sources:
        if source.name == f"{component}/config.json":
            raw = source.read_bytes() if source.file is not None else source.data
            value, _, _ = parse_json_entry(raw or b"", source.name)  # budgeted: None when over it or not JSON
            return value if isinstance(value, dict) else None
    return None


def _target_for(targets: Mapping[str, Target], component: str) -> Target | None:
    return targets.get(component, targets.get(DEFAULT_KEY))


def convert_sources(
    plan: FolderPlan, dtype: str | torch.dtype | Mapping[str, Any]
) -> tuple[list[EntrySource], dict[str, dict[str, Any]]]:
    """Entry sources with the floating weights of the chosen components converted, and the extra index
    records of converted components (for :func:`~dduf_plus.format.pack.write_archive`'s
    ``extra_components``).

    ``dtype`` is one dtype for every component (``"bfloat16"``) or a mapping such as
    ``{"unet": "float8_e4m3fn", "default": "bfloat16"}``; an fp8 value may name its compute dtype,
    ``"float8_e4m3fn:float16"`` (default: the component's dominant source dtype).

    Example:
        >>> plan = plan_folder("tiny-sd")
        >>> sources, extra = convert_sources(plan, {"unet": "float8_e4m3fn", "default": "bfloat16"})
        >>> write_archive("tiny-sd.dduf", plan.model_index, plan.model_index_bytes, sources, extra_components=extra)

    Raises:
        DDUFPackError: unknown dtype or component name; fp8 asked for a component whose model class cannot
            be built; a safetensors source that is not a file.
    """
    targets = parse_dtype_spec(dtype)
    specs = component_specs(plan.model_index)
    stored = {s.name.split("/")[0] for s in plan.sources if "/" in s.name}
    check_names(targets, specs, what="--dtype", where=str(Path(plan.folder) / "model_index.json"), error=PackNameError,
                wildcards=(DEFAULT_KEY,))
    by_component: dict[str, list[EntrySource]] = {}
    for source in plan.sources:
        by_component.setdefault(source.name.split("/")[0] if "/" in source.name else "", []).append(source)
    out: list[EntrySource] = []
    extra: dict[str, dict[str, Any]] = {}
    for component, sources in sorted(by_component.items()):
        target = _target_for(targets, component) if component in stored else None
        weights = [s for s in sources if s.name.endswith(".safetensors") and s.header is not None]
        if target is None or not weights:
            if component in targets and not weights:
                logger.info("%s has no safetensors weights: --dtype does not apply", component)
            out.extend(sources)
            continue
        converted, record = _convert_component(component, specs.get(component, (None, None)), sources, target,
                                               explicit=component in targets)
        out.extend(converted)
        if record:
            extra[component] = record
    return out, extra


class _Choice(NamedTuple):
    """What one component's tensors become."""

    storage: str  # the dtype asked for (fp8: of the tensors layerwise casting stores)
    compute: str | None  # fp8 only: the dtype of every other floating tensor
    cast: frozenset[str]  # fp8 only: the tensors layerwise casting stores in ``storage``
    rules: ComponentRules
    quanto: bool  # an optimum-quanto component: its quantized values (``*._data``) stay


def _convert_component(
    component: str, class_spec: tuple[str | None, str | None], sources: list[EntrySource], target: Target,
    *, explicit: bool,
) -> tuple[list[EntrySource], dict[str, Any]]:
    """Convert one component; ``explicit`` when ``--dtype`` named it (errors instead of skipping)."""
    library, class_name = class_spec
    config = _read_config(sources, component)
    quanto = any(s.name == f"{component}/{QUANTO_QMAP}" for s in sources)
    if not _may_convert_quantized(component, config, target, quanto, explicit):
        return sources, {}
    weights = [s for s in sources if s.name.endswith(".safetensors") and s.header is not None]
    stored = {name: (info.dtype, info.shape, info.nbytes) for s in weights if s.header is not None
              for name, info in s.header.tensors.items()}
    rules = ComponentRules(component, library, class_name, config, stored)
    resolved = _storage_target(component, rules, target, explicit)
    if resolved is None:
        return sources, {}
    dominant = summarize([s.header for s in weights if s.header is not None])["dtype"]
    choice = _choose(component, resolved, rules, dominant, quanto)
    counts = {"converted": 0, "kept_fp32": 0, "unchanged": 0}
    new_sources: list[EntrySource] = []
    converted_files: dict[str, tuple[list[_Planned], int]] = {}
    for source in weights:
        assert source.header is not None
        dtype_for = _tensor_dtypes(source.header, choice, counts)
        if not dtype_for:
            new_sources.append(source)  # nothing changes: keep the file byte-identical
            continue
        new_source, planned = _converted_source(source, source.header, dtype_for)
        new_sources.append(new_source)
        converted_files[source.name] = (planned, new_source.size)
    weight_names = {s.name for s in weights}
    for source in sources:
        if source.name in weight_names:
            continue
        rewritten = _rewrite_shard_index(source, component, sources, converted_files) if converted_files else None
        new_sources.append(rewritten or source)
    if not converted_files:
        logger.info("%s is already %s: packed unchanged", component, resolved.storage)
        return new_sources, {}
    record: dict[str, Any] = {"dtype_conversion": {"storage_dtype": choice.storage, "from": dominant, **counts}}
    if choice.compute is not None:
        record.update({"storage_dtype": choice.storage, "compute_dtype": choice.compute,
                       "layerwise_casting": {"skip_modules_pattern": rules.skip_patterns()}})
    return new_sources, record


def _may_convert_quantized(component: str, config: dict[str, Any] | None, target: Target, quanto: bool,
                           explicit: bool) -> bool:
    """False (packed unchanged) for a quantized component nothing meaningful converts: backend-specific
    layouts (bitsandbytes, torchao...: ``quantization_config``) and fp8 storage of quantized weights.
    Only a quanto component to a non-fp8 dtype converts (its scales, biases and unquantized layers)."""
    if not quanto and (config or {}).get("quantization_config") is None:
        return True
    if target.storage in FP8 or not quanto:
        if explicit:
            raise DDUFPackError(f"{component} is quantized ({QUANTO_QMAP if quanto else 'quantization_config'}); "
                                f"--dtype {target.storage} cannot apply to it")
        logger.info("%s is quantized: packed unchanged", component)
        return False
    return True


def _storage_target(component: str, rules: ComponentRules, target: Target, explicit: bool) -> Target | None:
    """``target``, unless it asks fp8 storage of a model the loader cannot restore it for: the loader uses
    diffusers' enable_layerwise_casting (diffusers models only). Then its compute dtype, or None (packed
    unchanged) when it names none; an explicit request is refused instead."""
    if target.storage not in FP8 or rules.is_diffusers:
        return target
    if explicit:
        raise DDUFPackError(f"{component}: float8 storage is supported for diffusers models only "
                            f"({rules.library}.{rules.class_name} is not one)")
    if target.compute is None:
        logger.info("%s: not a diffusers model, float8 storage skipped: packed unchanged", component)
        return None
    logger.info("%s: not a diffusers model, stored in %s instead of float8", component, target.compute)
    return Target(target.compute)


def _choose(component: str, target: Target, rules: ComponentRules, dominant: str | None, quanto: bool) -> _Choice:
    """The component's choice; for fp8, its compute dtype (asked for, else the dominant source dtype) and
    the tensors layerwise casting will store in fp8."""
    if target.storage not in FP8:
        return _Choice(target.storage, None, frozenset(), rules, quanto)
    compute = target.compute or dominant
    if compute is None or compute not in COMPUTE_DTYPES:
        raise DDUFPackError(f"{component}: cannot infer a compute dtype from {dominant!r} weights; "
                            f"give one: --dtype {component}={target.storage}:bfloat16")
    return _Choice(target.storage, compute, frozenset(rules.layerwise_cast_tensors()), rules, quanto)


def _tensor_dtypes(header: SafetensorsHeader, choice: _Choice, counts: dict[str, int]) -> dict[str, str]:
    """{tensor name: new dtype} for the tensors of one file that change; tallies every tensor in ``counts``."""
    dtype_for: dict[str, str] = {}
    for name, info in header.tensors.items():
        if info.dtype not in CONVERTIBLE or (choice.quanto and "._data" in name):
            counts["unchanged"] += 1
            continue
        if choice.compute is not None:  # fp8: layerwise-cast tensors in fp8, the rest in the compute dtype
            wanted = choice.storage if name in choice.cast else choice.compute
            keep = name not in choice.cast and choice.rules.keeps(name, choice.storage)
        else:
            wanted, keep = choice.storage, choice.rules.keeps(name, choice.storage)
        if keep:
            counts["kept_fp32"] += 1
        elif wanted != info.dtype:
            dtype_for[name] = wanted
            counts["converted"] += 1
    return dtype_for


def _converted_source(source: EntrySource, header: SafetensorsHeader,
                      dtype_for: dict[str, str]) -> tuple[EntrySource, list[_Planned]]:
    """The entry source writing ``source``'s file with ``dtype_for`` applied (converted lazily, slice by
    slice, when the archive is written), and the tensors' placements."""
    file = source.file
    if file is None:
        raise DDUFPackError(f"{source.name}: only safetensors files on disk (or an archive's entries) can be converted")
    head_raw, planned, size = plan_file(header, dtype_for)
    head = len(head_raw).to_bytes(8, "little") + head_raw
    new_header, problems = parse_header(head_raw, len(head_raw), size, source.name)
    if new_header is None or any(p.severity == "error" for p in problems):  # pragma: no cover - our own bug
        raise DDUFPackError(f"{source.name}: converted header does not check: {problems}")
    entry = source.name
    path, base = (file.path, file.offset) if isinstance(file, FileRegion) else (file, 0)

    def chunks() -> Iterator[Any]:
        return _tensor_chunks(path, header, planned, head, entry, base)

    sha = region_sha256(file) if isinstance(file, FileRegion) else _file_sha256(file)  # H002 checked there
    return EntrySource(entry, size=size, chunks=chunks, header=new_header, source_sha256=sha), planned


def _rewrite_shard_index(source: EntrySource, component: str, sources: list[EntrySource],
                         converted: Mapping[str, tuple[list[_Planned], int]]) -> EntrySource | None:
    """The shard index with ``metadata.total_size`` recomputed (``weight_map`` unchanged), or None when the
    entry is not a shard index of converted files."""
    kind = classify(source.name.split("/", 1)[1])
    if kind is None or not kind.is_index:
        return None
    raw = source.read_bytes() if source.file is not None else source.data
    index, _, _ = parse_json_entry(raw or b"", source.name)  # a shard index's budget; None when over it
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        return None
    shards = {f"{component}/{f}" for f in weight_map.values() if isinstance(f, str)}
    if not shards & set(converted):
        return None
    total = 0
    for shard in sorted(shards):
        if shard in converted:
            planned, _ = converted[shard]
            total += sum(p.end - p.begin for p in planned)
        else:
            header = next((s.header for s in sources if s.name == shard and s.header is not None), None)
            total += sum(t.nbytes for t in header.tensors.values()) if header else 0
    metadata = index.get("metadata")
    if isinstance(metadata, dict) and metadata.get("total_size") == total:
        return None  # same size (e.g. fp16 -> bf16): keep the file byte-identical
    index["metadata"] = {**(metadata if isinstance(metadata, dict) else {}), "total_size": total}
    data = (json.dumps(index, indent=2) + "\n").encode()
    original = hashlib.sha256(raw or b"").hexdigest()
    return EntrySource(source.name, data=data, source_sha256=original)


def pack_converted(
    folder: str | os.PathLike,
    output: str | os.PathLike,
    *,
    dtype: str | torch.dtype | Mapping[str, Any],
    variant: str | None = None,
    quiet: bool = False,
) -> PackResult:
    """Pack a diffusers folder with its weights converted (see :func:`convert_sources`).

    Example:
        >>> pack_converted("sd15", "sd15-bf16.dduf", dtype="bfloat16")
        >>> pack_converted("flux", "flux-fp8.dduf", dtype={"transformer": "float8_e4m3fn:bfloat16"})

    Raises:
        DDUFPackError: as :func:`~dduf_plus.format.pack.plan_folder` and :func:`convert_sources`.
    """
    plan = plan_folder(folder, variant=variant)
    sources, extra = convert_sources(plan, dtype)
    return write_archive(output, plan.model_index, plan.model_index_bytes, sources, skipped=plan.skipped,
                         extra_components=extra, quiet=quiet)


# --- loading side ------------------------------------------------------------------------------------


def apply_fp8_storage(model: torch.nn.Module, record: Mapping[str, Any]) -> torch.nn.Module:
    """Restore an fp8-stored component after its tensors are assigned (fp8 ones as they are, the others
    in the compute dtype): hooks diffusers' layerwise casting with the skip patterns recorded at pack time,
    so the layers cast are exactly the layers stored as fp8. Works for any ``nn.Module`` (transformers
    text encoders too); a diffusers model gets the same result from ``enable_layerwise_casting``.

    Example:
        >>> record = archive.index["components"]["unet"]
        >>> apply_fp8_storage(unet, record)   # weights stay fp8 in memory, forward runs in compute dtype
    """
    from diffusers.hooks import apply_layerwise_casting

    storage = getattr(torch, str(record["storage_dtype"]))
    compute = getattr(torch, str(record["compute_dtype"]))
    patterns = (record.get("layerwise_casting") or {}).get("skip_modules_pattern")
    if patterns is None:
        patterns = ComponentRules("", None, None, None).skip_patterns()
    apply_layerwise_casting(model, storage_dtype=storage, compute_dtype=compute,
                            skip_modules_pattern=tuple(patterns))
    return model
