"""save_dduf: write an in-memory diffusers pipeline as a DDUF archive, streaming the weights.

Each model's tensors go from the module straight into the archive: the safetensors header is computed
from names, dtypes and shapes, then every tensor's bytes are handed to the writer as a view of the
parameter itself (a converted copy of ONE tensor when ``dtype=`` changes it). No full copy of the
weights is ever built and no weights touch a temporary folder. Small non-weight files (configs,
tokenizer and scheduler files) come from each component's own save logic, through a temp dir.

The bytes equal what ``pipeline.save_pretrained`` writes (same tensor names after transformers'
checkpoint conversion, same header layout as ``safetensors.torch.save_file``), except that each model
is one unsharded file: DDUF entries are ZIP64, so no size limit calls for shards.

Models quantized with optimum-quanto (``quantize`` + ``freeze``) are stored as
:func:`~dduf_plus.torchkit.quanto_state.save_quanto_component` + ``dduf pack`` store them: quanto's flattened
state dict (``L.weight._data``, ``L.weight._scale``...) streamed in
:func:`~dduf_plus.torchkit.quanto_state.aligned_order`, ``quanto_qmap.json`` beside it, and the same
``quantization`` record in the index, so both routes give the same archive.

Models quantized by a diffusers quantizer (torchao, bitsandbytes, SDNQ) are stored as their
``save_pretrained`` writes them (:mod:`~dduf_plus.torchkit.quant_state`); the archive equals ``dduf pack``
of that folder (docs/precision.md, "Saving quantized pipelines")."""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..assignments import PackNameError, check_names
from ..errors import DDUFPackError, DDUFUsageError, path_argument
from ..format import spec
from ..format.chat_template import TEMPLATE_DIR, is_template_name
from ..format.pack import EntrySource, PackResult, Skipped, fold_sources, write_archive
from ..format.pipeline_kinds import COPY_NAME, LIST_CLASSES, alias_config, part_name, part_owner, with_parts
from ..format.structure import component_specs
from ..format.weights import weights_name
from ..storage.confined import Confined
from ..torchkit.tensor_stream import DtypeRule, tensor_bytes, tensor_source  # noqa: F401 (tensor_bytes re-exported)
from .identity import SourcesCopy
from .lora import saved_adapter_sources, with_lora_key
from .lora_save import pipeline_adapters, without_adapters
from .partial import BaseComparer, model_index_with, warn_local_paths

logger = logging.getLogger(__name__)

FLOATING_TO_CONVERT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # fp8/ints: never
_VARIANT = re.compile(r"^[A-Za-z0-9_]+$")  # what the weight-file naming rule (format/weights.py) parses back


def save_dduf(
    pipeline: Any,
    path: str | os.PathLike,
    *,
    variant: str | None = None,
    dtype: Any = None,
    quiet: bool = False,
    base: str | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
) -> PackResult:
    """Write ``pipeline`` (a diffusers ``DiffusionPipeline``) to ``path`` as a DDUF archive.

    ``base`` (a folder, a ``.dduf`` or a Hub repo ``org/name[@rev]``, as ``dduf pack --base``) makes a partial
    archive: every component that is BASE's by content (docs/partial.md) is referenced instead of stored,
    compared tensor by tensor with BASE's mapped files as the weights stream, nothing written to a temporary
    folder; ``token`` and ``local_files_only`` as for the Hub. A trainer's pipeline in memory becomes the
    archive ``save_pretrained`` + ``dduf pack --base`` would give.

    ``variant`` names the weight files as ``save_pretrained(variant=...)`` does
    (``diffusion_pytorch_model.fp16.safetensors``). ``dtype`` converts floating tensors (fp16/bf16/fp32/
    fp64; never fp8 or integers) while streaming, tensor by tensor: a torch dtype, its name, or a dict
    per component with a ``"default"`` entry. Modules a model keeps in fp32 (``_keep_in_fp32_modules``)
    are not downcast.

    Components quantized with optimum-quanto (``quantize`` + ``freeze``; qint8, qfloat8, qint4...) are
    stored quantized: the quantized tensors, ``quanto_qmap.json`` and an index ``quantization`` record,
    exactly as ``save_quanto_component`` + ``dduf pack`` store them; ``load_dduf`` reloads them quantized.
    ``dtype`` never touches their quantized values (``*._data``): a float16/bfloat16/float32 target
    converts only their scales, biases and unquantized layers (as ``dduf pack --dtype`` does); any other
    target (float8...) is an error when the dict names the component, and leaves it unchanged when it
    comes from a default.

    Diffusers models quantized by their ``quantization_config`` (torchao, bitsandbytes nf4 / fp4 / int8, or any
    backend diffusers saves as safetensors, such as SDNQ) are stored as their ``save_pretrained`` writes them
    (:mod:`~dduf_plus.torchkit.quant_state`), streamed from the live quantized tensors, with the index record
    ``dduf pack`` gives such a folder; ``dtype`` does not apply to them (an error when the dict names them).

    Example:
        >>> pipe = StableDiffusionPipeline.from_pretrained("stable-diffusion-v1-5", dtype=torch.float16)
        >>> save_dduf(pipe, "sd15.dduf").bytes_written

    Raises:
        DDUFPackError: a component cannot be written as DDUF (unsupported kind, a transformers model
            quantized by a ``quantization_config`` backend, a backend diffusers cannot save as safetensors,
            quanto layers not frozen, a ``dtype`` named for a quantized component that cannot apply,
            offloaded weights, files DDUF forbids, no config).
    """
    path = path_argument(path, "save_dduf(path=...)")
    if not callable(getattr(pipeline, "to_json_string", None)) or not isinstance(getattr(pipeline, "components", None), dict):
        raise DDUFUsageError(f"save_dduf(pipeline=...): expected a diffusers DiffusionPipeline, got {type(pipeline).__name__}")
    if variant is not None and not _VARIANT.match(variant):
        raise DDUFPackError(f"variant {variant!r}: use letters, digits and underscores only")
    model_index_bytes = pipeline.to_json_string().encode("utf-8")  # what pipeline.save_config writes
    model_index = json.loads(model_index_bytes)
    if isinstance(dtype, Mapping):  # a misspelt component is an error, never a dtype silently not applied
        check_names(dtype, component_specs(model_index), what="save_dduf(dtype={...}) key",
                    where=type(pipeline).__name__, error=PackNameError, wildcards=("default",))
    sources: list[EntrySource] = []
    skipped: list[Skipped] = []
    records: dict[str, dict[str, Any]] = {}
    adapters = pipeline_adapters(pipeline, component_specs(model_index))
    if adapters and not base:
        raise DDUFPackError(f"the pipeline has LoRA adapters ({', '.join(a.name for a in adapters)}): save_dduf "
                            "writes them as a LoRA archive of their base, give base=BASE (docs/lora.md); or fuse "
                            "them first (pipe.fuse_lora(); pipe.unload_lora_weights())")
    comparer = BaseComparer(base, variant=variant, token=token, local_files_only=local_files_only) if base else None
    references: dict[str, Any] = {}
    components, parts = _with_list_parts(_saveable_components(pipeline, model_index))
    named = with_parts(model_index, parts)
    if named is not None:  # a list's further parts named in model_index.json, as `dduf pack` names them
        model_index, model_index_bytes = named
    for name, component in components.items():
        owner = part_owner(model_index, name) or name  # a list's part: the list's dtype
        target = _component_dtype(dtype, owner)
        explicit = isinstance(dtype, Mapping) and dtype.get(owner) is not None
        comp_sources, comp_skipped, record = _component_sources(name, component, variant, target,
                                                                explicit=explicit)
        if comparer is not None and _referenced(comparer, name, model_index, comp_sources, references):
            continue
        sources.extend(comp_sources)
        skipped.extend(comp_skipped)
        if record:
            records[name] = record
    for item in skipped:
        logger.warning("save_dduf: not stored: %s (%s)", item.path, item.reason)
    if adapters:
        sources.extend(saved_adapter_sources(adapters, comparer))
        model_index = with_lora_key(model_index)
    if comparer is not None:
        warn_local_paths(comparer.local_paths)
        model_index, model_index_bytes = model_index_with(model_index, model_index_bytes, references)
    return write_archive(path, model_index, model_index_bytes, sources, skipped=skipped,
                         extra_components=records or None, references=references or None, quiet=quiet)


def _referenced(comparer: BaseComparer, name: str, model_index: Mapping[str, Any], sources: list[EntrySource],
                references: dict[str, Any]) -> bool:
    """Whether component ``name`` is BASE's by content: then its reference is added to ``references``. Says
    which on the ``dduf_plus`` logger, as ``dduf pack --base`` does."""
    type_hint = component_specs(model_index)[name]
    why, reference = comparer.reference_for(name, type_hint, SourcesCopy(name, sources))
    if reference is None:
        logger.info("stored %s: %s", name, why)
        return False
    references[name] = reference
    logger.info("referenced %s -> %s (same content: %d files there)", name, comparer.spec, len(reference["files"]))
    return True


# --- which components, and how -----------------------------------------------------------------------
def _saveable_components(pipeline: Any, model_index: Mapping[str, Any]) -> dict[str, Any]:
    """The components ``DiffusionPipeline.save_pretrained`` would save, with the same rules."""
    expected, _optional = pipeline._get_signature_keys(pipeline)
    out = {}
    for name, value in model_index.items():
        if name.startswith("_") or name not in expected:
            continue
        if not (isinstance(value, list) and len(value) == 2) or value[0] is None:
            continue  # null optional component or a plain config value
        component = getattr(pipeline, name, None)
        if component is None:
            continue
        out[name] = _unwrap(component)
    return out


def _with_list_parts(components: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Each list component (Multi-ControlNet, Multi-Adapter) as the folders its ``save_pretrained`` writes
    (``controlnet``, ``controlnet_1``...: diffusers' layout), and {list: its parts}."""
    out: dict[str, Any] = {}
    parts: dict[str, list[str]] = {}
    for name, component in components.items():
        models = getattr(component, "nets", None) if type(component).__name__ in LIST_CLASSES else None
        if models is None and type(component).__name__ in LIST_CLASSES:
            models = getattr(component, "adapters", None)
        if models is None:
            out[name] = component
            continue
        parts[name] = [part_name(name, i) for i in range(len(models))]
        out.update((part_name(name, i), _unwrap(model)) for i, model in enumerate(models))
    return out, parts


def _unwrap(component: Any) -> Any:
    return getattr(component, "_orig_mod", component)  # torch.compile wrapper


def _component_dtype(dtype: Any, name: str) -> torch.dtype | None:
    if isinstance(dtype, Mapping):
        dtype = dtype.get(name, dtype.get("default"))
    if dtype is None:
        return None
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise DDUFPackError(f"dtype {dtype!r} is not a torch dtype")
        return resolved
    if not isinstance(dtype, torch.dtype):
        raise DDUFPackError(f"dtype must be a torch dtype, its name or a dict of them, not {dtype!r}")
    return dtype


def _component_sources(
    name: str, component: Any, variant: str | None, dtype: torch.dtype | None, *, explicit: bool = False
) -> tuple[list[EntrySource], list[Skipped], dict[str, Any] | None]:
    """The entries of one component, its skipped files and its extra index record (quanto), if any.
    ``explicit``: ``dtype`` was asked for this component by name (errors instead of skipping)."""
    # the real class: diffusers' root module is typed with torch-less dummies
    from diffusers.models.modeling_utils import ModelMixin

    transformers_model = _transformers_model_class()
    record: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="dduf-save-") as tmp:
        folder = Path(tmp) / name
        folder.mkdir()
        weights: EntrySource | None = None
        if isinstance(component, ModelMixin):
            quanto = _quanto_state(component)
            entry = f"{name}/{weights_name('diffusers', variant)}"
            component.save_config(folder)  # exactly ModelMixin.save_pretrained's config step
            keep = _keep_in_fp32(component)
            if getattr(component, "hf_quantizer", None) is not None:  # bitsandbytes, torchao, SDNQ...
                weights, record = _backend_sources(name, entry, component, folder, dtype, explicit)
            elif quanto is not None:
                weights, record, _converted = _quanto_sources(name, entry, quanto, folder, dtype, keep, explicit)
            else:
                weights = weight_source(entry, without_adapters(component.state_dict()), dtype_for=_dtype_rule(dtype, keep),
                                        what=name)
        elif transformers_model is not None and isinstance(component, transformers_model):
            _refuse_quantized(name, component)
            quanto = _quanto_state(component)
            entry = f"{name}/{weights_name('transformers', variant)}"
            keep = _keep_in_fp32(component)
            if quanto is not None:  # the state dict quanto_state gives is the one load_quanto_component takes
                weights, record, converted = _quanto_sources(name, entry, quanto, folder, dtype, keep, explicit)
                _save_transformers_configs(component, folder, (dtype if converted else None) or component.dtype)
            else:
                state = transformers_checkpoint(component)
                _save_transformers_configs(component, folder, dtype or component.dtype)
                weights = weight_source(entry, state, dtype_for=_dtype_rule(dtype, keep), what=name)
        elif isinstance(component, torch.nn.Module) and any(True for _ in component.parameters()):
            raise DDUFPackError(f"component {name!r} ({type(component).__name__}) is a torch module that is "
                                "neither a diffusers nor a transformers model: save_dduf cannot stream its weights")
        else:
            _save_small_component(name, component, folder, variant)
        sources, skipped = _collect_small_files(name, folder)
    if weights is not None:
        sources.append(weights)
    names = {s.name.split("/", 1)[1] for s in sources}
    alias = alias_config(names)
    if alias is not None and COPY_NAME not in names:  # guider_config.json: DDUF readers need a config.json
        sources.append(EntrySource(f"{name}/{COPY_NAME}", data=next(s.data for s in sources
                                                                      if s.name == f"{name}/{alias}")))
        names.add(COPY_NAME)
    if not names & set(spec.CONFIG_FILES):
        raise DDUFPackError(f"component {name!r} ({type(component).__name__}) saved no config file "
                            f"(one of {', '.join(spec.CONFIG_FILES)}); DDUF needs one per component folder")
    return sources, skipped, record


def _transformers_model_class() -> type[Any] | None:
    if "transformers" not in sys.modules:
        return None  # a pipeline without transformers components never imported it
    from transformers import PreTrainedModel

    return PreTrainedModel


def _refuse_quantized(name: str, model: Any) -> None:
    """A transformers model quantized by a ``quantization_config`` backend: its save logic is transformers'
    own, not streamed here. Plain optimum-quanto models are not refused."""
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_quantized", False):
        raise DDUFPackError(f"component {name!r} is a transformers model quantized by its quantization_config; "
                            "save_dduf streams quantized diffusers models only (save it with its "
                            "save_pretrained and pack the folder)")


def _backend_sources(name: str, entry: str, model: Any, folder: Path, dtype: torch.dtype | None,
                     explicit: bool) -> tuple[EntrySource, dict[str, Any] | None]:
    """The weights entry of a model a diffusers quantizer quantized (what its ``save_pretrained`` writes:
    :func:`~dduf_plus.torchkit.quant_state.backend_state`) and its index record (as ``dduf pack`` makes it)."""
    from ..format import quant_rules
    from ..torchkit.quant_state import backend_state, quant_method

    if dtype is not None:
        if explicit:
            raise DDUFPackError(f"component {name!r} is quantized with {quant_method(model)}: dtype "
                                f"{str(dtype).removeprefix('torch.')} cannot apply to it (it is saved as quantized)")
        logger.info("%s is quantized with %s: dtype %s does not apply, saved as is", name, quant_method(model), dtype)
    state, metadata = backend_state(name, model)
    weights = weight_source(entry, state, metadata=metadata, what=name)
    config = json.loads((folder / "config.json").read_bytes())
    try:
        record = quant_rules.index_record(config, [weights.header]) if weights.header is not None else None
    except ValueError as e:  # QuantError: what validate would refuse in the archive
        raise DDUFPackError(f"component {name!r}: {getattr(e, 'code', 'Q001')}: {e}") from None
    return weights, record


# --- optimum-quanto components ---------------------------------------------------------------------------
QUANTO_CONVERTIBLE = (torch.float16, torch.bfloat16, torch.float32)  # targets that keep quanto's layout meaningful


def _quanto_state(model: Any) -> tuple[dict[str, torch.Tensor], bytes] | None:
    """``quant.quanto_state(model)``, or None without importing optimum-quanto when nobody did: a model
    cannot hold quanto layers unless optimum.quanto was imported."""
    if "optimum.quanto" not in sys.modules:
        return None
    from ..torchkit.quanto_state import quanto_state

    return quanto_state(model)


def _quanto_sources(
    name: str, entry: str, quanto: tuple[dict[str, torch.Tensor], bytes], folder: Path,
    dtype: torch.dtype | None, keep_fp32: tuple[str, ...], explicit: bool,
) -> tuple[EntrySource, dict[str, Any], bool]:
    """The weights entry of a quanto component (tensors in ``aligned_order``, as
    ``save_quanto_component`` writes them), its ``quanto_qmap.json`` (written into ``folder``), its
    index record and whether any tensor gets converted. ``dtype`` converts floating tensors other than
    the quantized values (``._data``)."""
    from ..format.quantization import QMAP_NAME, quanto_index_record

    tensors, qmap = quanto
    if dtype is not None and dtype not in QUANTO_CONVERTIBLE:
        if explicit:
            raise DDUFPackError(f"component {name!r} is quantized with optimum-quanto: dtype "
                                f"{str(dtype).removeprefix('torch.')} cannot apply to it (float16, bfloat16 or "
                                "float32 convert its scales and unquantized layers; its quantized values never change)")
        logger.info("%s is quantized with optimum-quanto: dtype %s does not apply, stored unchanged", name, dtype)
        dtype = None
    base_rule = _dtype_rule(dtype, keep_fp32)
    converted = False

    def rule(tname: str, tensor: torch.Tensor) -> torch.dtype | None:
        nonlocal converted
        if "._data" in tname:  # quanto's quantized values (int8, fp8, packed uint8): never converted
            return None
        target = base_rule(tname, tensor)
        converted = converted or target is not None
        return target

    weights = weight_source(entry, tensors, dtype_for=rule, what=name, aligned=True)
    Confined(folder).write_bytes(folder / QMAP_NAME, qmap, mode=0o644)
    return weights, quanto_index_record(json.loads(qmap)), converted


def _keep_in_fp32(model: Any) -> tuple[str, ...]:
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    return tuple(sorted(keep))


def _dtype_rule(dtype: torch.dtype | None, keep_fp32: tuple[str, ...]) -> DtypeRule:
    """(name, tensor) -> dtype to store, or None to keep. Same keep-in-fp32 test as diffusers' loader:
    a module name appearing as a component of the tensor's dotted name."""
    def rule(name: str, tensor: torch.Tensor) -> torch.dtype | None:
        if dtype is None or tensor.dtype == dtype or tensor.dtype not in FLOATING_TO_CONVERT:
            return None
        if keep_fp32 and any(m in name.split(".") for m in keep_fp32) and tensor.dtype == torch.float32:
            return None
        return dtype

    return rule


def _save_transformers_configs(model: Any, folder: Path, dtype: torch.dtype) -> None:
    """PreTrainedModel.save_pretrained's config step, on a copy (it would mutate the live config)."""
    config = copy.deepcopy(model.config)
    config.dtype = str(dtype).split(".")[1]
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(folder)
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def _save_small_component(name: str, component: Any, folder: Path, variant: str | None) -> None:
    """Tokenizers, schedulers, processors: their own save method, found as diffusers finds it."""
    method_name = _save_method_name(component)
    if method_name is None:
        raise DDUFPackError(f"component {name!r} ({type(component).__name__}) has no known save method")
    method = getattr(component, method_name)
    params = inspect.signature(method).parameters
    kwargs: dict[str, Any] = {}
    if "safe_serialization" in params:
        kwargs["safe_serialization"] = True
    if "variant" in params:
        kwargs["variant"] = variant
    method(str(folder), **kwargs)


def _save_method_name(component: Any) -> str | None:
    import importlib

    from diffusers.pipelines.pipeline_loading_utils import LOADABLE_CLASSES

    for library_name, classes in LOADABLE_CLASSES.items():
        if library_name not in sys.modules:
            continue  # a component of a library never imported cannot be an instance of its classes
        library = importlib.import_module(library_name)
        for base_name, methods in classes.items():
            base = getattr(library, base_name, None)
            if isinstance(base, type) and isinstance(component, base):
                return methods[0]
    return "save_pretrained" if callable(getattr(component, "save_pretrained", None)) else None


def _collect_small_files(name: str, folder: Path) -> tuple[list[EntrySource], list[Skipped]]:
    """What a save method wrote, as ``dduf pack`` would store it (chat templates folded into
    tokenizer_config.json, :func:`~dduf_plus.format.pack.fold_sources`)."""
    sources, skipped = [], []
    for path in sorted(folder.iterdir()):
        rel = f"{name}/{path.name}"
        if path.name == TEMPLATE_DIR or is_template_name(path.name):
            continue  # folded below
        if path.is_dir():
            raise DDUFPackError(f"component {name!r}: its save method wrote a sub-folder {path.name!r}, "
                                "which DDUF cannot hold")
        if not path.name.endswith(spec.ALLOWED_EXTENSIONS):
            skipped.append(Skipped(rel, "file type not allowed in DDUF"))
            continue
        if path.name.endswith(".safetensors"):  # a small component with weights we did not plan for
            raise DDUFPackError(f"component {name!r}: unexpected weights file {path.name}")
        sources.append(EntrySource(rel, data=path.read_bytes()))
    sources, _folded = fold_sources(name, folder, sources)  # (a template it cannot fold: fold_sources warns)
    return sources, skipped


# --- transformers: the state dict save_pretrained writes ---------------------------------------------
def transformers_checkpoint(model: Any) -> dict[str, torch.Tensor]:
    """The tensors ``PreTrainedModel.save_pretrained`` writes, by the names it writes them under:
    ignored keys dropped, tied weights removed (by transformers' own rule), and the load-time key
    renaming reverted (transformers 5 ``revert_weight_conversion``). No tensor data is copied except by
    conversions that merge or split tensors (none in the usual diffusion text encoders)."""
    from transformers import modeling_utils

    state = without_adapters(model.state_dict())  # peft's wrapped layers, as their base model saved them
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    for tname, tensor in state.items():
        if tensor.device.type == "meta":
            raise DDUFPackError(f"{type(model).__name__}.{tname} is on the meta device (offloaded?): "
                                "move the model to a real device before saving")
    remove_tied = getattr(modeling_utils, "remove_tied_weights_from_state_dict", None)
    if remove_tied is not None:
        kept = remove_tied(_storage_tokens(state), model)
        state = {k: state[k] for k in kept}
    else:  # transformers 4: drop exact aliases, keeping the first name
        seen: set[tuple[Any, ...]] = set()
        unique: dict[str, Any] = {}
        for k, t in state.items():
            if _area(t) not in seen:
                seen.add(_area(t))
                unique[k] = t
        state = unique
    revert = getattr(modeling_utils, "revert_weight_conversion", None)
    if revert is not None:
        state = revert(model, state)
    return state


def _area(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.data_ptr(), t.nbytes, t.dtype, tuple(t.shape))


def _storage_tokens(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One tiny tensor per distinct memory area, shared by exact aliases (tied weights).

    transformers decides tied weights by storage identity and clones "disjoint views of one storage";
    weights materialized into one flat buffer per component (our CUDA path) would all look shared and
    be cloned, doubling memory. Tokens keep its policy for true aliases and make views independent."""
    tokens: dict[tuple[Any, ...], torch.Tensor] = {}
    return {name: tokens.setdefault(_area(t), torch.empty(1)) for name, t in state.items()}


# --- safetensors bytes, streamed (torchkit.tensor_stream; the quanto layout order from torchkit.quanto_state) -----------
def weight_source(
    entry: str,
    state: Mapping[str, torch.Tensor],
    *,
    dtype_for: DtypeRule | None = None,
    metadata: Mapping[str, str] | None = None,
    what: str = "",
    aligned: bool = False,
) -> EntrySource:
    """:func:`~dduf_plus.torchkit.tensor_stream.tensor_source`; ``aligned=True`` lays the tensors out in
    :func:`~dduf_plus.torchkit.quanto_state.aligned_order` (of their stored sizes) instead of safetensors' order, as
    ``save_quanto_component`` does, so that quantized int8 weights start 64-byte aligned and need no copy at load."""
    order = None
    if aligned:
        from ..torchkit.quanto_state import aligned_order

        rule = dtype_for or (lambda name, tensor: None)
        sizes = {}
        for name, tensor in state.items():
            if not isinstance(tensor, torch.Tensor):
                raise DDUFPackError(f"{what}: state dict entry {name!r} is not a tensor")
            target = rule(name, tensor) or tensor.dtype
            size = torch.empty((), dtype=target).element_size()
            sizes[name] = (tensor.numel() * size, size)
        order = aligned_order(sizes)
    return tensor_source(entry, state, dtype_for=dtype_for, metadata=metadata, what=what, order=order)
