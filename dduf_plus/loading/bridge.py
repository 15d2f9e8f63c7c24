"""Precision bridge: run a pipeline whose components were saved in different dtypes (unet fp16, text encoder
fp32...) with stock diffusers pipelines, which assume one dtype, without converting a single weight.

Each bridged component casts the *activations* it receives to its own dtype and casts its outputs back to
the dtype the caller used, so to the pipeline every component looks like it runs in the pipeline's dtype:

- the caller's dtype: the dtype of the call's main activation, the first floating tensor of two or more
  dimensions (positional first, then keyword, also one level inside tuples/lists/dicts): the latents, the
  sample, the pixel values. Not the first tensor that happens to need a cast: Hunyuan-DiT passes its fp32
  rotary embeddings beside fp16 latents, and taking their dtype cast the fp16 transformer's output to fp32.
- what is cast: floating tensors with two or more dimensions (latents, hidden states, embeddings, pixel
  values, SDXL's ``time_ids``...), positional or keyword, also one level inside tuples/lists/dicts
  (``added_cond_kwargs``); and 1-d floating tensors in the caller's dtype: per-sample timesteps and
  guidance that the pipeline built from the latents (Hunyuan-DiT's ``t_expand``, Flux/Chroma's
  ``timestep.to(latents.dtype)``), which models such as Hunyuan-DiT, HunyuanVideo 1.5, HunyuanImage and
  Chroma take as their compute dtype (``hidden_dtype=timestep.dtype``): in a single-dtype pipeline they
  would be in the model's dtype. 1-d tensors in another dtype (fp32 timesteps beside fp16 latents) and
  0-d tensors (SD's loop ``t``) are left as they are: stock pipelines make them in fp32 whatever the model
  dtype and the models cast them internally.
- outputs: when the caller's dtype differs from the component's, floating outputs of two or more
  dimensions in the component's dtype are cast back to the caller's dtype (tensors, tuples,
  ``BaseOutput``/``ModelOutput``); objects such as ``DiagonalGaussianDistribution`` are returned as they
  are (type promotion handles their use).
- where: ``forward`` (a forward pre-hook and a forward hook, ``with_kwargs=True``) and the other methods
  pipelines call directly (``encode``, ``decode``, ``tiled_encode``, ``tiled_decode``, ``get_text_features``,
  ``get_image_features``), wrapped on the instance.

The component's dtype is read at every call (``module.dtype``: diffusers reports the compute dtype under
layerwise casting), so ``pipe.to(torch.float16)`` afterwards keeps working; when all components end up in
one dtype the bridge casts nothing. ``pipe.components``, configs and ``save_pretrained`` are untouched."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

BRIDGED_METHODS = ("encode", "decode", "tiled_encode", "tiled_decode", "get_text_features", "get_image_features")
_ATTR = "_dduf_plus_bridge"


def component_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The dtype a component computes in: its ``dtype`` property (diffusers/transformers models), else the
    first floating parameter's."""
    import torch

    dtype = getattr(module, "dtype", None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2:
        return dtype
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return None


def _castable(value: Any, torch: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2 and value.dtype.itemsize >= 2


def _nested(value: Any) -> Iterable[Any]:
    """``value`` and, for a plain tuple/list/dict, its items (the one level the bridge looks into)."""
    yield value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        yield from value
    elif type(value) is dict:
        yield from value.values()


def caller_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype of the call's main activation: its first floating tensor of two or more dimensions."""
    import torch

    for top in (*args, *kwargs.values()):
        for value in _nested(top):
            if _castable(value, torch):
                return value.dtype
    return None


def cast_inputs(args: tuple, kwargs: dict, target: torch.dtype) -> tuple[tuple, dict, torch.dtype | None]:
    """(args, kwargs, caller dtype or None when it is ``target``): activations in another floating dtype cast to
    ``target``, and 1-d tensors in the caller's dtype (timesteps built from the latents)."""
    import torch

    caller = caller_dtype(args, kwargs)
    if caller == target:
        caller = None

    def needs_cast(value: Any) -> bool:
        if _castable(value, torch):
            return value.dtype != target
        return (caller is not None and isinstance(value, torch.Tensor) and value.dim() == 1
                and value.dtype == caller)

    def cast(value: Any, depth: int = 0) -> Any:
        if needs_cast(value):
            return value.to(target)
        if depth == 0 and isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(cast(v, 1) for v in value)
        if depth == 0 and type(value) is dict:
            return {k: cast(v, 1) for k, v in value.items()}
        return value

    new_args = tuple(cast(a) for a in args)
    new_kwargs = {k: cast(v) for k, v in kwargs.items()}
    return new_args, new_kwargs, caller


def cast_outputs(output: Any, source: torch.dtype, caller: torch.dtype) -> Any:
    """Floating outputs in ``source`` (the component's dtype) cast back to ``caller``."""
    import torch

    def cast(value: Any, depth: int) -> Any:
        if _castable(value, torch):
            return value.to(caller) if value.dtype == source else value
        if depth > 2:
            return value
        if isinstance(value, dict):  # BaseOutput / ModelOutput (their __setitem__ keeps attributes in sync)
            for key in list(value.keys()):
                new = cast(value[key], depth + 1)
                if new is not value[key]:
                    value[key] = new
            return value
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(cast(v, depth + 1) for v in value)
        return value

    return cast(output, 0)


class _Bridge:
    """The forward hooks of one module. The caller's dtype travels from the pre-hook to the post-hook on a
    per-thread stack (the post-hook only sees the already-cast inputs)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __getstate__(self) -> dict:  # deepcopy/pickle of a bridged module: the stack is per call, not state
        return {}

    def __setstate__(self, state: dict) -> None:
        self._local = threading.local()

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        target = component_dtype(module)
        caller = None
        if target is not None:
            args, kwargs, caller = cast_inputs(args, kwargs, target)
        self._stack().append((target, caller))
        return args, kwargs

    def post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        stack = self._stack()
        target, caller = stack.pop() if stack else (None, None)
        if caller is None or target is None or output is None:
            return None
        return cast_outputs(output, target, caller)


class _BridgedMethod:
    """``module.decode`` and friends, bridged. Holds the module (not a closure over it) so that
    ``copy.deepcopy(module)`` yields a copy whose method calls the copy."""

    def __init__(self, module: torch.nn.Module, name: str):
        self.module = module
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        method = getattr(type(module), self.name).__get__(module)
        target = component_dtype(module)
        if target is None:
            return method(*args, **kwargs)
        args, kwargs, caller = cast_inputs(args, kwargs, target)
        output = method(*args, **kwargs)
        return output if caller is None else cast_outputs(output, target, caller)

    def __repr__(self) -> str:
        return f"<bridged {type(self.module).__name__}.{self.name}>"


def bridge_module(module: torch.nn.Module) -> bool:
    """Install the bridge on one component (idempotent). Returns False if it already had one."""
    if _ATTR in module.__dict__:
        return False
    bridge = _Bridge()
    handles = [
        module.register_forward_pre_hook(bridge.pre, with_kwargs=True),
        module.register_forward_hook(bridge.post, with_kwargs=True, always_call=True),
    ]
    methods = []
    for name in BRIDGED_METHODS:
        if name not in module.__dict__ and callable(getattr(type(module), name, None)):
            module.__dict__[name] = _BridgedMethod(module, name)  # instance attribute shadows the method
            methods.append(name)
    module.__dict__[_ATTR] = (handles, methods)
    return True


def unbridge_module(module: torch.nn.Module) -> None:
    state = module.__dict__.pop(_ATTR, None)
    if state is None:
        return
    handles, methods = state
    for handle in handles:
        handle.remove()
    for name in methods:
        module.__dict__.pop(name, None)


def _modules(pipe: Any) -> dict[str, torch.nn.Module]:
    import torch

    return {n: c for n, c in getattr(pipe, "components", {}).items() if isinstance(c, torch.nn.Module)}


def install_bridge(pipe: Any, *, force: bool = False) -> list[str]:
    """Bridge every model component of ``pipe`` when they do not all share one dtype (or ``force``).
    Returns the bridged component names."""
    modules = _modules(pipe)
    dtypes = {component_dtype(m) for m in modules.values()} - {None}
    if len(dtypes) <= 1 and not force:
        return []
    for module in modules.values():
        bridge_module(module)
    return sorted(modules)


def remove_bridge(pipe: Any, names: Iterable[str] | None = None) -> None:
    """Undo :func:`install_bridge` (e.g. after converting every component to one dtype yourself)."""
    for name, module in _modules(pipe).items():
        if names is None or name in names:
            unbridge_module(module)


def is_bridged(module: torch.nn.Module) -> bool:
    return _ATTR in module.__dict__
