"""Build diffusers and transformers models from a component's config and tensors that view the archive.

diffusers models are built on the meta device from their config (``from_config`` with parameters on the
meta device and no initialisation, as diffusers does, but for the building thread only:
:mod:`dduf_plus.torchkit.empty_init`) and then given the tensors with ``load_state_dict(assign=True)``:
parameters *are* the views, nothing is copied. transformers models go through transformers' own loader
(``from_pretrained(None, config=..., state_dict=...)``), which applies the class's checkpoint key renames,
weight conversions, tied weights, non-persistent buffers and dtype plan; a tensor it receives in the right
dtype and device is kept as it is (no copy). Text encoders whose stored names and shapes are exactly the
model's (``DIRECT_TRANSFORMERS``) skip that loader's generic machinery and get the same model directly
(:func:`build_transformers_direct`)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import DDUFLoadError
from ..format.quantization import QMAP_NAME as QUANTO_QMAP
from ..format.weights import classify
from ..torchkit.empty_init import meta_parameters, no_init
from ..torchkit.thread_dtype import local_default_dtype
from .assign import assign_state
from .budget import construction_budget
from .dtypes import plan_dtypes
from .files import ComponentFiles, tensor_metadata

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)

Materialize = Callable[..., dict]


class ModelRequest:
    """What the pipeline asks of one model component."""

    def __init__(self, *, variant: str | None, dtype: Any, device: torch.device, declared: Mapping[str, Any] | None,
                 name_or_path: str, materialize: Materialize, allow_missing_weights: bool = False):
        self.variant = variant
        self.dtype = dtype  # "auto" or a torch.dtype
        self.device = device
        self.declared = declared or {}
        self.name_or_path = name_or_path
        self.materialize = materialize
        self.allow_missing_weights = allow_missing_weights  # else parameters the weights lack are an error


def pick_weight_files(files: ComponentFiles, variant: str | None, preferred_stem: str) -> list[str]:
    """The component's weight files; when the folder holds weights under several stems (a repo with both
    ``model.safetensors`` and ``diffusion_pytorch_model.safetensors``), the library's own stem wins."""
    chosen = files.weight_files(variant)
    stems = {w.stem for f in chosen if (w := classify(f)) is not None}
    if len(stems) > 1:
        chosen = [f for f in chosen if (w := classify(f)) is not None and w.stem == preferred_stem] or chosen
    if not chosen:
        raise DDUFLoadError(f"{files.description}: D016: no safetensors weights (has: "
                            f"{', '.join(files.listdir()) or 'nothing'})", code="D016")
    return chosen


def default_dtype(dtype: torch.dtype) -> contextlib.AbstractContextManager[None]:
    """Build under ``dtype`` as diffusers/transformers do: buffers computed at construction (not stored in
    the checkpoint) then come out in the component's dtype, exactly as theirs. For this thread only: torch's
    process default is never changed (:mod:`dduf_plus.torchkit.thread_dtype`)."""
    return local_default_dtype(dtype)


# diffusers' and transformers' own loaders (transformers' init context, a quantizer's from_pretrained) patch
# torch and their own classes for the whole process and restore what they saw on leaving: two of them
# overlapping in two threads restore out of order and leave a patch in place for good (transformers'
# no_tie_weights left PreTrainedModel.tie_weights a no-op, and every later tied model lacked its weights).
# Loads in several threads therefore enter those loaders one at a time.
LIBRARY_LOADERS = threading.RLock()


def one_library_loader_at_a_time(build: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    """``build`` (which enters diffusers' or transformers' own loader) runs holding :data:`LIBRARY_LOADERS`."""
    @functools.wraps(build)
    def serialized(*args: Any, **kwargs: Any) -> torch.nn.Module:
        with LIBRARY_LOADERS:
            return build(*args, **kwargs)

    return serialized


def thread_local_dtype(build: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    """``build`` runs with torch's default dtype private to this thread: what diffusers' and transformers'
    loaders set through ``torch.set_default_dtype`` inside it stays in this thread."""
    @functools.wraps(build)
    def in_thread(*args: Any, **kwargs: Any) -> torch.nn.Module:
        with local_default_dtype():
            return build(*args, **kwargs)

    return in_thread


# --- diffusers -------------------------------------------------------------------------------------------
def diffusers_class_for(cls: type[Any], config: Mapping[str, Any]) -> type[Any]:
    """Legacy classes (``Transformer2DModel``) resolve to the class the config really describes."""
    try:
        from diffusers.configuration_utils import LegacyConfigMixin
        from diffusers.models.model_loading_utils import _fetch_remapped_cls_from_config
    except ImportError:  # pragma: no cover - older diffusers
        return cls
    if issubclass(cls, LegacyConfigMixin):
        return _fetch_remapped_cls_from_config(dict(config), cls)
    return cls


@thread_local_dtype
def build_diffusers_model(cls: type[Any], files: ComponentFiles, request: ModelRequest) -> torch.nn.Module:
    config = files.read_json(getattr(cls, "config_name", None) or "config.json")
    if not isinstance(config, dict):
        raise DDUFLoadError(f"{files.description}: config.json is not a JSON object (D007)", code="D007")
    cls = diffusers_class_for(cls, config)
    if config.get("quantization_config") is not None:
        return build_with_quantizer(cls, config, files, request)
    if QUANTO_QMAP in files.listdir():
        return build_quanto(cls, config, files, request, "diffusers", "diffusion_pytorch_model")
    weight_files = pick_weight_files(files, request.variant, "diffusion_pytorch_model")
    stored = tensor_metadata(files, weight_files)
    plan = plan_dtypes(request.dtype, stored, model_cls=cls, library="diffusers",
                       declared=request.declared, where=files.description)
    with meta_parameters(), default_dtype(plan.dtype), \
            construction_budget(files.description, cls.__name__, stored, config=config):
        model = cls.from_config(config)
    state = dict(request.materialize(files.tensors(weight_files), device=request.device, dtype_for=plan.dtype_for))
    model._fix_state_dict_keys_on_load(state)  # old attention-block key names, as diffusers renames them
    assigned = assign_state(model, state)
    if assigned is None:  # a module with its own loading, or a shape that does not fit: torch's loader decides
        unexpected = list(model.load_state_dict(state, strict=False, assign=True).unexpected_keys)
        still_meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    else:
        unexpected, still_meta = assigned.unexpected_keys, assigned.still_meta
    del state
    for pattern in getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or []:
        unexpected = [k for k in unexpected if re.search(pattern, k) is None]
    if unexpected:
        logger.warning("%s: weights not used by %s: %s", files.description, cls.__name__, ", ".join(sorted(unexpected)[:10]))
    if still_meta:
        shown = ", ".join(still_meta[:8]) + (f" and {len(still_meta) - 8} more" if len(still_meta) > 8 else "")
        raise DDUFLoadError(f"{files.description}: weights missing for {cls.__name__}: {shown}")
    _move_buffers(model, request.device)
    if plan.storage_dtype is not None:
        model.enable_layerwise_casting(storage_dtype=plan.storage_dtype, compute_dtype=plan.dtype)
    model.register_to_config(_name_or_path=request.name_or_path)
    eval_mode(model)
    return model


def eval_mode(model: torch.nn.Module) -> None:
    """``model.eval()``: in one flat pass where no module overrides ``train`` (torch's recursion sets each
    flag through ``Module.__setattr__``: ~2.4 ms for an SD-1.5 UNet's 709 modules, 0.8 ms this way)."""
    import torch

    base = torch.nn.Module
    modules = list(model.modules())
    if any(type(m).train is not base.train or type(m).__setattr__ is not base.__setattr__ for m in modules):
        model.eval()
        return
    for module in modules:
        module.__dict__["training"] = False  # where Module.__setattr__ puts a plain attribute, module by module


def _move_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers the checkpoint does not hold were created on CPU at construction; follow the weights."""
    if device.type == "cpu":
        return
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


# --- transformers ------------------------------------------------------------------------------------------
def transformers_config(cls: type[Any], config_dict: Mapping[str, Any], where: str) -> Any:
    """The config object ``cls.from_pretrained(folder)`` would build from ``config.json``, in memory:
    same sub-config selection (``base_config_key``, nested ``model_type``) as ``PreTrainedConfig.from_pretrained``."""
    config_class = getattr(cls, "config_class", None)
    if config_class is None:
        raise DDUFLoadError(f"{where}: {cls.__name__} declares no config_class")
    data = dict(config_dict)
    key = getattr(config_class, "base_config_key", None)
    if key and isinstance(data.get(key), dict):
        data = data[key]
    model_type = getattr(config_class, "model_type", None)
    if model_type and "model_type" in data and data["model_type"] != model_type:
        for value in list(data.values()):
            if isinstance(value, dict) and value.get("model_type") == model_type:
                data = value
    return config_class.from_dict(dict(data))


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers draws a "Loading weights" bar per model (and per LoRA adapter it loads into a text
    encoder); a pipeline load shows none of them."""
    from transformers.utils import logging as tlogging

    enabled = tlogging.is_progress_bar_enabled()
    if enabled:
        tlogging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            tlogging.enable_progress_bar()


@contextlib.contextmanager
def _no_allocator_warmup() -> Iterator[None]:
    """Our tensors are already on the device: transformers' caching-allocator warm-up would reserve a second
    model-sized block there for nothing."""
    import transformers.modeling_utils as modeling_utils

    original = getattr(modeling_utils, "caching_allocator_warmup", None)
    if original is None:
        yield
        return
    modeling_utils.caching_allocator_warmup = lambda *args, **kwargs: None
    try:
        yield
    finally:
        modeling_utils.caching_allocator_warmup = original


@thread_local_dtype
@one_library_loader_at_a_time
def build_transformers_model(cls: type[Any], files: ComponentFiles, request: ModelRequest) -> torch.nn.Module:
    config_dict = files.read_json("config.json")
    if not isinstance(config_dict, dict):
        raise DDUFLoadError(f"{files.description}: config.json is not a JSON object (D007)", code="D007")
    if QUANTO_QMAP in files.listdir():
        return build_quanto(cls, config_dict, files, request, "transformers", "model")
    if config_dict.get("quantization_config") is not None:
        return build_with_quantizer(cls, config_dict, files, request)
    config = transformers_config(cls, config_dict, files.description)
    weight_files = pick_weight_files(files, request.variant, "model")
    stored = tensor_metadata(files, weight_files)
    plan = plan_dtypes(request.dtype, stored, model_cls=cls, library="transformers",
                       declared=request.declared, where=files.description)
    if plan.storage_dtype is not None:
        raise DDUFLoadError(f"{files.description}: fp8 storage is supported for diffusers models only")
    direct = build_transformers_direct(cls, config, files, weight_files, stored, plan, request)
    if direct is not None:
        return direct
    state = dict(request.materialize(files.tensors(weight_files), device=request.device, dtype_for=plan.dtype_for))
    kwargs: dict[str, Any] = {"config": config, "state_dict": state, "dtype": plan.dtype, "output_loading_info": True}
    if "generation_config.json" in files.listdir() and getattr(cls, "can_generate", lambda: False)():
        from transformers import GenerationConfig

        kwargs["generation_config"] = GenerationConfig.from_dict(files.read_json("generation_config.json"))
    on_device = request.device.type != "cpu"
    if on_device:
        kwargs["device_map"] = {"": request.device}
    with quiet_transformers(), (_no_allocator_warmup() if on_device else contextlib.nullcontext()), \
            construction_budget(files.description, cls.__name__, stored, enabled=not request.allow_missing_weights):
        model, info = cls.from_pretrained(None, **kwargs)
    del state, kwargs
    if info.get("mismatched_keys"):
        shown = ", ".join(str(k[0] if isinstance(k, tuple) else k) for k in list(info["mismatched_keys"])[:8])
        raise DDUFLoadError(f"{files.description}: weight shapes do not fit {cls.__name__}'s config: {shown}")
    if info.get("missing_keys"):
        # transformers initialises them randomly: a model the archive's weights do not cover is refused
        # unless the caller asked for it (never silent).
        missing = sorted(info["missing_keys"])
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        if not request.allow_missing_weights:
            raise DDUFLoadError(f"{files.description}: the stored weights do not cover {cls.__name__}: missing "
                                f"{shown} (they would be randomly initialised; pass allow_missing_weights=True "
                                "to load anyway)")
        logger.warning("%s: weights missing for %s, randomly initialised: %s", files.description, cls.__name__, shown)
    model.config.name_or_path = request.name_or_path
    model.eval()
    return model


# transformers classes the direct path builds, with the checkpoint prefix transformers' own conversion table
# strips for the class (``conversion_mapping``: CLIPTextModel's ``PrefixChange(prefix_to_remove="text_model")``).
# Only classes whose table renames nothing else: a class with value conversions (transposes, fused experts)
# must go through transformers' loader, which knows them.
DIRECT_TRANSFORMERS: dict[str, str | None] = {
    "CLIPTextModel": "text_model",
    "CLIPTextModelWithProjection": None,
    "T5EncoderModel": None,
    "UMT5EncoderModel": None,
}
# transformers internals the direct path calls, with the parameters it passes (by name). Private API: another
# transformers may rename or reshape them (5.17's get_init_context takes one argument fewer), so the path is
# taken only where every one has exactly these parameters, any others optional; else transformers' own loader.
_TRANSFORMERS_INTERNALS: dict[str, tuple[str, ...]] = {
    "get_init_context": ("dtype", "is_quantized", "_is_ds_init_called", "allow_all_kernels", "config"),
    "_move_missing_keys_from_meta_to_device": ("missing_keys", "device_map", "device_mesh", "hf_quantizer"),
    "_initialize_missing_keys": ("is_quantized",),
    "get_parameter_or_buffer": ("target",),
    "set_use_kernels": ("use_kernels", "kernel_config", "mode", "device_map"),
}


_INTERNALS_FIT: dict[type, bool] = {}  # class -> _transformers_internals_fit's answer (signatures do not change)


def _transformers_internals_fit(cls: type[Any]) -> bool:
    """Whether this transformers has the internals the direct path calls, with the parameters it passes."""
    if cls not in _INTERNALS_FIT:
        _INTERNALS_FIT[cls] = _internals_fit(cls)
    return _INTERNALS_FIT[cls]


def _internals_fit(cls: type[Any]) -> bool:
    try:
        from transformers.core_model_loading import PrefixChange  # noqa: F401  (used by _direct_finish)
        from transformers.integrations.hub_kernels import _kernels_enabled  # noqa: F401
        from transformers.utils.generic import ContextManagers  # noqa: F401
        from transformers.utils.import_utils import is_kernels_available  # noqa: F401
    except ImportError:
        return False
    for name, wanted in _TRANSFORMERS_INTERNALS.items():
        try:
            params = inspect.signature(getattr(cls, name)).parameters
        except (AttributeError, TypeError, ValueError):
            return False
        names = [n for n, p in params.items() if n != "self"]
        extra = [params[n] for n in names if n not in wanted]
        if any(n not in params for n in wanted) or any(p.default is inspect.Parameter.empty for p in extra):
            return False
    return True


def build_transformers_direct(cls: type[Any], config: Any, files: ComponentFiles, weight_files: list[str],
                              stored: Mapping[str, tuple[str, tuple[int, ...], int]], plan: Any,
                              request: ModelRequest) -> torch.nn.Module | None:
    """The model ``from_pretrained(None, config=..., state_dict=...)`` returns, without its generic loader, when
    the stored names and shapes are exactly the model's (after the class's one known prefix): the same
    construction (transformers' init context: meta device, the dtype), the tensors assigned as they are, then
    transformers' own steps for what a checkpoint does not hold (non-persistent buffers, ``eval``, kernels).

    That loader builds the whole conversion table of every architecture on its first call and matches each
    key against it (0.3-0.6 s per process here, most of a text encoder's load): the index has already
    listed every tensor, so an exact match needs none of it. None: the loader is needed (another class, tied
    or missing weights, other names or shapes, a device, a generating model, another transformers)."""
    if (cls.__name__ not in DIRECT_TRANSFORMERS or not cls.__module__.startswith("transformers.")
            or request.device.type != "cpu" or request.allow_missing_weights or plan.storage_dtype is not None
            or cls.can_generate() or not _transformers_internals_fit(cls)):
        return None
    names, stripped = _direct_names(stored, DIRECT_TRANSFORMERS[cls.__name__])
    if names is None:
        return None
    config.dtype = plan.dtype  # as from_pretrained's dtype resolution leaves it, sub-configs too
    for key in getattr(config, "sub_configs", {}) or {}:
        if (sub := getattr(config, key, None)) is not None:
            sub.dtype = plan.dtype
    config.name_or_path = None  # from_pretrained(None, ...) records None (the model's name_or_path); set below
    from transformers.utils.generic import ContextManagers

    # transformers' construction context (the dtype, the meta device), without torch's initialisers: on meta
    # tensors they compute nothing, through decompositions (~7 ms of a CLIP text encoder).
    with ContextManagers(cls.get_init_context(dtype=plan.dtype, is_quantized=False, _is_ds_init_called=False,
                                                  allow_all_kernels=None, config=config)), no_init(), \
            construction_budget(files.description, cls.__name__, stored):
        model = cls(config)
    expected = model.state_dict()  # meta tensors: names and shapes, nothing allocated
    if (getattr(model, "all_tied_weights_keys", None) or set(names) != set(expected)
            or any(tuple(expected[n].shape) != tuple(stored[s][1]) for n, s in names.items())):
        return None
    views = request.materialize(files.tensors(weight_files), device=request.device, dtype_for=plan.dtype_for)
    state = {n: views[s] for n, s in names.items()}
    # Every tensor assigned is marked initialised, so transformers' initialisation leaves it alone.
    assigned = assign_state(model, state, mark="_is_hf_initialized")
    if assigned is None or assigned.missing_keys or assigned.unexpected_keys:  # names matched: hooks or shapes
        model.load_state_dict(state, strict=True, assign=True)
        for name in names:
            model.get_parameter_or_buffer(name)._is_hf_initialized = True
    del state
    del views
    model._move_missing_keys_from_meta_to_device(missing_keys=set(), device_map=None, device_mesh=None,
                                                hf_quantizer=None)  # non-persistent buffers ...
    model._initialize_missing_keys(is_quantized=False)  # ... computed by the class, as from_pretrained does
    model.eval()
    _direct_finish(model, stripped)
    model.config.name_or_path = request.name_or_path
    return model


def _direct_names(stored: Mapping[str, Any], prefix: str | None) -> tuple[dict[str, str] | None, str | None]:
    """({model name: stored name}, the prefix stripped or None): names as stored, or every name with the
    class's prefix stripped (some with it and some without is no layout transformers writes: None)."""
    if prefix is None or not any(n.startswith(prefix + ".") for n in stored):
        return {n: n for n in stored}, None
    if not all(n.startswith(prefix + ".") for n in stored):
        return None, None
    return {n[len(prefix) + 1:]: n for n in stored}, prefix


def _direct_finish(model: Any, stripped: str | None) -> None:
    """What from_pretrained records after loading: the conversions it used (``save_pretrained`` reverses
    them, so a CLIP model saved again keeps its stored names) and its hub kernels, as its defaults decide."""
    from transformers.core_model_loading import PrefixChange
    from transformers.integrations.hub_kernels import _kernels_enabled
    from transformers.utils.import_utils import is_kernels_available

    model._weight_conversions = [PrefixChange(prefix_to_remove=stripped)] if stripped else []
    model.set_use_kernels(use_kernels=_kernels_enabled() and is_kernels_available(), kernel_config=None, mode=None,
                          device_map=None)


# --- quantized -----------------------------------------------------------------------------------------------
@one_library_loader_at_a_time
def build_with_quantizer(cls: type[Any], config: dict, files: ComponentFiles, request: ModelRequest) -> torch.nn.Module:
    """Components whose config.json holds a ``quantization_config`` (diffusers' / transformers' quantizers):
    ``quanto`` is rebuilt zero-copy; other backends go through the quantizer's own ``from_pretrained``."""
    import torch

    from . import quant

    dtype = request.dtype if isinstance(request.dtype, torch.dtype) else None
    model = quant.load_with_diffusers_quantizer(cls, config, files, device=request.device, dtype=dtype,
                                                variant=request.variant)
    if callable(register := getattr(model, "register_to_config", None)):  # diffusers models: record the source
        register(_name_or_path=request.name_or_path)
    model.eval()
    return model


def build_quanto(cls: type[Any], config: dict, files: ComponentFiles, request: ModelRequest, library: str,
                 stem: str) -> torch.nn.Module:
    """Components saved with optimum-quanto (``quanto_qmap.json`` beside the weights)."""
    try:
        from . import quant
    except ImportError as e:
        raise DDUFLoadError(f"{files.description} is quantized with optimum-quanto, which is not available ({e}); "
                            'pip install "dduf_plus[quanto]"') from e
    weight_files = pick_weight_files(files, request.variant, stem)
    plan = plan_dtypes(request.dtype, tensor_metadata(files, weight_files), model_cls=cls, library=library,
                       declared=request.declared, where=files.description)
    try:
        model = quant.load_quanto_component(cls, config, files, device=request.device, dtype=plan.dtype)
    except ImportError as e:
        raise DDUFLoadError(f"{files.description} needs optimum-quanto ({e}); pip install \"dduf_plus[quanto]\"") from e
    if callable(register := getattr(model, "register_to_config", None)):  # diffusers models: record the source
        register(_name_or_path=request.name_or_path)
    model.eval()
    return model
