"""Quantized components: optimum-quanto (``quanto_qmap.json``) and diffusers' ``quantization_config``.

Saving. A module quantized with optimum-quanto (``quantize`` + ``freeze``) has a ``state_dict()`` of plain
tensors: a quantized weight ``W`` of a layer ``L`` is flattened into ``L.weight._data`` (int8 or float8
values; for qint4/qint2 the packed uint8 ``L.weight._data._data``), ``L.weight._scale`` and, for
qint4/qint2, ``L.weight._shift``; every quantized layer adds ``L.input_scale`` / ``L.output_scale``.
:func:`quanto_state` returns that state dict (contiguous, CPU, unshared) and the quantization map
(``quanto_qmap.json``, quanto's own name for it); the component folder of the archive holds both.

Loading. quanto's ``requantize`` first materialises every meta parameter as an empty full-precision
tensor (``torch.empty_like(t, device="cpu")``), then loads the quantized state over it: a qint8 model
briefly needs its fp32 size in RAM. :func:`load_quanto_component` never does: it builds the model on the
meta device, swaps the layers the map names for quanto's ``Q*`` layers (still on meta, via
``qcreate(..., device="meta")``), and loads the stored tensors with ``load_state_dict(assign=True)``, so
quanto's own ``_load_from_state_dict`` wraps the archive's mmap views into ``WeightQBytesTensor`` /
``WeightQBitsTensor`` without copying them (qint4 is unpacked to quanto's kernel layout, a
quantized-sized transient per layer). Peak memory is the quantized size.

Components that carry a diffusers ``quantization_config`` in config.json go through
:func:`load_with_diffusers_quantizer`: ``quant_method == "quanto"`` (diffusers' QuantoConfig) stores the
same tensors, so it is rebuilt the same zero-copy way from a map derived from the config; torchao,
bitsandbytes and SDNQ are rebuilt over the archive's views by :mod:`dduf_plus.loading.quant_backends`; any other
method is handed to its diffusers quantizer through ``from_pretrained`` for a folder component, and refused inside
an archive (:data:`CPU_BACKENDS` says what runs without a GPU).

optimum-quanto is optional (``pip install "dduf_plus[quanto]"``); without it, loading a quanto component
raises :class:`~dduf_plus.errors.DDUFLoadError` saying so. This module's top level imports neither torch nor
quanto; the torch-free parts (``QMAP_NAME``, the index record) live in :mod:`dduf_plus.format.quantization`."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import DDUFLoadError
from ..format.quantization import QMAP_NAME, QUANTO_ALIGNMENT, backend_of, quanto_index_record  # noqa: F401 (re-exported)
from ..torchkit.backend_import import import_backend
from ..torchkit.meta_model import construction_budget, is_diffusers_model
from ..torchkit.quanto_state import aligned_order, quanto_state, save_quanto_component  # noqa: F401 (re-exported)
from . import quant_backends
from .files import ComponentFiles, FolderComponentFiles, tensor_metadata
from .quant_model import check_state_keys, empty_model, finish_model, torch_dtype
from .quant_sdnq import load_sdnq_component

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'dduf_plus[quanto]'"
KERNEL_ALIGNMENT = QUANTO_ALIGNMENT  # bytes; quanto's CPU int8 kernel needs 16, AVX-512 paths like 64
# diffusers' QuantoConfig.weights_dtype -> quanto qtype attribute (diffusers/quantizers/quanto/utils.py)
_DIFFUSERS_QUANTO_WEIGHTS = {"float8": "qfloat8", "int8": "qint8", "int4": "qint4", "int2": "qint2"}
# What works without a GPU, as checked for this release (docs/precision.md has the table).
CPU_BACKENDS = {
    "quanto": "yes: zero-copy load by dduf_plus (qint8, qfloat8, qint4, qint2 weights)",
    "bitsandbytes_4bit": "yes: zero-copy load by dduf_plus (nf4 checked on CPU with bitsandbytes 0.50; diffusers' "
                         "own from_pretrained refuses without a GPU)",
    "bitsandbytes_8bit": "yes: zero-copy load by dduf_plus (int8 checked on CPU with bitsandbytes 0.50; diffusers' "
                         "own from_pretrained refuses without a GPU)",
    "torchao": "yes: zero-copy load by dduf_plus (torchao>=0.16 safetensors layout; int8 weight-only checked on "
               "CPU with torchao 0.18)",
    "sdnq": "yes: zero-copy load by dduf_plus (int8, uint4, float8_e4m3fn weights checked on CPU with sdnq 0.2.8)",
    "gguf": "not applicable: DDUF cannot hold .gguf files",
}


# --- torch-free helpers ------------------------------------------------------------------------------


def rebuilt_here() -> str:
    """The quantization methods load_dduf rebuilds from an archive, as a message names them (from the loaders'
    own tables, so that it cannot go stale: quanto here, the others in quant_backends.BACKENDS)."""
    methods = sorted({"quanto", *(m.partition("_")[0] for m in quant_backends.SUPPORTED)})
    return ", ".join(methods[:-1]) + " and " + methods[-1]


def _require_quanto() -> Any:
    try:
        return import_backend("optimum.quanto")  # with the Hub off (see torchkit.backend_import)
    except ImportError as e:
        raise DDUFLoadError(f"this component was quantized with optimum-quanto, which is not installed ({e}); "
                            f"install it with: {INSTALL_HINT}") from None


# --- loading -----------------------------------------------------------------------------------------


def check_qmap(qmap: Any, quanto: Any, where: str) -> dict[str, dict[str, Any]]:
    """``quanto_qmap.json`` as quanto's skeleton reads it: {module: {"weights": qtype name, "activations": ...}}.

    Raises:
        DDUFLoadError: naming the entry and what is wrong (not an object, a qtype that is no name or unknown).
    """
    if not isinstance(qmap, dict):
        raise DDUFLoadError(f"{where}: {QMAP_NAME} must be a JSON object")
    for name, entry in qmap.items():
        if not isinstance(entry, dict):
            raise DDUFLoadError(f"{where}: {QMAP_NAME} entry {name!r} is not an object")
        for key in ("weights", "activations"):
            value = entry.get(key, "none")
            if value is not None and not isinstance(value, str):  # a list or object: unhashable, a bare TypeError
                raise DDUFLoadError(f"{where}: {QMAP_NAME} entry {name!r}: {key} is a {type(value).__name__}, not a "
                                    "qtype name")
            if value not in ("none", None) and value not in quanto.tensor.qtypes:
                raise DDUFLoadError(f"{where}: {QMAP_NAME} entry {name!r}: unknown {key} qtype {value!r} "
                                    f"(known: {', '.join(sorted(quanto.tensor.qtypes))})")
    return qmap


def _quantize_skeleton(model: torch.nn.Module, qmap: Mapping[str, Mapping[str, Any]], quanto: Any,
                       where: str) -> None:
    """Replace the layers the map names with quanto layers, on the meta device: no weight is allocated
    (quanto's ``requantize`` would create empty full-precision tensors here)."""
    from optimum.quanto.nn.qmodule import _QMODULE_TABLE
    from optimum.quanto.quantize import set_module_by_name

    for name, entry in qmap.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise DDUFLoadError(f"{where}: {QMAP_NAME} names {name!r}, which the model does not have") from None
        weights = entry.get("weights") if entry.get("weights") not in ("none", None) else None
        activations = entry.get("activations") if entry.get("activations") not in ("none", None) else None
        qcls = next((q for base, q in _QMODULE_TABLE.items() if isinstance(module, base)), None)
        if qcls is None:
            raise DDUFLoadError(f"{where}: quanto has no quantized form of {name!r} ({type(module).__name__})")
        qmodule = qcls.qcreate(module, weights, activations, None, device="meta")
        if qmodule is None:
            raise DDUFLoadError(f"{where}: quanto cannot quantize {name!r} with {entry}")
        qmodule.name = name
        set_module_by_name(model, name, qmodule)


def _expected_keys(model: torch.nn.Module, quanto: Any) -> set[str]:
    """State-dict keys of the quantized model, from the meta skeleton (nothing materialised)."""
    keys: set[str] = set()
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, param in module.named_parameters(recurse=False):
            if name == "weight" and isinstance(module, quanto.QModuleMixin) and module.weight_qtype is not None:
                if module.weight_qtype.bits == 8:
                    keys.update({f"{dot}weight._data", f"{dot}weight._scale"})
                else:
                    keys.update({f"{dot}weight._data._data", f"{dot}weight._scale", f"{dot}weight._shift"})
            elif param is not None:
                keys.add(dot + name)
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                keys.add(dot + name)
    return keys


def load_quanto_component(
    model_cls: type[Any],
    config: Mapping[str, Any],
    files: ComponentFiles,
    *,
    device: Any = None,
    dtype: Any = None,
    variant: str | None = None,
    qmap: Mapping[str, Any] | None = None,
) -> torch.nn.Module:
    """Build a quanto-quantized component from its config, quantization map and stored quantized tensors,
    without allocating any full-precision weight.

    Args:
        model_cls: the component's class (diffusers ``ModelMixin`` or transformers ``PreTrainedModel``).
        config: its config.json as a dict.
        files: the component's files (``ComponentFiles``: ``read_json``, ``weight_files``, ``tensors``); the
            tensors it returns should view the archive's mmap, which this function keeps (zero copy).
        device: where to put the model (default: CPU, where the mmap views are).
        dtype: compute dtype; None or ``"auto"`` keeps the stored one (the dtype of the quantization
            scales). Another dtype casts the scales and the unquantized floating tensors only.
        variant: weight variant to read.
        qmap: the quantization map (default: the component's ``quanto_qmap.json``).

    Example:
        >>> unet = load_quanto_component(UNet2DConditionModel, config, files, dtype="auto")

    Raises:
        DDUFLoadError: optimum-quanto missing (with the install command), a malformed map, tensors missing
            or unexpected, or a layer quanto cannot build.
    """
    quanto = _require_quanto()
    where = str(getattr(files, "description", None) or getattr(files, "name", "component"))
    qmap = check_qmap(_read_qmap(files, where) if qmap is None else qmap, quanto, where)
    target_dtype = torch_dtype(dtype)
    model = empty_model(model_cls, config, where, files, variant)
    _quantize_skeleton(model, qmap, quanto, where)
    state = dict(files.tensors(files.weight_files(variant)))
    check_state_keys(state, _expected_keys(model, quanto), model, f"{where}: stored tensors do not match the "
                      f"quantized {model_cls.__name__}")
    check_quanto_shapes(model, state, quanto, where)
    _realign_int8(state, where)
    if target_dtype is not None:
        _cast_floating(state, target_dtype, set(getattr(model, "_keep_in_fp32_modules", None) or []))
    # assign=True: quanto's QModuleMixin._load_from_state_dict wraps the stored `_data`/`_scale` views
    # into its weight tensors and assigns them; every other tensor is assigned as is (no copy).
    model.load_state_dict(state, strict=False, assign=True)
    return finish_model(model, where, device)


def _read_qmap(files: ComponentFiles, where: str) -> Any:
    try:
        return files.read_json(QMAP_NAME)
    except Exception as e:  # the protocol's own errors: missing entry, bad JSON
        raise DDUFLoadError(f"{where}: cannot read {QMAP_NAME}: {e}", code=getattr(e, "code", None)) from e


def check_quanto_shapes(model: torch.nn.Module, state: Mapping[str, Any], quanto: Any, where: str) -> None:
    """Q006: each quanto layer's stored weight parts have the shapes and dtypes the layer computes with, before
    quanto wraps them (it takes any at load; the first forward then hands them to torch's int8 / int4 kernels,
    which index one scale per output row or group, or to its own unpacking). 8-bit (qint8, qfloat8): ``_data``
    is the layer's weight shape in the qtype's dtype (uint8 bytes taken as int8 values: another model) and
    ``_scale`` one float per output (``[out, 1, ...]``); 4 / 2-bit: ``_data._data`` the uint8 packing of the
    weight (grouped as the layer groups it), ``_scale`` one float per row of that, ``_shift`` shaped like it."""
    for name, module in model.named_modules():
        qtype = getattr(module, "weight_qtype", None) if isinstance(module, quanto.QModuleMixin) else None
        if qtype is None:
            continue
        problem = quanto_weight_problem(module, qtype, f"{name}." if name else "", state)
        if problem is not None:
            raise DDUFLoadError(f"{where}: Q006: {name} ({qtype.name}) is stored with {problem}", code="Q006")


def quanto_weight_problem(module: Any, qtype: Any, dot: str, state: Mapping[str, Any]) -> str | None:
    """What is wrong with one quanto layer's stored weight parts (see :func:`check_quanto_shapes`), or None."""
    import torch

    wanted = tuple(module.weight.shape)
    scale, shift = state.get(f"{dot}weight._scale"), state.get(f"{dot}weight._shift")
    if qtype.bits == 8:
        data, rows, data_shape, data_dtype = state.get(f"{dot}weight._data"), wanted, wanted, qtype.dtype
    else:  # quanto groups the weight into [n, group] rows (group_size None: as it is) and packs dim 0
        group = getattr(module, "weight_group_size", None)
        rows = wanted if group is None else (math.prod(wanted) // group, group)
        data, data_dtype = state.get(f"{dot}weight._data._data"), torch.uint8
        data_shape = (-(-rows[0] // (8 // qtype.bits)), *rows[1:])
    per_row = (rows[0], *([1] * (len(rows) - 1)))
    if data is not None and (tuple(data.shape) != data_shape or data.dtype != data_dtype):
        return (f"weight._data {str(data.dtype).removeprefix('torch.')} {list(data.shape)}, the layer's weight "
                f"needs {str(data_dtype).removeprefix('torch.')} {list(data_shape)}")
    if scale is not None and (tuple(scale.shape) != per_row or not scale.is_floating_point()):
        return (f"weight._scale {str(scale.dtype).removeprefix('torch.')} {list(scale.shape)}, one float scale per "
                f"{'output' if qtype.bits == 8 else 'row'} {list(per_row)}")
    if shift is not None and scale is not None and shift.shape != scale.shape:
        return f"weight._shift {list(shift.shape)} unlike weight._scale {list(scale.shape)}"
    return None


def _realign_int8(state: dict[str, Any], where: str) -> None:
    """Copy every int8 weight (``._data``) that does not start on a :data:`KERNEL_ALIGNMENT` boundary.

    quanto runs bf16 x int8 on CPU with torch._weight_int8pack_mm, which crashes (SIGSEGV) on int8 weights
    that are not 16-byte aligned. Whether that kernel runs depends on the dtype the model computes in: the
    scales' dtype after loading, after a ``dtype=`` cast, or after the caller's own ``model.to(torch.bfloat16)``
    (deciding from the stored scales' dtype, as this did, let fp16 scales loaded as bf16 through: SIGSEGV on the
    first forward). So every misaligned int8 payload is copied, whatever the dtypes: the same list
    ``dduf validate`` reports as Q008 (format.quantization.quanto_unaligned). A file written in aligned_order()
    order (save_quanto_component does) needs no copy."""
    import torch

    realigned = 0
    for key, tensor in state.items():
        if tensor.dtype == torch.int8 and key.endswith("._data") and tensor.data_ptr() % KERNEL_ALIGNMENT:
            state[key] = tensor.clone()  # torch's CPU allocator aligns to 64 bytes
            realigned += tensor.nbytes
    if realigned:
        logger.info("%s: Q008: copied %d bytes of int8 weights not %d-byte aligned for quanto's kernels", where,
                    realigned, KERNEL_ALIGNMENT)


def _cast_floating(state: dict[str, Any], target_dtype: torch.dtype, keep_fp32: set[str]) -> None:
    """Quantized values (`._data`) keep their integer/fp8 dtype; scales, shifts, biases and unquantized
    layers take the compute dtype, except modules the class keeps in fp32."""
    for key, tensor in state.items():
        if (tensor.is_floating_point() and tensor.dtype != target_dtype and "._data" not in key
                and not any(m in key.split(".") for m in keep_fp32)):
            state[key] = tensor.to(target_dtype)


def quanto_qmap_from_config(model: torch.nn.Module, quantization_config: Mapping[str, Any]) -> dict[str, Any]:
    """The quantization map implied by diffusers' ``QuantoConfig`` for ``model``: the same layers
    diffusers' ``_replace_with_quanto_layers`` converts (every ``nn.Linear`` whose own name is not in
    ``modules_to_not_convert`` or the class' ``_keep_in_fp32_modules``)."""
    import torch

    quanto = _require_quanto()
    weights = _DIFFUSERS_QUANTO_WEIGHTS.get(str(quantization_config.get("weights_dtype")))
    if weights is None:
        raise DDUFLoadError(f"quanto quantization_config: unknown weights_dtype {quantization_config.get('weights_dtype')!r}")
    qtype_name = getattr(quanto, weights).name
    skip = quantization_config.get("modules_to_not_convert") or []
    skip = [skip] if isinstance(skip, str) else list(skip)
    skip += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return {name: {"weights": qtype_name, "activations": "none"}
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in skip}


def load_with_diffusers_quantizer(
    model_cls: type[Any],
    config: Mapping[str, Any],
    files: ComponentFiles,
    *,
    device: Any = None,
    dtype: Any = None,
    variant: str | None = None,
) -> torch.nn.Module:
    """Load a component whose config.json holds a ``quantization_config``.

    ``quant_method == "quanto"`` is rebuilt zero-copy by :func:`load_quanto_component`; torchao, bitsandbytes
    and SDNQ by :mod:`~dduf_plus.loading.quant_backends`. Every other method needs its quantizer to read the
    files from disk: for a folder component (a reference resolved to a
    folder) it is passed to ``model_cls.from_pretrained`` on that folder; inside an archive it is refused
    with a message saying what to do (weights are never extracted). See :data:`CPU_BACKENDS` for what works without a GPU.

    Raises:
        DDUFLoadError: the quantizer's library is missing or refuses this machine (the message says which).
    """
    where = str(getattr(files, "description", None) or getattr(files, "name", "component"))
    method = backend_of(config)
    if method is None:
        raise DDUFLoadError(f"{where}: config.json has no quantization_config.quant_method")
    if method == "quanto":
        _require_quanto()
        skeleton = empty_model(model_cls, config, where, files, variant)
        qmap = quanto_qmap_from_config(skeleton, config["quantization_config"])
        del skeleton
        return load_quanto_component(model_cls, config, files, device=device, dtype=dtype, variant=variant,
                                     qmap=qmap)
    if method in quant_backends.SUPPORTED:  # torchao, bitsandbytes, sdnq: over the archive's views
        return load_backend_component(model_cls, config, files, device=device, dtype=dtype, variant=variant)
    hint = CPU_BACKENDS.get(method, "untested backend")
    if not isinstance(files, FolderComponentFiles):
        # Its quantizer reads the weights from disk itself, and dduf_plus never extracts weights from an archive.
        raise DDUFLoadError(
            f"{where}: quantized with {method} (quantization_config); load_dduf rebuilds {rebuilt_here()} "
            f"only, and {method}'s own quantizer needs the files on disk (CPU support: {hint}). Unpack the "
            "archive (`dduf unpack`) and load that folder with diffusers, or reference the component from a folder")
    target_dtype = torch_dtype(dtype)
    folder = files.local_dir(files.listdir())  # a folder component: its own path, nothing is copied
    # A verified local folder: nothing is fetched and no code from the files runs.
    kwargs: dict[str, Any] = {"local_files_only": True}
    if not is_diffusers_model(model_cls):
        kwargs["trust_remote_code"] = False
    if target_dtype is not None:
        kwargs["torch_dtype" if is_diffusers_model(model_cls) else "dtype"] = target_dtype
    if device is not None:
        kwargs["device_map"] = str(device)
    if variant is not None:
        kwargs["variant"] = variant
    stored = tensor_metadata(files, files.weight_files(variant))
    try:  # the quantizer's own construction, under the same budget as every other (torchkit/meta_model.py)
        with construction_budget(where, model_cls.__name__, stored):
            return model_cls.from_pretrained(folder, **kwargs)
    except (ImportError, RuntimeError, ValueError) as e:
        raise DDUFLoadError(f"{where}: diffusers' {method} quantizer failed ({e}); CPU support: {hint}") from e


def load_backend_component(model_cls: type[Any], config: Mapping[str, Any], files: ComponentFiles, *,
                           device: Any = None, dtype: Any = None, variant: str | None = None) -> torch.nn.Module:
    """Dispatch on the config's backend (see :data:`~dduf_plus.loading.quant_backends.SUPPORTED`)."""
    backend = quant_backends.backend_of(config)
    if backend == "torchao":
        return quant_backends.load_torchao_component(model_cls, config, files, device=device, dtype=dtype,
                                                     variant=variant)
    if backend in ("bitsandbytes_4bit", "bitsandbytes_8bit"):
        return quant_backends.load_bnb_component(model_cls, config, files, device=device, variant=variant)
    if backend == "sdnq":
        return load_sdnq_component(model_cls, config, files, device=device, dtype=dtype, variant=variant)
    raise DDUFLoadError(f"{getattr(files, 'description', 'component')}: no zero-copy loader for {backend}")
