"""dduf_plus.torchkit.meta_model: the one meta-device model builder behind dtype conversion and quanto loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextModel

from dduf_plus.errors import DDUFLoadError
from dduf_plus.torchkit.meta_model import is_diffusers_model, meta_model

TINY_SD = Path(__file__).resolve().parent.parent / "fixtures" / "pipelines" / "tiny-sd"


def _config(component: str) -> dict:
    return json.loads((TINY_SD / component / "config.json").read_text())


def _stored(component: str) -> dict:
    """The tensors the fixture stores for ``component``: the construction budget meta_model builds within."""
    from safetensors import safe_open

    out = {}
    for path in sorted((TINY_SD / component).glob("*.safetensors")):
        if ".fp16." in path.name:
            continue
        with safe_open(path, "pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                out[name] = (str(s.get_dtype()), tuple(s.get_shape()), 0)
    return out


@pytest.mark.parametrize(("cls", "component"), [(AutoencoderKL, "vae"), (CLIPTextModel, "text_encoder")])
def test_parameters_on_meta_buffers_real(cls, component):
    config = _config(component)
    config["quantization_config"] = {"quant_method": "quanto", "weights_dtype": "int8"}  # dropped, not applied
    model = meta_model(cls, config, f"tiny-sd/{component}", _stored(component))
    assert isinstance(model, cls)
    params = list(model.parameters())
    assert params and all(p.is_meta for p in params)
    assert all(not b.is_meta for b in model.buffers())  # non-persistent buffers (position ids) must exist
    assert is_diffusers_model(cls) == (cls is AutoencoderKL)


def test_other_classes_give_none_and_bad_configs_name_the_component():
    assert meta_model(torch.nn.Linear, {}, "x", {}) is None
    assert not is_diffusers_model(torch.nn.Linear) and not is_diffusers_model(None)
    with pytest.raises(DDUFLoadError, match=r"tiny-sd/vae: cannot build AutoencoderKL from its config"):
        meta_model(AutoencoderKL, {**_config("vae"), "block_out_channels": "not a list"}, "tiny-sd/vae", _stored("vae"))
