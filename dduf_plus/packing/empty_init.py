"""Build a model without memory or initialisation, in the building thread only.

What diffusers does around ``from_config`` when it loads (accelerate's ``init_empty_weights`` and its own
``no_init_weights``): parameters registered on the meta device, buffers left real (non-persistent ones, such
as position ids, are computed at construction and stored nowhere), ``torch.nn.init`` functions skipped (on a
meta tensor they compute nothing but still cost a dispatch through torch's decompositions). Two differences:

- **This thread only.** Both of those patch ``nn.Module.register_parameter`` and ``torch.nn.init`` for the
  whole process while they run: a model that another thread builds meanwhile (an application's own code
  beside a load in a worker thread) would get meta parameters or silently uninitialised weights. Here the
  patches are installed while any thread builds and consult a thread-local depth: other threads get torch's
  own functions' behaviour. Blocks nest; the outermost exit in the last building thread restores torch.
- **No failed attribute probe per parameter.** ``register_parameter`` checks ``hasattr(module, name)``,
  which for a new name raises and catches an ``AttributeError`` formatted in ``nn.Module.__getattr__``
  (about 10 us a parameter; ~1,000 in an SD-1.5 UNet and VAE). For a plain ``Parameter`` under a new, valid
  name the same checks are made on the module's dictionaries directly; anything else goes through torch's
  own ``register_parameter`` (its errors unchanged) and is then moved to the meta device as accelerate does.
  Global parameter-registration hooks (the construction budget's) run either way, before the move.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

# torch.nn.init functions diffusers' no_init_weights replaces (those that fill a tensor in place).
INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "xavier_uniform_", "xavier_normal_",
                  "kaiming_uniform_", "kaiming_normal_", "uniform", "normal", "xavier_uniform", "xavier_normal",
                  "kaiming_uniform", "kaiming_normal", "ones_", "zeros_", "eye_", "dirac_", "orthogonal_", "sparse_")

_local = threading.local()  # .meta / .no_init: how deep this thread is in each kind of block
_lock = threading.Lock()
_users = {"meta": 0, "no_init": 0}  # threads' open blocks of each kind, all threads together
# the functions patched, by key: kept after the patches are removed, so a patch captured meanwhile still works
_originals: dict[str, dict[str, Callable[..., Any]]] = {"meta": {}, "no_init": {}}
# what each kind has patched now: (owner, attribute, replacement, original)
_installed: dict[str, list[tuple[Any, str, Callable[..., Any], Callable[..., Any]]]] = {"meta": [], "no_init": []}

Patches = dict[str, tuple[Any, str, Callable[..., Any]]]  # key -> (owner, attribute, replacement)


def _depth(kind: str) -> int:
    return getattr(_local, kind, 0)


@contextlib.contextmanager
def _scope(kind: str, patches: Callable[[], Patches]) -> Iterator[None]:
    """Enter a block of ``kind`` in this thread; the first block of any thread installs ``patches()``, the last
    one out removes those still ours (one patched over since is left alone)."""
    with _lock:
        if _users[kind] == 0:
            for key, (owner, attribute, replacement) in patches().items():
                original = _originals[kind][key] = getattr(owner, attribute)
                _installed[kind].append((owner, attribute, replacement, original))
                setattr(owner, attribute, replacement)
        _users[kind] += 1
    setattr(_local, kind, _depth(kind) + 1)
    try:
        yield
    finally:
        setattr(_local, kind, _depth(kind) - 1)
        with _lock:
            _users[kind] -= 1
            if _users[kind] == 0:
                for owner, attribute, replacement, original in _installed[kind]:
                    if getattr(owner, attribute) is replacement:
                        setattr(owner, attribute, original)
                _installed[kind].clear()


# --- no initialisation -------------------------------------------------------------------------------------
def _skipping(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def init_function(*args: Any, **kwargs: Any) -> Any:
        if _depth("no_init"):
            return args[0] if args else kwargs.get("tensor")  # what the in-place initialisers return
        return original(*args, **kwargs)

    init_function.__name__ = name
    return init_function


def _init_patches() -> Patches:
    import torch.nn.init as init

    return {name: (init, name, _skipping(name, getattr(init, name))) for name in INIT_FUNCTIONS if hasattr(init, name)}


@contextlib.contextmanager
def no_init() -> Iterator[None]:
    """Within the block, ``torch.nn.init`` functions called from this thread do nothing (they return the
    tensor they were given): the weights are about to be replaced by stored ones."""
    with _scope("no_init", _init_patches):
        yield


# --- parameters on the meta device ---------------------------------------------------------------------------
def _register_parameter(module: Any, name: Any, param: Any) -> None:
    original = _originals["meta"]["register_parameter"]
    if not _depth("meta"):
        original(module, name, param)
        return
    parameter, hooks = _torch["Parameter"], _torch["hooks"]
    state = module.__dict__
    fresh = (type(name) is str and name != "" and "." not in name and "_parameters" in state
             and name not in state and name not in state["_buffers"] and name not in state["_modules"]
             and not hasattr(type(module), name))  # torch's own checks, without the failing attribute probe
    if fresh and param is None:
        state["_parameters"][name] = None
        return
    if fresh and type(param) is parameter and param.grad_fn is None and not param.__dict__:
        for hook in hooks.values():
            output = hook(module, name, param)
            if output is not None:
                param = output
        if type(param) is parameter:
            state["_parameters"][name] = parameter(param.to("meta"), requires_grad=param.requires_grad)
            return
        state["_parameters"][name] = param  # a hook handed back another kind: moved below, as accelerate does
    else:
        original(module, name, param)
    current = module._parameters.get(name)
    if current is not None and not current.is_meta:
        kwargs = dict(current.__dict__)
        kwargs["requires_grad"] = current.requires_grad
        initialized = kwargs.pop("_is_hf_initialized", None)
        moved = type(current)(current.to("meta"), **kwargs)
        if initialized is not None:
            moved._is_hf_initialized = initialized
        module._parameters[name] = moved


_torch: dict[str, Any] = {}  # nn.Parameter and torch's global parameter-registration hooks, once imported


def _meta_patches() -> Patches:
    import torch
    from torch.nn.modules import module as module_impl

    _torch.update(Parameter=torch.nn.Parameter, hooks=module_impl._global_parameter_registration_hooks)
    return {"register_parameter": (torch.nn.Module, "register_parameter", _register_parameter)}


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Within the block, parameters that modules built in this thread register are on the meta device (no
    memory) and not initialised; buffers stay real. Equivalent to diffusers' ``no_init_weights()`` with
    accelerate's ``init_empty_weights()``, for this thread only."""
    with no_init(), _scope("meta", _meta_patches):
        yield


__all__ = ["INIT_FUNCTIONS", "meta_parameters", "no_init"]
