"""``meta_parameters`` / ``no_init`` build models as diffusers' ``no_init_weights`` with accelerate's
``init_empty_weights`` do (same module tree, parameters on meta, buffers real), for the building thread only:
another thread's models are built and initialised as usual meanwhile, and torch is as it was afterwards."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from dduf_plus.loading.budget import ConstructionBudgetError, construction_budget
from dduf_plus.torchkit.empty_init import meta_parameters, no_init

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "pipelines" / "tiny-sd"


def _config(component: str) -> dict:
    return json.loads((FIXTURE / component / "config.json").read_text())


@pytest.mark.parametrize("component,cls_name", [("unet", "UNet2DConditionModel"), ("vae", "AutoencoderKL")])
def test_same_model_as_diffusers_empty_construction(component, cls_name):
    import diffusers
    from accelerate import init_empty_weights
    from diffusers.models.modeling_utils import no_init_weights

    cls = getattr(diffusers, cls_name)
    with no_init_weights(), init_empty_weights():
        theirs = cls.from_config(_config(component))
    with meta_parameters():
        ours = cls.from_config(_config(component))
    a, b = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert a.keys() == b.keys() and a
    for name, p in b.items():
        assert (type(a[name]), a[name].shape, a[name].dtype, a[name].requires_grad, a[name].is_meta) == \
               (type(p), p.shape, p.dtype, p.requires_grad, True), name
    a_buf, b_buf = dict(ours.named_buffers()), dict(theirs.named_buffers())
    assert a_buf.keys() == b_buf.keys()
    for name, buf in b_buf.items():
        assert not a_buf[name].is_meta and torch.equal(a_buf[name], buf), name  # buffers stay real, computed alike
    assert str(ours) == str(theirs)


def test_other_threads_build_and_initialise_as_usual():
    torch.manual_seed(0)
    reference = nn.Linear(8, 8)
    inside, release = threading.Event(), threading.Event()
    built: dict[str, nn.Module] = {}

    def builder() -> None:
        with meta_parameters():
            built["meta"] = nn.Linear(8, 8)
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=builder)
    thread.start()
    try:
        assert inside.wait(10)
        torch.manual_seed(0)
        here = nn.Linear(8, 8)  # this thread, while the other one is inside its block
        nudged = nn.init.normal_(torch.zeros(16))
    finally:
        release.set()
        thread.join(10)
    assert not here.weight.is_meta and torch.equal(here.weight, reference.weight)
    assert torch.equal(here.bias, reference.bias)
    assert nudged.abs().sum() > 0  # initialised, not skipped
    assert built["meta"].weight.is_meta and built["meta"].bias.is_meta


def test_torch_is_restored_and_blocks_nest():
    with meta_parameters():  # the first block puts the (permanent, thread-aware) dispatchers in place
        pass
    register, normal = nn.Module.register_parameter, nn.init.normal_
    with meta_parameters():
        with meta_parameters():
            pass
        assert nn.Linear(2, 2).weight.is_meta  # still inside the outer block
        captured = nn.init.normal_  # a patched function someone kept a reference to
    assert nn.Module.register_parameter is register and nn.init.normal_ is normal
    assert not nn.Linear(2, 2).weight.is_meta
    assert captured(torch.zeros(32)).abs().sum() > 0  # outside every block it initialises


def test_no_init_skips_initialisers_only():
    with no_init():
        layer = nn.Linear(4, 4)
        t = torch.zeros(8)
        assert nn.init.normal_(t) is t and not t.any()
    assert not layer.weight.is_meta  # parameters stay where they were made


def test_torch_errors_are_unchanged_inside():
    class Clash(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.taken = 1
            self.register_parameter("taken", nn.Parameter(torch.zeros(1)))

    class Dotted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_parameter("a.b", nn.Parameter(torch.zeros(1)))

    for cls, error in ((Clash, KeyError), (Dotted, KeyError)):
        with pytest.raises(error) as outside:
            cls()
        with meta_parameters(), pytest.raises(error) as inside:
            cls()
        assert str(inside.value) == str(outside.value)


def test_parameters_of_other_kinds_are_moved_as_accelerate_does():
    class Tagged(nn.Parameter):  # as bitsandbytes' Params4bit: its attributes are its constructor's arguments
        def __new__(cls, data=None, requires_grad=True, note=None):  # noqa: ANN001, ANN204
            p = super().__new__(cls, data, requires_grad)
            p.note = note
            return p

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = Tagged(torch.ones(3), requires_grad=False, note="kept")

    with meta_parameters():
        holder = Holder()
    assert type(holder.p) is Tagged and holder.p.is_meta and holder.p.note == "kept"
    assert holder.p.requires_grad is False


def test_the_construction_budget_still_counts_every_parameter():
    stored = {"w": ("F16", (4, 4), 32)}
    with meta_parameters(), construction_budget("archive:big", "Big", stored), \
            pytest.raises(ConstructionBudgetError, match="archive:big"):
        nn.Linear(1 << 13, 1 << 13)
