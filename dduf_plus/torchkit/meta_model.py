"""A model built from its config, within a budget: the one implementation behind dtype conversion
(:mod:`dduf_plus.packing.convert`: the module tree names the tensors and says which stay in fp32), quanto
loading (:mod:`dduf_plus.loading.quant`: the skeleton whose layers quanto's replace) and the loader's own
construction (:mod:`dduf_plus.loading.models`, through :mod:`dduf_plus.loading.budget`).

**The construction budget.** A model is built from its config before any weight is read, and the config is
untrusted: ``num_layers: 65536`` or ``num_attention_heads: 1048576`` in a 500 KB archive made the loader run
for minutes and take gigabytes (meta-device construction still creates every module in Python, and buffers
computed at construction, such as position embeddings, are real tensors) before the weights were found not
to fit. Since a model whose stored weights do not cover it is refused anyway, its construction may register
at most a small multiple of what is stored; past that it is stopped at once with a
:class:`ConstructionBudgetError`. Every path that builds a model from an archive's (or a packed folder's)
config runs under it: plain loading, quanto (``quanto_qmap.json`` and ``quantization_config``) and
``dduf pack --dtype``'s conversion skeleton (3,000 layers there ran 46 s; refused now in about a second).
The limits are checked by torch's global module-registration hooks, registered once per process and active
only in the thread that builds (a thread-local budget), and only while it builds.

Why on the packing floor: both floors need it and layers point down only (packing < loading), so the
shared helper lives on the lower of the two; ``loading`` imports it, ``packing`` never imports
``loading``. It is not in ``format`` because it builds models (torch, diffusers, transformers),
which the byte-only floors never do. Those are imported when a model is built, not with this module, so
importing ``dduf_plus.packing`` stays cheap."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import DDUFLoadError
from .empty_init import THREAD_SCOPED_HOOKS, ensure_hooks

if TYPE_CHECKING:  # pragma: no cover
    import torch

# Construction registers each parameter once, and transformers' loader once more when it assigns the
# weights (quanto: once more when its layers replace the plain ones); tied weights and buffers add a little
# (the fixtures: 2.0-2.6x the stored elements, at most 2.1 modules per stored tensor). The slack covers
# small models' computed buffers.
ELEMENT_FACTOR = 8
ELEMENT_SLACK = 1 << 24
MODULE_FACTOR = 8
MODULE_SLACK = 256

# {tensor name: (dtype, shape, nbytes)}: what the archive stores for a model (files.tensor_metadata)
StoredTensors = Mapping[str, tuple[str, tuple[int, ...], int]]

_local = threading.local()


class ConstructionBudgetError(DDUFLoadError):
    """A config asks for a model far bigger than the weights stored for it: construction was stopped."""


class _Budget:
    def __init__(self, where: str, what: str, stored_tensors: int, stored_elements: int):
        self.where, self.what = where, what
        self.stored_tensors, self.stored_elements = stored_tensors, stored_elements
        self.max_elements = ELEMENT_FACTOR * stored_elements + ELEMENT_SLACK
        self.max_modules = MODULE_FACTOR * stored_tensors + MODULE_SLACK
        self.elements = self.modules = 0

    def refuse(self, asked: str) -> ConstructionBudgetError:
        return ConstructionBudgetError(
            f"{self.where}: its config makes {self.what} far bigger than the weights stored for it "
            f"({asked}; {self.stored_tensors} tensors, {self.stored_elements} elements stored): refusing to build it")


def _on_tensor(module: Any, name: str, tensor: Any) -> None:
    budget = getattr(_local, "budget", None)
    if budget is None or tensor is None:
        return
    budget.elements += tensor.numel()
    if budget.elements > budget.max_elements:
        raise budget.refuse(f"over {budget.max_elements} parameter and buffer elements")


THREAD_SCOPED_HOOKS[_on_tensor] = lambda: getattr(_local, "budget", None) is not None  # this thread's budget only


def _register_budget_hooks() -> None:
    import torch.nn.modules.module as torch_module

    torch_module.register_module_parameter_registration_hook(_on_tensor)
    torch_module.register_module_buffer_registration_hook(_on_tensor)
    torch_module.register_module_module_registration_hook(_on_module)


def _on_module(module: Any, name: str, submodule: Any) -> None:
    budget = getattr(_local, "budget", None)
    if budget is None:
        return
    budget.modules += 1
    if budget.modules > budget.max_modules:
        raise budget.refuse(f"over {budget.max_modules} modules")


def stored_elements(stored: StoredTensors) -> int:
    """The number of elements the stored tensors hold."""
    total = 0
    for _dtype, shape, _nbytes in stored.values():
        numel = 1
        for d in shape:
            numel *= d
        total += numel
    return total


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def position_grid_elements(config: Mapping[str, Any]) -> int:
    """Elements of the position-embedding table a patch-based transformer computes while it is constructed
    (diffusers' ``PatchEmbed``: a grid of ``pos_embed_max_size`` squared, else (``sample_size`` /
    ``patch_size``) squared positions, times the width). It is computed before it is registered, so the
    registration hooks see it only after the time and memory are spent: ``sample_size: 2147483647`` took 55 s
    and 8.6 GB. 0 for a config without a patch size."""
    patch = _int(config.get("patch_size"))
    if patch is None:
        return 0
    grid = _int(config.get("pos_embed_max_size"))
    if grid is not None:
        positions = grid * grid
    else:
        size = config.get("sample_size")
        sides = [_int(s) for s in (size[:2] if isinstance(size, (list, tuple)) else (size, size))]
        if len(sides) != 2 or None in sides:
            return 0
        positions = (sides[0] // patch) * (sides[1] // patch)  # type: ignore[operator]
    heads, head_dim = _int(config.get("num_attention_heads")), _int(config.get("attention_head_dim"))
    width = heads * head_dim if heads and head_dim else (_int(config.get("hidden_size")) or 1)
    return positions * width


@contextlib.contextmanager
def construction_budget(where: str, what: str, stored: StoredTensors, *, enabled: bool = True,
                        config: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Refuse, while the block builds a model, to create more than ``stored`` (the tensors stored for it:
    {name: (dtype, shape, nbytes)}) allows: :class:`ConstructionBudgetError` naming ``where`` and ``what``.
    ``enabled=False``: no limit (the caller accepts missing weights). Nested budgets: the innermost counts.
    ``config``: the model's config, checked first for tables computed before registration
    (:func:`position_grid_elements`)."""
    if not enabled:
        yield
        return
    budget = _Budget(where, what, len(stored), stored_elements(stored))
    grid = position_grid_elements(config) if config is not None else 0
    if grid > budget.max_elements:
        raise budget.refuse(f"a position-embedding grid of {grid} elements, over {budget.max_elements}")
    ensure_hooks("budget", _register_budget_hooks)  # once per process: they act in a budget's thread only
    previous = getattr(_local, "budget", None)
    _local.budget = budget
    try:
        yield
    finally:
        _local.budget = previous


def is_diffusers_model(cls: object) -> bool:
    """Whether ``cls`` is a diffusers ``ModelMixin`` class (built with ``from_config``)."""
    try:
        from diffusers import ModelMixin
    except ImportError:  # pragma: no cover
        return False
    return isinstance(cls, type) and issubclass(cls, ModelMixin)


def meta_model(cls: type[Any], config: Mapping[str, Any], where: str, stored: StoredTensors) -> torch.nn.Module | None:
    """``cls`` built from ``config`` with its parameters on the meta device (no memory), within the
    construction budget of ``stored`` (the tensors stored for it; see the module docstring).

    Buffers stay real: non-persistent ones (position ids, say) are in no archive and must exist.
    ``quantization_config`` is dropped: the skeleton is the plain module tree, as ``from_pretrained``
    builds it before a quantizer rewrites it. A diffusers model is built with ``from_config``, a
    transformers one from its ``config_class``; any other class gives None.

    Raises:
        ConstructionBudgetError: the config asks for far more than ``stored`` holds.
        DDUFLoadError: the model code refused the config (it can raise anything; the message names
            ``where`` and the class).
    """
    from .empty_init import meta_parameters

    config = {k: v for k, v in config.items() if k != "quantization_config"}
    try:
        with meta_parameters(), \
                construction_budget(where, cls.__name__, stored, config=config):
            if is_diffusers_model(cls):
                return cls.from_config(config)
            config_class = getattr(cls, "config_class", None)
            if config_class is None:
                return None
            return cls(config_class.from_dict(config))
    except DDUFLoadError:
        raise
    except Exception as e:  # arbitrary model code, arbitrary config
        raise DDUFLoadError(f"{where}: cannot build {cls.__name__} from its config: {e}") from e
