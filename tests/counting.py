"""Counts for tests that used to time things: what a refused construction built (modules, parameter and buffer
elements), so a check holds on a busy machine and still fails on the defect it guards against."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# What a refused construction may have built: the construction budget's own allowance for the tiny fixtures is
# a few hundred modules and ~17 M elements; the defects these guard against built thousands of layers (tens of
# thousands of modules) or gigabytes of buffers.
MAX_MODULES = 2000
MAX_ELEMENTS = 64 << 20


@contextmanager
def built() -> Iterator[dict[str, int]]:
    """Counts every module, parameter and buffer element registered in the block (any thread)."""
    import torch.nn.modules.module as torch_module

    counts = {"modules": 0, "elements": 0}

    def on_module(module: object, name: str, submodule: object) -> None:
        counts["modules"] += 1

    def on_tensor(module: object, name: str, tensor: Any) -> None:
        counts["elements"] += 0 if tensor is None else tensor.numel()

    handles = [torch_module.register_module_module_registration_hook(on_module),
               torch_module.register_module_parameter_registration_hook(on_tensor),
               torch_module.register_module_buffer_registration_hook(on_tensor)]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def assert_small(counts: dict[str, int]) -> None:
    """Construction stopped near the budget: far from what the hostile config asked for."""
    assert counts["modules"] < MAX_MODULES and counts["elements"] < MAX_ELEMENTS, counts
