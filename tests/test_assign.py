"""``assign_state`` gives a meta-built model its tensors as ``load_state_dict(strict=False, assign=True)`` does
(same tensors, requires_grad, missing and unexpected keys), and declines (None, nothing assigned) wherever
torch's loader could act otherwise: hooks, a module's own loading, a shape that does not fit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dduf_plus.loading.assign import assign_state


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        self.register_buffer("scale", torch.ones(2))
        self.register_buffer("cache", torch.zeros(3), persistent=False)
        self.frozen = nn.Parameter(torch.zeros(5), requires_grad=False)


def _meta() -> Net:
    with torch.device("meta"):
        return Net()


def _state(drop: str | None = None, extra: str | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {k: torch.randn_like(v, device="cpu") for k, v in Net().state_dict().items()}
    if drop:
        del state[drop]
    if extra:
        state[extra] = torch.ones(1)
    return state


@pytest.mark.parametrize("drop,extra", [(None, None), ("body.2.bias", None), (None, "body.9.weight"),
                                        ("scale", "nothing")])
def test_same_as_load_state_dict_assign(drop, extra):
    state = _state(drop, extra)
    ours, theirs = _meta(), _meta()
    got = assign_state(ours, state)
    want = theirs.load_state_dict(state, strict=False, assign=True)
    assert got is not None
    assert (sorted(got[0]), sorted(got[1])) == (sorted(want.missing_keys), sorted(want.unexpected_keys))
    a = dict(ours.named_parameters()) | dict(ours.named_buffers())
    b = dict(theirs.named_parameters()) | dict(theirs.named_buffers())
    assert a.keys() == b.keys()
    for name, tensor in b.items():
        mine = a[name]
        assert (type(mine), mine.requires_grad, mine.is_meta) == (type(tensor), tensor.requires_grad, tensor.is_meta)
        if not tensor.is_meta:
            assert mine.data_ptr() == tensor.data_ptr() == state[name].data_ptr(), name  # the very tensor, no copy


def test_a_shape_that_does_not_fit_assigns_nothing():
    model, state = _meta(), _state()
    state["body.0.weight"] = torch.zeros(3, 3)
    assert assign_state(model, state) is None
    assert all(p.is_meta for p in model.parameters())  # nothing half-assigned: the caller's loader starts clean


def test_hooks_and_own_loading_are_left_to_torch():
    model = _meta()
    model.body[1].register_load_state_dict_pre_hook(lambda *a, **k: None)
    assert assign_state(model, _state()) is None

    class Own(nn.Linear):
        def _load_from_state_dict(self, *args, **kwargs):  # noqa: ANN002, ANN003
            return super()._load_from_state_dict(*args, **kwargs)

    model = _meta()
    with torch.device("meta"):
        model.body[0] = Own(4, 8)
    assert assign_state(model, _state()) is None

    handle = nn.modules.module.register_module_parameter_registration_hook(lambda *a: None)
    try:
        assert assign_state(_meta(), _state()) is None
    finally:
        handle.remove()
