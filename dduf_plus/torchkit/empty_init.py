"""Build a model without memory or initialisation, in the building thread only.

What diffusers does around ``from_config`` when it loads (accelerate's ``init_empty_weights`` and its own
``no_init_weights``): parameters registered on the meta device, buffers left real (non-persistent ones, such
as position ids, are computed at construction and stored nowhere), ``torch.nn.init`` functions skipped (on a
meta tensor they compute nothing but still cost a dispatch through torch's decompositions). Two differences:

- **This thread only.** Both of those patch ``nn.Module.register_parameter`` and ``torch.nn.init`` for the
  whole process while they run: a model that another thread builds meanwhile (an application's own code
  beside a load in a worker thread) would get meta parameters or silently uninitialised weights. Here each
  of those attributes gets, once, a *dispatcher* that stays: in a thread inside a block it does the block's
  work, in every other thread it calls torch's own function.
- **No failed attribute probe per parameter.** ``register_parameter`` checks ``hasattr(module, name)``,
  which for a new name raises and catches an ``AttributeError`` formatted in ``nn.Module.__getattr__``
  (about 10 us a parameter; ~1,000 in an SD-1.5 UNet and VAE). For a plain ``Parameter`` under a new, valid
  name the same checks are made on the module's dictionaries directly; anything else goes through torch's
  own ``register_parameter`` (its errors unchanged) and is then moved to the meta device as accelerate does.

**The invariant** that makes every interleaving with other threads safe, accelerate's and diffusers' own
patch-and-restore included: a dispatcher delegates only to *torch's own* function, recognised by the module
and name torch defines it under, never to whatever the attribute happened to hold; it is installed, under a
lock, only over torch's own function (never over another library's patch in force) and never removed. So:

- nothing ever records a dispatcher, or another library's temporary patch, as "the original": no
  recursion, and no patch is left in place when that library restores;
- a library that saves the attribute while a dispatcher is there restores the dispatcher, which outside a
  block behaves as torch; one that restores torch's own function over it (diffusers restores what it saw at
  import) removes it, and the next block installs it again;
- the meta device does not depend on the dispatcher: a global parameter-registration hook, registered once
  and active only in a thread inside a :func:`meta_parameters` block, moves that thread's new parameters to
  the meta device whatever ``register_parameter`` is at the time (another library's patch, torch's own).
  Hooks stay registered (see :func:`ensure_hooks`); :func:`registration_hooks_idle` tells a direct
  assignment that none of them would act in its thread. A block's ``torch.nn.init`` calls, when a dispatcher is not in place, go to whatever is
  (another library's skip, or torch's own, which on meta parameters computes nothing and draws no random
  numbers).
The only race left is a library reading the attribute between our read and our write: its patch is then
replaced by the dispatcher and its block builds real, initialised parameters (same loaded values, more
memory); nothing stays patched.
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


def _depth(kind: str) -> int:
    return getattr(_local, kind, 0)


class Dispatcher:
    """One attribute of torch (``owner.attribute``) and the function that stands in for it: ``make(torch's
    own function)`` builds it once. ``home`` is where torch defines its own function (module, qualname or
    None for any name): how torch's own is told from another library's patch."""

    def __init__(self, owner: Any, attribute: str, home: tuple[str, str | None],
                 make: Callable[[Callable[..., Any]], Callable[..., Any]]):
        self.owner, self.attribute, self.home, self.make = owner, attribute, home, make
        self.function: Callable[..., Any] | None = None  # the dispatcher, once made
        self.torch_own: Callable[..., Any] | None = None

    def is_torch_own(self, value: Any) -> bool:
        module, qualname = self.home
        return (value is not self.function and getattr(value, "__module__", None) == module
                and (qualname is None or getattr(value, "__qualname__", None) == qualname))

    def ensure(self) -> bool:
        """Install the dispatcher if torch's own function is in place (call under ``_lock``); whether the
        dispatcher is in place afterwards."""
        current = getattr(self.owner, self.attribute)
        if self.function is not None and current is self.function:
            return True
        if not self.is_torch_own(current):
            return False  # another library's patch is in force: never replaced, never recorded
        if self.function is None:
            self.torch_own = current
            self.function = self.make(current)
        setattr(self.owner, self.attribute, self.function)
        return True


    def remove(self) -> None:
        """Put torch's own function back if the dispatcher is what the attribute holds (call under ``_lock``;
        one another library wrapped stays: outside a block it behaves as torch's own)."""
        if self.function is not None and getattr(self.owner, self.attribute) is self.function:
            setattr(self.owner, self.attribute, self.torch_own)


_users: dict[str, int] = {}  # installed_while: threads' open blocks per key


@contextlib.contextmanager
def installed_while(key: str, dispatchers: list[Dispatcher]) -> Iterator[None]:
    """The dispatchers in place while any thread is inside a block of ``key``; the last one out removes them
    (for functions that should stay torch's own object otherwise, such as ``torch.get_default_dtype``, which
    torch.compile knows by identity). Same invariant as :func:`install`."""
    with _lock:
        for dispatcher in dispatchers:
            dispatcher.ensure()
        _users[key] = _users.get(key, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _users[key] -= 1
            if _users[key] == 0:
                for dispatcher in dispatchers:
                    dispatcher.remove()


def install(dispatchers: list[Dispatcher]) -> None:
    """Put each dispatcher in place where torch's own function is (see the module's invariant)."""
    with _lock:
        for dispatcher in dispatchers:
            dispatcher.ensure()


@contextlib.contextmanager
def thread_depth(kind: str) -> Iterator[None]:
    """This thread is one block deeper in ``kind`` (what the dispatchers consult) within the block."""
    setattr(_local, kind, _depth(kind) + 1)
    try:
        yield
    finally:
        setattr(_local, kind, _depth(kind) - 1)


# --- no initialisation -------------------------------------------------------------------------------------
def _skipping(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def init_function(*args: Any, **kwargs: Any) -> Any:
            if _depth("no_init"):
                return args[0] if args else kwargs.get("tensor")  # what the in-place initialisers return
            return original(*args, **kwargs)

        init_function.__name__ = name
        return init_function

    return make


_init_dispatchers: list[Dispatcher] = []


def _init_patches() -> list[Dispatcher]:
    if not _init_dispatchers:
        import torch.nn.init as init

        _init_dispatchers.extend(Dispatcher(init, name, ("torch.nn.init", None), _skipping(name))
                                 for name in INIT_FUNCTIONS if hasattr(init, name))
    return _init_dispatchers


@contextlib.contextmanager
def no_init() -> Iterator[None]:
    """Within the block, ``torch.nn.init`` functions called from this thread do nothing (they return the
    tensor they were given): the weights are about to be replaced by stored ones."""
    install(_init_patches())
    with thread_depth("no_init"):
        yield


# --- parameters on the meta device ---------------------------------------------------------------------------
_torch: dict[str, Any] = {}  # nn.Parameter and torch's global parameter-registration hooks, once imported


def meta_copy(param: Any) -> Any:
    """``param`` on the meta device, of its own kind and attributes, as accelerate moves it."""
    kwargs = dict(param.__dict__)
    kwargs["requires_grad"] = param.requires_grad
    initialized = kwargs.pop("_is_hf_initialized", None)
    moved = type(param)(param.to("meta"), **kwargs)
    if initialized is not None:
        moved._is_hf_initialized = initialized
    return moved


def _meta_hook(module: Any, name: str, param: Any) -> Any:
    """The global registration hook: in a thread inside a block, the parameter goes to the meta device."""
    if _depth("meta") and param is not None and not param.is_meta:
        return meta_copy(param)
    return None


def _registered_fast(module: Any, name: Any, param: Any) -> bool:
    """Register a plain ``Parameter`` (or None) under a new, valid name without torch's failing attribute
    probe; False where torch's own function must decide (its errors unchanged)."""
    parameter, hooks = _torch["Parameter"], _torch["hooks"]
    state = module.__dict__
    fresh = (type(name) is str and name != "" and "." not in name and "_parameters" in state
             and name not in state and name not in state["_buffers"] and name not in state["_modules"]
             and not hasattr(type(module), name))  # torch's own checks, without the failing attribute probe
    if fresh and param is None:
        state["_parameters"][name] = None
        return True
    if not (fresh and type(param) is parameter and param.grad_fn is None and not param.__dict__):
        return False
    for hook in tuple(hooks.values()):  # the construction budget's, and _meta_hook
        output = hook(module, name, param)
        if output is not None:
            param = output
    if type(param) is parameter and not param.is_meta:
        param = parameter(param.to("meta"), requires_grad=param.requires_grad)
    state["_parameters"][name] = param
    return True


def _dispatching_register(original: Callable[..., Any]) -> Callable[..., Any]:
    def register_parameter(module: Any, name: Any, param: Any) -> None:
        if not _depth("meta"):
            original(module, name, param)
            return
        # plain Parameters only: no torch function mode needs to see these few attribute reads and one move
        # (the per-thread default dtype's mode would otherwise handle ~6 calls a parameter)
        with _torch["modes_off"]():
            if _registered_fast(module, name, param):
                _still_real(module, name)
                return
        original(module, name, param)
        _still_real(module, name)

    return register_parameter


def _still_real(module: Any, name: Any) -> None:
    current = module._parameters.get(name)
    if current is not None and not current.is_meta:  # a hook handed back a real one
        module._parameters[name] = meta_copy(current)


_meta_state: dict[str, Any] = {"dispatcher": None}

# Global registration hooks that act only in a thread inside some block: hook -> "active in this thread?".
# While such a hook is registered for another thread's block, setting a parameter directly in this thread is
# the same as torch's setattr (which would call it): see registration_hooks_idle.
THREAD_SCOPED_HOOKS: dict[Callable[..., Any], Callable[[], bool]] = {_meta_hook: lambda: _depth("meta") > 0}


def registration_hooks_idle() -> bool:
    """Whether no global parameter or buffer registration hook would do anything in this thread now:
    none registered, or only thread-scoped ones (another thread's block) inactive here."""
    from torch.nn.modules import module as module_impl

    hooks = (*module_impl._global_parameter_registration_hooks.values(),
             *module_impl._global_buffer_registration_hooks.values())
    return all(hook in THREAD_SCOPED_HOOKS and not THREAD_SCOPED_HOOKS[hook]() for hook in hooks)


def _meta_dispatcher() -> Dispatcher:
    if _meta_state["dispatcher"] is None:
        import torch
        from torch.nn.modules import module as module_impl

        _torch.update(Parameter=torch.nn.Parameter, hooks=module_impl._global_parameter_registration_hooks,
                      modes_off=torch._C.DisableTorchFunction)
        _meta_state["dispatcher"] = Dispatcher(torch.nn.Module, "register_parameter",
                                               ("torch.nn.modules.module", "Module.register_parameter"),
                                               _dispatching_register)
    return _meta_state["dispatcher"]


def ensure_hooks(key: str, register: Callable[[], None]) -> None:
    """Call ``register`` once per process (under the lock). Thread-scoped hooks stay registered: adding and
    removing them per block would mutate torch's hook dictionaries while other threads iterate them
    (``OrderedDict mutated during iteration`` in a concurrent construction)."""
    with _lock:
        if key not in _registered:
            register()
            _registered.add(key)


_registered: set[str] = set()


def _register_meta_hook() -> None:
    from torch.nn.modules import module as module_impl

    module_impl.register_module_parameter_registration_hook(_meta_hook)


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Within the block, parameters that modules built in this thread register are on the meta device (no
    memory) and not initialised; buffers stay real. Equivalent to diffusers' ``no_init_weights()`` with
    accelerate's ``init_empty_weights()``, for this thread only."""
    ensure_hooks("meta", _register_meta_hook)
    install([_meta_dispatcher()])
    with no_init(), thread_depth("meta"):
        yield


__all__ = ["INIT_FUNCTIONS", "THREAD_SCOPED_HOOKS", "Dispatcher", "ensure_hooks", "install", "installed_while", "meta_copy", "meta_parameters", "no_init",
           "registration_hooks_idle", "thread_depth"]
