"""``load_dduf``'s arguments checked before anything is opened or imported: each wrong kind of value is a
:class:`~dduf_plus.errors.DDUFUsageError` naming the argument, never a raw ``TypeError`` from deep inside
or a value silently taken for something else (``verify="no"`` is truthy: it would have verified).

``DiffusionPipeline.from_pretrained``'s own keywords that ``load_dduf`` does not list are answered here too
(:data:`FROM_PRETRAINED`): the values that mean what ``load_dduf`` does anyway are accepted, ``disable_mmap``
is ``use_mmap``'s inverse, and every other value is refused saying why, rather than being warned about and
ignored as an unknown pipeline keyword (a script ported from diffusers must not lose an option unnoticed)."""

from __future__ import annotations

import itertools
import math
import os
import sys
from collections.abc import Iterable, Mapping
from numbers import Real
from typing import Any

from ..errors import DDUFError, DDUFUsageError, bounded_repr, path_argument
from ..storage.http_range import short_text

# from_pretrained keyword -> (the values that change nothing here, why any other value is refused)
FROM_PRETRAINED: dict[str, tuple[tuple[Any, ...], str]] = {
    "force_download": ((False, None), "cached copies are checked by their content, never trusted by name: a "
                       "stale or damaged copy is not used; delete the cache entry to fetch it again"),
    "proxies": ((None,), "set HTTPS_PROXY / HTTP_PROXY in the environment instead"),
    "custom_pipeline": ((None,), "load_dduf builds the pipeline class model_index.json names and never runs "
                        "code from an archive or a repo"),
    "custom_revision": ((None,), "custom pipelines are not loaded"),
    "trust_remote_code": ((False, None), "load_dduf never runs code from an archive or a repo"),
    "provider": ((None,), "ONNX pipelines are not loaded from DDUF"),
    "sess_options": ((None,), "ONNX pipelines are not loaded from DDUF"),
    "provider_options": ((None,), "ONNX pipelines are not loaded from DDUF"),
    "use_onnx": ((False, None), "ONNX pipelines are not loaded from DDUF"),
    "max_memory": ((None,), "placement strategies are not supported; give device_map={component: device}"),
    "offload_folder": ((None,), "weights view the archive's memory map; nothing is offloaded to a folder"),
    "offload_state_dict": ((None, False), "weights view the archive's memory map; nothing is offloaded"),
    "use_safetensors": ((True, None), "a DDUF archive holds only .safetensors weights"),
    "load_connected_pipeline": ((False, None), "connected pipelines are not loaded"),
    "quantization_config": ((None,), "quantize when packing (dduf pack --quantize) and load the quantized "
                            "archive"),
    "use_flashpack": ((False, None), "FlashPack files are not read from DDUF; the archive is memory-mapped"),
}
# from_pretrained keywords taken with any bool and no effect: load_dduf always builds on the meta device
NO_EFFECT_BOOLS = ("low_cpu_mem_usage",)
# adapters= / model_dirs= given as any iterable are read once, into a list, up to this many items (a generator
# would otherwise be used up by the check and an endless one would never end it)
MAX_ARGUMENT_ITEMS = 10_000
MAX_ADAPTER_WEIGHT = 1e4  # |weight| an archive's own adapter may have (rule A001): adapter_weights= the same


def _refuse(argument: str, value: Any, expected: str) -> DDUFUsageError:
    return DDUFUsageError(f"load_dduf({argument}={_short(value)}): expected {expected}, got "
                          f"{type(value).__name__}")


def _short(value: Any) -> str:
    return short_text(bounded_repr(value), 57)


def source_path(path: Any) -> str:
    """``load_dduf``'s first argument as a string: a ``str``, ``bytes`` or ``os.PathLike``."""
    return path_argument(path, "load_dduf(path=...)")  # a file, a folder, a Hub repo id or a URL


def _is_bool(value: Any) -> bool:
    # numpy's bool too: numpy.bool_ before numpy 2, numpy.bool (its __name__ "bool") since
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"))


def check_flags(**flags: Any) -> None:
    """Flags are bools: ``verify="no"`` or ``fuse_lora="yes"`` is refused, not read as True."""
    for name, value in flags.items():
        if not _is_bool(value):
            raise _refuse(name, value, "True or False")


def check_optional(name: str, value: Any, kinds: tuple[type, ...], expected: str) -> None:
    if value is not None and (not isinstance(value, kinds) or _is_bool(value) and bool not in kinds):
        raise _refuse(name, value, expected)


def check_hub_options(*, token: Any, revision: Any, cache_dir: Any, variant: Any, dduf_file: Any) -> None:
    check_optional("token", token, (str, bool), "a token string, True, False or None")
    check_optional("revision", revision, (str,), "a branch, tag or commit (str) or None")
    check_optional("cache_dir", cache_dir, (str, os.PathLike), "a folder (str or os.PathLike) or None")
    check_optional("variant", variant, (str,), "a variant name such as 'fp16' (str) or None")
    check_optional("dduf_file", dduf_file, (str,), "the archive's file name in the repo (str) or None")


def _listed(name: str, value: Iterable[Any], expected: str) -> list[Any]:
    """An iterable argument read once into a list of at most :data:`MAX_ARGUMENT_ITEMS` items."""
    items = list(itertools.islice(value, MAX_ARGUMENT_ITEMS + 1))
    if len(items) > MAX_ARGUMENT_ITEMS:
        raise DDUFUsageError(f"load_dduf({name}=...): more than {MAX_ARGUMENT_ITEMS} items; expected {expected}")
    return items


def _finite_weight(value: Real) -> bool:
    try:
        weight = float(value)
    except OverflowError:  # an int past float's range (10**400)
        return False
    return math.isfinite(weight) and abs(weight) <= MAX_ADAPTER_WEIGHT


def check_adapters(adapters: Any, adapter_weights: Any) -> Any:
    """``adapters``: None, a bool, a name or names; ``adapter_weights``: {name: finite number}. Returns
    ``adapters`` with any other iterable (a generator) read into a list, which the load uses instead: the
    check must not use up the names the load then applies (0.12.0 applied none)."""
    if adapters is not None and not _is_bool(adapters) and not isinstance(adapters, str):
        expected = "None, True, False, an adapter name or a list of names"
        names = _listed("adapters", adapters, expected) \
            if isinstance(adapters, Iterable) and not isinstance(adapters, Mapping) else None
        if names is None or not all(isinstance(n, str) for n in names):
            raise _refuse("adapters", adapters, expected)
        adapters = names
    if adapter_weights is None:
        return adapters
    if not isinstance(adapter_weights, Mapping) or not all(
            isinstance(k, str) and isinstance(v, Real) and not _is_bool(v) for k, v in adapter_weights.items()):
        raise _refuse("adapter_weights", adapter_weights, "a dict {adapter name: weight (a number)}")
    for key, value in adapter_weights.items():  # NaN or inf would be fused into every adapted weight
        if not _finite_weight(value):
            raise DDUFUsageError(f"load_dduf(adapter_weights={{{_short(key)}: {_short(value)}}}): expected a "
                                 f"finite weight of at most {MAX_ADAPTER_WEIGHT:g} in size, as an archive's own")
    return adapters


def check_sources(*, refs: Any, model_dirs: Any, remote: Any, max_decompressed: Any) -> Any:
    """Where references are found and how a URL or a ``.dduf.zst`` is read: checked even when this load does
    not use them, so a wrong value fails the first time rather than on the archive that needs it. Returns
    ``model_dirs``, an iterable of folders read into a list (searched once per reference: a generator would be
    used up by this check)."""
    if refs is not None and not (isinstance(refs, Mapping) and all(
            isinstance(k, str) and isinstance(v, (str, os.PathLike)) for k, v in refs.items())):
        raise _refuse("refs", refs, "{component: source} (a path, Hub repo or URL; '*' for every component) "
                      "or None")
    if model_dirs is not None and not isinstance(model_dirs, (str, os.PathLike)):
        expected = "a folder or a list of folders (str or os.PathLike)"
        dirs = _listed("model_dirs", model_dirs, expected) if isinstance(model_dirs, Iterable) else None
        if dirs is None or not all(isinstance(d, (str, os.PathLike)) for d in dirs):
            raise _refuse("model_dirs", model_dirs, expected)
        model_dirs = dirs
    if remote is not None and not isinstance(remote, Mapping):
        from ..remote.readers import RemoteOptions

        if not isinstance(remote, RemoteOptions):
            raise _refuse("remote", remote, "a dduf_plus.remote.fetch.RemoteOptions, a dict of its fields, or None")
    if max_decompressed is not None:
        from ..storage.zst_budget import DecompressionBudget, decompression_budget

        if not isinstance(max_decompressed, (str, int, DecompressionBudget)) or _is_bool(max_decompressed):
            raise _refuse("max_decompressed", max_decompressed, "a size ('64G'), a ratio ('32x'), both "
                          "('64G,32x'), 'unlimited' or a byte count")
        decompression_budget(max_decompressed)  # a malformed string is a DDUFError naming it
    return model_dirs


def from_pretrained_options(kwargs: dict[str, Any], use_mmap: bool) -> bool:
    """Take ``from_pretrained``'s own keywords out of ``kwargs`` (see the module); returns ``use_mmap`` as
    ``disable_mmap`` sets it."""
    for name in [k for k in kwargs if k in FROM_PRETRAINED]:
        value = kwargs.pop(name)
        allowed, why = FROM_PRETRAINED[name]
        if not any(value is a or (_is_bool(value) and value == a and _is_bool(a)) for a in allowed):
            raise DDUFUsageError(f"load_dduf({name}={_short(value)}) is not supported: {why}")
    for name in [k for k in kwargs if k in NO_EFFECT_BOOLS]:
        check_flags(**{name: kwargs.pop(name)})
    if "disable_mmap" in kwargs:
        disable = kwargs.pop("disable_mmap")
        check_flags(disable_mmap=disable)
        if not disable and not use_mmap:  # use_mmap=True is the default: only use_mmap=False can disagree
            raise DDUFUsageError("load_dduf(disable_mmap=False, use_mmap=False) disagree; pass one of them")
        return use_mmap and not disable
    return use_mmap


def check_passed_component(name: str, value: Any, library: str, class_name: str) -> Any:
    """``unet=my_unet`` is used as diffusers' ``from_pretrained`` uses it, and refused as it refuses it: an
    object that is not of the kind the archive's component is (``unet=5``, a scheduler for the unet) is a
    :class:`DDUFUsageError` naming the component, not an ``AttributeError`` from the pipeline's ``__init__``.
    The kind is diffusers' own (``LOADABLE_CLASSES``: a ``ModelMixin``, a ``SchedulerMixin``, a
    ``PreTrainedModel``, a tokenizer...); a pipeline module's class (a safety checker) is not checked,
    as in diffusers, nor is a component whose class cannot be imported here (the caller passes it instead)."""
    if value is None:
        return value
    from .components import resolve_class

    try:
        stored = resolve_class(name, library, class_name)
        from diffusers.pipelines.pipeline_loading_utils import LOADABLE_CLASSES
    except (DDUFError, ImportError):
        return value
    module = sys.modules.get(library) if library in ("diffusers", "transformers") else None  # imported above
    kinds = [k for k in (getattr(module, c, None) for c in LOADABLE_CLASSES.get(library, {}))
             if isinstance(k, type) and issubclass(stored, k)]
    model = getattr(value, "_orig_mod", value)  # torch.compile's wrapper, as diffusers unwraps it
    if kinds and not isinstance(model, kinds[-1]):
        raise DDUFUsageError(f"load_dduf({name}=...): got {type(model).__name__}, but {name} is a {class_name} "
                             f"({library}): pass a {kinds[-1].__name__} or None")
    return value


def check_dtype_kind(torch_dtype: Any, dtype: Any) -> None:
    """A ``torch.dtype`` that is not floating (``torch.int8``) is refused naming the argument, before a
    component is built (it used to fail at the first component with a message about fp8 storage)."""
    for name, value in (("torch_dtype", torch_dtype), ("dtype", dtype)):
        values = value.items() if isinstance(value, Mapping) else [(None, value)]
        for key, one in values:
            is_torch_dtype = type(one).__name__ == "dtype" and type(one).__module__ == "torch"
            if is_torch_dtype and not one.is_floating_point:
                where = f"{name}={{{key!r}: ...}}" if key is not None else name
                raise DDUFUsageError(f"load_dduf({where}={one}): not a floating dtype; weights load in a "
                                     "floating dtype (float32, float16, bfloat16...) or 'auto'")


__all__ = ["FROM_PRETRAINED", "MAX_ADAPTER_WEIGHT", "MAX_ARGUMENT_ITEMS", "NO_EFFECT_BOOLS", "check_adapters", "check_dtype_kind", "check_flags",
           "check_hub_options", "check_optional", "check_passed_component", "check_sources", "from_pretrained_options", "source_path"]
