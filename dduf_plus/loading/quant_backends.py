"""Components quantized by diffusers' torchao and bitsandbytes quantizers, rebuilt from the archive's own tensor
views; SDNQ's are in :mod:`dduf_plus.loading.quant_sdnq`, dispatched from :func:`load_backend_component`.

diffusers' ``from_pretrained(folder)`` of a torchao-quantized model reads the safetensors ``__metadata__``
(one JSON description per tensor), regroups the flattened parts (``L._weight_qdata``, ``L._weight_scale``,
...) into torchao tensor subclasses (``Int8Tensor``...) and assigns them as the ``nn.Linear`` weights. This
module builds the same thing without a folder and without a full-precision copy:

1. the model on the meta device (nothing allocated);
2. the metadata checked torch-free first (:mod:`dduf_plus.format.quant_rules`: sizes, depth, torchao's
   class allow-list, every quantized weight with all its parts, shapes and dtypes that fit);
3. each quantized weight made by torchao's own constructor (``object_from_dict``, the function
   diffusers' path calls) over the archive's mmapped tensor views: the quantized data is never copied;
4. ``load_state_dict(assign=True)``: every tensor of the model is a view of the archive.

Resident memory is the stored bytes that are touched, as for unquantized components. torchao is
optional: without it the loader raises a :class:`~dduf_plus.errors.DDUFLoadError` naming the component,
the backend and the pip command."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import DDUFLoadError
from ..format.quant_bnb import bnb_groups
from ..format.quant_rules import analyse
from ..format.quant_torchao import torchao_descriptions, torchao_groups
from ..format.quantization import QuantError, backend_of
from ..format.safetensors_header import SafetensorsHeader, TensorInfo
from ..torchkit.backend_import import import_backend
from .files import ComponentFiles
from .quant_model import check_state_keys, empty_model, finish_model, torch_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)

# backend (as format.quantization.backend_of names it) -> (module to import, pip command)
BACKENDS = {
    "torchao": ("torchao", "pip install 'dduf_plus[quant]'  (or: pip install 'torchao>=0.16')"),
}
BACKENDS["bitsandbytes_4bit"] = ("bitsandbytes", "pip install 'dduf_plus[quant]'  (or: pip install bitsandbytes)")
BACKENDS["bitsandbytes_8bit"] = BACKENDS["bitsandbytes_4bit"]
BACKENDS["sdnq"] = ("sdnq", "pip install 'dduf_plus[quant]'  (or: pip install 'sdnq>=0.2.8')")
SUPPORTED = frozenset(BACKENDS)


def require_backend(backend: str, where: str) -> Any:
    """The backend's module, or a DDUFLoadError naming the component, the backend and how to install it."""
    module, hint = BACKENDS[backend]
    try:
        return import_backend(module)  # with the Hub off: importing may download (see backend_import)
    except ImportError as e:
        raise DDUFLoadError(f"{where}: quantized with {backend}, which is not installed here ({e}); install it "
                            f"with: {hint}") from None


def component_headers(files: ComponentFiles, filenames: Sequence[str]) -> list[SafetensorsHeader]:
    """The parsed safetensors headers of ``filenames`` (archive or folder component): nothing new is read."""
    archive = getattr(files, "archive", None)
    if archive is not None:
        return [archive.headers[f"{files.name}/{f}"] for f in filenames if f"{files.name}/{f}" in archive.headers]
    header_of = getattr(files, "safetensors_header", None)  # a folder component (FolderComponentFiles)
    if header_of is None:
        raise DDUFLoadError(f"{files.description}: cannot read the safetensors headers of a quantized component here")
    return [header_of(f) for f in filenames]


def load_torchao_component(model_cls: type[Any], config: Mapping[str, Any], files: ComponentFiles, *, device: Any = None,
                           dtype: Any = None, variant: str | None = None) -> torch.nn.Module:
    """Rebuild a component saved by diffusers' torchao quantizer as the modules ``from_pretrained`` builds.

    ``dtype``: None or ``"auto"`` keeps every tensor as saved (diffusers' own reload defaults to the same
    for a pre-quantized torchao model); another dtype casts the unquantized floating tensors only (the
    quantized weights keep their stored layout and compute dtype).

    Raises:
        DDUFLoadError: torchao missing (with the pip command), the component not self-consistent (its Q0xx
            rule), tensors missing or unexpected for the model.
    """
    where = str(getattr(files, "description", None) or getattr(files, "name", "component"))
    require_backend("torchao", where)
    from torchao.prototype.safetensors.safetensors_utils import object_from_dict

    weight_files = files.weight_files(variant)
    headers = component_headers(files, weight_files)
    metadata: dict[str, str] = {}
    for header in headers:
        metadata.update(header.metadata or {})
    try:
        analyse(config, headers)  # Q002-Q005, torch-free, before torchao parses anything
        descriptions = torchao_descriptions(metadata)
    except QuantError as e:
        raise DDUFLoadError(f"{where}: {e.code}: torchao quantization: {e}", code=e.code) from None
    model = empty_model(model_cls, config, where, files, variant)
    state = dict(files.tensors(weight_files))
    for name, parts in torchao_groups(descriptions).items():
        description = copy.deepcopy(descriptions[name])
        description["_data"].update({part: state.pop(tensor) for part, tensor in parts.items()})
        try:  # torchao's own constructor, over the archive's views (no copy)
            state[name] = object_from_dict(description)
        except (ValueError, TypeError, AttributeError) as e:
            raise DDUFLoadError(f"{where}: Q005: torchao cannot build {name} from its description ({e})",
                                code="Q005") from None
    check_state_keys(state, set(model.state_dict()), model, f"{where}: stored tensors do not match the "
                      f"torchao-quantized {model_cls.__name__}")
    target = torch_dtype(dtype)
    if target is not None:
        import torch

        for key, tensor in state.items():  # plain tensors only: the subclasses keep their layout
            if type(tensor) is torch.Tensor and tensor.is_floating_point() and tensor.dtype != target:
                state[key] = tensor.to(target)
    quantizer = _quantizer(config)
    if quantizer is not None:  # as diffusers' from_pretrained: is_quantized, quantization_method, modules_to_not_convert
        _validate_environment(quantizer, where, torch_dtype=target)  # torchao's sets `offload` (save reads it)
        preprocess_model(quantizer, model, where)
        quantizer._metadata = metadata  # what diffusers' set_metadata keeps (its `metadata` property)
    model.load_state_dict(state, strict=False, assign=True)
    if quantizer is not None:  # so that save_pretrained and dequantize work as after diffusers' load
        register_quantizer(model, quantizer, target)
    return finish_model(model, where, device)


def _validate_environment(quantizer: Any, where: str, **kwargs: Any) -> None:
    """diffusers' own environment step (versions; torchao's ``offload`` flag, False: nothing is offloaded)."""
    try:
        quantizer.validate_environment(device_map=None, **kwargs)
    except Exception as e:  # noqa: BLE001 - a backend version diffusers refuses
        raise DDUFLoadError(f"{where}: diffusers' {type(quantizer).__name__} refuses this environment "
                            f"({type(e).__name__}: {e})"[:500]) from None


def register_quantizer(model: torch.nn.Module, quantizer: Any, dtype: torch.dtype | None) -> None:
    """Leave on ``model`` what diffusers' ``from_pretrained`` leaves on a quantized model, so that its own
    ``save_pretrained``, ``dequantize`` and ``model.config`` work and read the same: the quantizer's
    post-processing, ``hf_quantizer``, and ``config.quantization_config`` / ``config._pre_quantization_dtype``
    (the dtype the quantizer picks for the caller's ``dtype``: torchao bfloat16, bitsandbytes float16 when none)."""
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    with _quiet(type(quantizer).__module__):  # its "overriding torch_dtype" advice is for from_pretrained's callers
        pre = copy.copy(quantizer).update_torch_dtype(dtype)  # a copy: SDNQ's records the dtype it is given
    register = getattr(model, "register_to_config", None)
    if register is None:  # not a diffusers model: transformers keeps its quantization_config elsewhere
        return
    if "quantization_config" not in getattr(model, "config", {}):  # SDNQ's post-processing registers its own
        register(quantization_config=quantizer.quantization_config)  # diffusers' from_config keeps the object
    register(_pre_quantization_dtype=pre)


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    log = logging.getLogger(name)
    before, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = before


def preprocess_model(quantizer: Any, model: torch.nn.Module, where: str) -> None:
    """diffusers' own skeleton step (replaces the layers to quantize, on meta), its failures as DDUFLoadError."""
    try:
        quantizer.preprocess_model(model=model, device_map=None,
                                   keep_in_fp32_modules=list(getattr(model, "_keep_in_fp32_modules", None) or []))
    except Exception as e:  # noqa: BLE001 - driven by an untrusted quantization_config
        raise DDUFLoadError(f"{where}: Q001: diffusers' quantizer refuses this quantization_config "
                            f"({type(e).__name__}: {e})"[:500], code="Q001") from None


def _quantizer(config: Mapping[str, Any]) -> Any:
    """diffusers' quantizer for this config (pre-quantized), as its from_pretrained makes; None without diffusers."""
    try:
        from diffusers.quantizers import DiffusersAutoQuantizer
    except ImportError:  # transformers-only environment: the model still runs
        return None
    try:
        return DiffusersAutoQuantizer.from_config(dict(config["quantization_config"]), pre_quantized=True)
    except Exception as e:  # noqa: BLE001 - an untrusted quantization_config of any shape: no quantizer
        logger.debug("no diffusers quantizer attached: %s", e)
        return None


def checked_quantizer(config: Mapping[str, Any], files: ComponentFiles, variant: str | None, where: str,
                      backend: str) -> tuple[list[str], Any]:
    """(weight files, diffusers' quantizer) of a component once its tensors pass Q001-Q005 (torch-free, before the
    backend parses its config).

    Raises:
        DDUFLoadError: the component is not self-consistent (its Q0xx code), or no quantizer can be made (Q001).
    """
    weight_files = files.weight_files(variant)
    try:
        analyse(config, component_headers(files, weight_files))
    except QuantError as e:
        raise DDUFLoadError(f"{where}: {e.code}: {backend} quantization: {e}", code=e.code) from None
    quantizer = _quantizer(config)
    if quantizer is None:
        raise DDUFLoadError(f"{where}: Q001: diffusers cannot make its {backend} quantizer from this "
                            "quantization_config (or diffusers is not installed)", code="Q001")
    return weight_files, quantizer


def load_bnb_component(model_cls: type[Any], config: Mapping[str, Any], files: ComponentFiles, *, device: Any = None,
                       variant: str | None = None) -> torch.nn.Module:
    """Rebuild a component saved by diffusers' bitsandbytes quantizer as its ``from_pretrained`` does:
    ``Linear4bit`` / ``Linear8bitLt`` layers (diffusers' own ``replace_with_bnb_linear``, on meta) whose weights
    ``Params4bit.from_prequantized`` / ``Int8Params`` wrap over the archive's views; every tensor kept as saved.

    Raises:
        DDUFLoadError: bitsandbytes or diffusers missing, the component not self-consistent (Q0xx), a packed
            quant_state over its budget.
    """
    where = str(getattr(files, "description", None) or getattr(files, "name", "component"))
    backend = str(backend_of(config))
    bnb = require_backend(backend, where)
    weight_files, quantizer = checked_quantizer(config, files, variant, where, "bitsandbytes")
    model = empty_model(model_cls, config, where, files, variant)
    preprocess_model(quantizer, model, where)
    state = dict(files.tensors(weight_files))
    layer_cls = bnb.nn.Linear4bit if backend == "bitsandbytes_4bit" else bnb.nn.Linear8bitLt
    tensors = {name: info for header in component_headers(files, weight_files) for name, info in header.tensors.items()}
    plain = 0  # Q009: layers kept off bitsandbytes' AVX512-BF16 repack
    for name, parts in bnb_groups(tensors, backend).items():
        try:
            module = model.get_submodule(name.rpartition(".")[0])
        except AttributeError:
            raise DDUFLoadError(f"{where}: {name}: the model has no such layer") from None
        if not isinstance(module, layer_cls):
            raise DDUFLoadError(f"{where}: {name} is stored quantized but the model keeps that layer unquantized")
        parsed = _check_bnb_shape(module, name, parts, state, where)
        try:
            unfit = _set_bnb_weight(module, parts, state, bnb, parsed)
        except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, AssertionError) as e:  # hostile stats
            raise DDUFLoadError(f"{where}: Q005: bitsandbytes cannot build {name} ({type(e).__name__}: {e})"[:500],
                                code="Q005") from None
        if unfit:
            module.support_avx512bf16_for_cpu = False
            plain += 1
    if plain:
        logger.debug("%s: Q009: %d bitsandbytes 4-bit layers kept on the plain CPU path (their shapes do not fit "
                     "the AVX512-BF16 repack)", where, plain)
    check_state_keys(state, {k for k in model.state_dict() if not _is_bnb_weight(model, k, layer_cls)}, model,
                      f"{where}: stored tensors do not match the {backend} {model_cls.__name__}")
    model.load_state_dict(state, strict=False, assign=True)
    register_quantizer(model, quantizer, None)  # bitsandbytes components load as saved: diffusers' default dtype
    return finish_model(model, where, device)


def _check_bnb_shape(module: Any, name: str, parts: Mapping[str, str], state: Mapping[str, Any],
                     where: str) -> dict[str, Any] | None:
    """The stored weight checked before bitsandbytes sees it. 4-bit: the packed quant_state parsed and fitted to
    the tensors bitsandbytes will be given, as ``dduf validate`` fits them (Q003 / Q005 / Q007, one function:
    format.quant_bnb.check_quant_state); returned parsed. Then Q006: the layer's shape is what the stored
    weight holds (4-bit: the quant_state's shape; 8-bit: the int8 matrix), else bitsandbytes would dequantize
    into another shape than the layer computes with."""
    from ..format.quant_bnb import check_quant_state, parse_quant_state

    layer = [int(module.out_features), int(module.in_features)]
    parsed = None
    if "quant_state" in parts:
        try:
            parsed = parse_quant_state(state[parts["quant_state"]].numpy().tobytes(), parts["quant_state"])
            check_quant_state(parsed, parts["data"], {part: tensor_info(tensor, state[tensor])
                                                     for part, tensor in parts.items()})
        except QuantError as e:
            raise DDUFLoadError(f"{where}: {e.code}: {e}", code=e.code) from None
        shape = parsed["shape"]
    else:
        shape = list(state[parts["data"]].shape)
    if list(shape) != layer:
        raise DDUFLoadError(f"{where}: Q006: {name} is stored as a {list(shape)[:4]} weight; the layer "
                            f"{name.rpartition('.')[0]} is {layer}", code="Q006")
    return parsed


def tensor_info(name: str, tensor: torch.Tensor) -> TensorInfo:
    """A loaded tensor as the format layer's checks see a stored one (dtype in torch spelling, shape, bytes)."""
    return TensorInfo(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), 0,
                      tensor.numel() * tensor.element_size())


def _set_bnb_weight(module: Any, parts: Mapping[str, str], state: dict[str, Any], bnb: Any,
                    parsed: Mapping[str, Any] | None) -> bool:
    """One layer's weight, as diffusers' ``create_quantized_param`` makes it, over the stored views (the parts
    are taken out of ``state``; ``parsed``: its checked 4-bit quant state). True when it is a 4-bit weight
    bitsandbytes' AVX512-BF16 CPU path cannot repack (then the layer is kept on the plain path)."""
    from ..format.quant_bnb import bnb_cpu_repack_problem

    data = state.pop(parts["data"])
    if parsed is not None:  # 4-bit
        stats = {tensor: state.pop(tensor) for part, tensor in parts.items() if part != "data"}
        module._parameters["weight"] = bnb.nn.Params4bit.from_prequantized(
            data=data, quantized_stats=stats, requires_grad=False, device="cpu")
        # Q009: bitsandbytes' AVX512-BF16 CPU path would repack this weight in the first forward and fail on its
        # shape; Linear4bit.forward reads this attribute (set from has_avx512bf16() at construction) to choose
        return bnb_cpu_repack_problem(parsed["shape"], parsed["blocksize"]) is not None
    scb = state.pop(parts["SCB"])
    state.pop(parts["weight_format"], None)  # diffusers drops it too (a layout tag bitsandbytes no longer reads)
    module._parameters["weight"] = bnb.nn.Int8Params(data, requires_grad=False, **module.weight.__dict__).to("cpu")
    module.weight.SCB = scb
    return False


def _is_bnb_weight(model: torch.nn.Module, key: str, layer_cls: type) -> bool:
    """A state key the quantized layers produce themselves (their weight, its quant-state parts, SCB...)."""
    if key.endswith(".bias"):
        return False  # loaded as stored, like any unquantized tensor
    module_name = key.rsplit(".weight", 1)[0] if ".weight" in key else key.rsplit(".", 1)[0]
    try:
        return isinstance(model.get_submodule(module_name), layer_cls)
    except AttributeError:
        return False
