"""torch's default dtype for one thread: what a load builds under, without another thread seeing it.

diffusers and transformers build a model under its dtype by changing torch's default dtype
(``torch.set_default_dtype``) around construction, so that tensors made without an explicit dtype
(parameters, buffers computed at construction such as position tables) come out in it. That default is one
value for the whole process: another thread building a model meanwhile gets fp16 layers, and two loads that
overlap restore each other's values in the wrong order (the default stayed fp16 after two concurrent fp16
loads). Within :func:`local_default_dtype`, in this thread only:

- ``torch.set_default_dtype`` / ``torch.get_default_dtype`` (dispatchers under the rule of
  :mod:`dduf_plus.torchkit.empty_init`, in place only while some thread is in a block: torch.compile knows
  torch's own by identity) set and read this thread's value, so diffusers' ``_set_default_torch_dtype``
  and transformers' ``local_torch_dtype`` called from here change nothing another thread sees. Outside a
  block, and in every other thread, they behave as torch's own.
- a torch function mode (torch's mode stack is per thread) gives torch functions called from this thread
  that value where torch would have used the process default: factories that always make a floating
  tensor (``empty``, ``zeros``, ``rand``...) get ``dtype=`` when none is given; factories that infer
  (``tensor``, ``full``, ``arange``...) and any other function whose floating result came from no floating
  input (``int_tensor / 2``, ``torch.where(mask, 1.0, 0.0)``) are called again as torch would have run them
  under that default (integer tensors promoted to it first), or their result cast where nothing can be
  promoted. Explicit conversions (``.float()``, ``.to(dtype)``, any call naming a dtype) are left alone.
  This covers what model constructors do; results equal building under ``torch.set_default_dtype``
  (tests/test_threads.py compares them on every fixture model).

The process default itself is never written by a load.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .empty_init import Dispatcher, installed_while

_local = threading.local()  # .dtype: this thread's default (None: the process's); .scopes: open blocks
_dispatchers: list[Dispatcher] = []
_functions: dict[str, Any] = {}  # the function sets below, once torch is imported
FLOATING_DEFAULTS = ("float16", "bfloat16", "float32", "float64")  # what torch.set_default_dtype accepts


def _in_scope() -> bool:
    return getattr(_local, "scopes", 0) > 0


def _dispatching_set(original: Callable[..., Any]) -> Callable[..., Any]:
    def set_default_dtype(d: Any) -> None:
        if not _in_scope() or not _is_floating_default(d):
            original(d)  # outside a block, or a value torch refuses (its error unchanged)
            return
        _local.dtype = d

    return set_default_dtype


def _dispatching_get(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_default_dtype() -> Any:
        mine = getattr(_local, "dtype", None) if _in_scope() else None
        return original() if mine is None else mine

    return get_default_dtype


def _is_floating_default(d: Any) -> bool:
    import torch

    return isinstance(d, torch.dtype) and str(d).removeprefix("torch.") in FLOATING_DEFAULTS


def _dtype_dispatchers() -> list[Dispatcher]:
    if not _dispatchers:
        import torch

        _dispatchers.append(Dispatcher(torch, "set_default_dtype", ("torch", "set_default_dtype"), _dispatching_set))
        _dispatchers.append(Dispatcher(torch, "get_default_dtype", ("torch", "get_default_dtype"), _dispatching_get))
        _functions.update(_function_sets(torch))
    return _dispatchers


def _function_sets(torch: Any) -> dict[str, Any]:
    t = torch.Tensor
    return {
        # always floating unless told otherwise
        "always": {torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn, torch.eye, torch.linspace,
                   torch.logspace, torch.empty_strided, torch.scalar_tensor, torch.hamming_window,
                   torch.hann_window, torch.blackman_window, torch.bartlett_window, torch.kaiser_window},
        # dtype inferred from the data: floating Python numbers give the default
        "inferred": {torch.tensor, torch.as_tensor, torch.asarray, torch.full, torch.arange, torch.range},
        # floating; its dtype comes from its mean and std where they are tensors (random: called once)
        "random": {torch.normal},
        # conversions that name their dtype (or take another tensor's)
        "explicit": {t.float, t.double, t.half, t.bfloat16, t.to, t.type, t.type_as, t.new_tensor, t.new_empty,
                     t.new_zeros, t.new_ones, t.new_full, torch.from_numpy, torch.frombuffer, torch.zeros_like,
                     torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like},
        "process_default": torch._C.get_default_dtype,
        "Tensor": t,
        "dtype": torch.dtype,
        "bool": torch.bool,
    }


def _floating_inside(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` holds a floating tensor or array (which then decides a result's dtype)."""
    if isinstance(value, _functions["Tensor"]):
        return bool(value.is_floating_point() or value.is_complex())
    kind = getattr(getattr(value, "dtype", None), "kind", None)  # numpy arrays and scalars
    if kind is not None:
        return kind in "fc"
    if isinstance(value, (list, tuple)) and depth < 8:
        return any(_floating_inside(v, depth + 1) for v in value)
    if isinstance(value, dict) and depth < 8:
        return any(_floating_inside(v, depth + 1) for v in value.values())
    return False


def _tensor_inside(values: list | tuple) -> bool:
    return any(isinstance(v, _functions["Tensor"]) for v in values)


def _names_dtype(args: tuple, kwargs: dict) -> bool:
    dtype_type = _functions["dtype"]
    return kwargs.get("dtype") is not None or "out" in kwargs or any(isinstance(a, dtype_type) for a in args)


def _promoted(value: Any, target: Any) -> Any:
    """Integer tensors (not bools) as torch promotes them under the ``target`` default."""
    if isinstance(value, _functions["Tensor"]) and not value.is_floating_point() and not value.is_complex() \
            and value.dtype != _functions["bool"]:
        return value.to(target)
    if isinstance(value, (list, tuple)):
        return type(value)(_promoted(v, target) for v in value)
    return value


def _has_integer_tensor(value: Any) -> bool:
    if isinstance(value, _functions["Tensor"]):
        return not value.is_floating_point() and not value.is_complex() and value.dtype != _functions["bool"]
    if isinstance(value, (list, tuple)):
        return any(_has_integer_tensor(v) for v in value)
    return False


def _call(func: Any, args: tuple, kwargs: dict, target: Any, result: Any = None) -> Any:
    """``func`` called as torch would have called it with ``target`` as the default dtype (``result``: what
    it returned called as it was, if it was already)."""
    sets = _functions
    if func in sets["always"] and not _names_dtype(args, kwargs):
        return func(*args, **{**kwargs, "dtype": target})
    if func in sets["random"] and not _names_dtype(args, kwargs) and not _tensor_inside(args) \
            and not _tensor_inside(list(kwargs.values())):
        return func(*args, **{**kwargs, "dtype": target})
    if result is None:
        result = func(*args, **kwargs)
    # most calls end here: not a tensor (sizes, flags), or not in the process default
    if not (isinstance(result, sets["Tensor"]) and result.dtype == sets["process_default"]()):
        return result
    if func in sets["explicit"] or _names_dtype(args, kwargs) or _floating_inside(args) or _floating_inside(kwargs):
        return result  # a named dtype, or a floating input, decided it: not the default
    if func in sets["inferred"]:
        return func(*args, **{**kwargs, "dtype": target})
    if _has_integer_tensor(args) or _has_integer_tensor(list(kwargs.values())):
        return func(*_promoted(args, target), **{k: _promoted(v, target) for k, v in kwargs.items()})
    return result.to(target)


def _mode_class() -> type:
    from torch.overrides import TorchFunctionMode

    class ThreadDefaultDtype(TorchFunctionMode):
        """Active in one thread (torch's mode stack is per thread) while it is in a block."""

        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            # every torch call of the building thread comes here (~1,800 for an SD-1.5 UNet): the common
            # case (a call that is no factory and returns no tensor in the process default) stays short
            kwargs = kwargs or {}
            target = getattr(_local, "dtype", None)
            if target is None or target == process_default():
                return func(*args, **kwargs)
            if func in always or func in random:
                return _call(func, args, kwargs, target)
            result = func(*args, **kwargs)
            if not (isinstance(result, tensor) and result.dtype == process_default()):
                return result
            return _call(func, args, kwargs, target, result)

    process_default, tensor = _functions["process_default"], _functions["Tensor"]
    always, random = _functions["always"], _functions["random"]

    return ThreadDefaultDtype


_mode: dict[str, type] = {}


@contextlib.contextmanager
def local_default_dtype(dtype: Any = None) -> Iterator[None]:
    """Within the block, torch's default dtype in this thread is ``dtype`` (None or a non-floating dtype:
    unchanged), and ``torch.set_default_dtype`` called from this thread changes this thread's value only.
    Blocks nest; each restores the value it found."""
    dispatchers = _dtype_dispatchers()
    if not _mode:
        _mode["class"] = _mode_class()
    previous, scopes = getattr(_local, "dtype", None), getattr(_local, "scopes", 0)
    if dtype is not None and _is_floating_default(dtype):
        _local.dtype = dtype
    _local.scopes = scopes + 1
    try:
        # one mode per thread: nested blocks only change the value it reads
        with installed_while("default_dtype", dispatchers), \
                _mode["class"]() if scopes == 0 else contextlib.nullcontext():
            yield
    finally:
        _local.dtype, _local.scopes = previous, scopes


__all__ = ["local_default_dtype"]
