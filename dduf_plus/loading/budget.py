"""How big a model may be built: bounded by the weights the archive stores for it.

A model is built from its config before any weight is read, and the config is untrusted: ``num_layers:
65536`` or ``num_attention_heads: 1048576`` in a 500 KB archive made the loader run for minutes and take
gigabytes (meta-device construction still creates every module in Python, and buffers computed at
construction, such as position embeddings, are real tensors) before the weights were found not to fit.
Since a model whose stored weights do not cover it is refused anyway, its construction may register at
most a small multiple of what is stored; past that it is stopped at once with a :class:`DDUFLoadError`.

The limits are checked by torch's global module-registration hooks, active only in the thread that builds
(a thread-local budget), and only while it builds."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import DDUFLoadError

# Construction registers each parameter once, and transformers' loader once more when it assigns the
# weights; tied weights and buffers add a little (the fixtures: 2.0-2.6x the stored elements, at most 2.1
# modules per stored tensor). The slack covers small models' computed buffers.
ELEMENT_FACTOR = 8
ELEMENT_SLACK = 1 << 24
MODULE_FACTOR = 8
MODULE_SLACK = 256

_local = threading.local()


class _Budget:
    def __init__(self, where: str, what: str, stored_tensors: int, stored_elements: int):
        self.where, self.what = where, what
        self.stored_tensors, self.stored_elements = stored_tensors, stored_elements
        self.max_elements = ELEMENT_FACTOR * stored_elements + ELEMENT_SLACK
        self.max_modules = MODULE_FACTOR * stored_tensors + MODULE_SLACK
        self.elements = self.modules = 0

    def refuse(self, asked: str) -> DDUFLoadError:
        return DDUFLoadError(
            f"{self.where}: its config makes {self.what} far bigger than the weights the archive stores for it "
            f"({asked}; {self.stored_tensors} tensors, {self.stored_elements} elements stored): refusing to build it")


def _on_tensor(module: Any, name: str, tensor: Any) -> None:
    budget = getattr(_local, "budget", None)
    if budget is None or tensor is None:
        return
    budget.elements += tensor.numel()
    if budget.elements > budget.max_elements:
        raise budget.refuse(f"over {budget.max_elements} parameter and buffer elements")


def _on_module(module: Any, name: str, submodule: Any) -> None:
    budget = getattr(_local, "budget", None)
    if budget is None:
        return
    budget.modules += 1
    if budget.modules > budget.max_modules:
        raise budget.refuse(f"over {budget.max_modules} modules")


@contextlib.contextmanager
def construction_budget(where: str, what: str, metadata: Mapping[str, tuple[str, tuple[int, ...], int]], *,
                        enabled: bool = True) -> Iterator[None]:
    """Refuse, while the block builds a model, to create more than the budget ``metadata`` (the stored
    tensors: {name: (dtype, shape, nbytes)}) allows. ``enabled=False``: no limit (weights may be missing)."""
    if not enabled:
        yield
        return
    import torch.nn.modules.module as torch_module

    elements = 0
    for _dtype, shape, _nbytes in metadata.values():
        numel = 1
        for d in shape:
            numel *= d
        elements += numel
    previous = getattr(_local, "budget", None)
    _local.budget = _Budget(where, what, len(metadata), elements)
    handles = [torch_module.register_module_parameter_registration_hook(_on_tensor),
               torch_module.register_module_buffer_registration_hook(_on_tensor),
               torch_module.register_module_module_registration_hook(_on_module)]
    try:
        yield
    finally:
        _local.budget = previous
        for handle in handles:
            handle.remove()
