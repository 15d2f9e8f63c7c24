"""Components' weights compared tensor for tensor (the app-folder tests: a pipeline loaded from app files equals
the one loaded from its base)."""

from __future__ import annotations

from typing import Any

import torch


def states(pipe: Any, names: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """A copy of each named component's state dict."""
    return {n: {k: v.clone() for k, v in getattr(pipe, n).state_dict().items()} for n in names}


def assert_same_states(pipe: Any, expected: dict[str, dict[str, torch.Tensor]]) -> None:
    """Each component in ``expected`` has exactly those tensors, equal bit for bit."""
    for name, state in expected.items():
        mine = getattr(pipe, name).state_dict()
        assert mine.keys() == state.keys(), name
        assert all(torch.equal(mine[k], state[k]) for k in state), name
