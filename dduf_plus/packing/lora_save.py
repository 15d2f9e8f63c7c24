"""A live pipeline's LoRA adapters, as ``save_dduf`` writes them: peft's wrapped layers seen as their base model
saved them (content comparison with BASE sees BASE's tensors), and each active adapter serialised in memory as
diffusers' ``save_lora_weights`` would write it, with the weight ``set_adapters`` gave it (docs/lora.md)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import DDUFPackError
from ..format.lora import LORA_METADATA_KEY

logger = logging.getLogger(__name__)


_PEFT_MARKS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def without_adapters(state: Mapping[str, Any]) -> dict[str, Any]:
    """A model's state dict as it was before peft wrapped its layers: LoRA tensors dropped, ``.base_layer.``
    names restored (what BASE's files hold, so that content comparison sees BASE's tensors)."""
    if not any(".base_layer." in k for k in state):
        return dict(state)
    return {k.replace(".base_layer.", "."): v for k, v in state.items() if not any(m in k for m in _PEFT_MARKS)}


def _adapter_weight(module: Any, name: str) -> float | None:
    """The weight ``set_adapters`` gave adapter ``name`` on ``module``: peft keeps it in each layer's scaling
    (weight x alpha / r, or / sqrt(r) with rsLoRA)."""
    for layer in module.modules():
        scaling = getattr(layer, "scaling", None)
        if isinstance(scaling, dict) and name in scaling and name in getattr(layer, "r", {}):
            r, alpha = layer.r[name], layer.lora_alpha[name]
            rs = getattr(layer, "use_rslora", {})
            unit = alpha / (r ** 0.5) if isinstance(rs, dict) and rs.get(name) else alpha / r
            return float(scaling[name]) / unit if unit else None
    return None


class SavedAdapter:
    """One adapter of a live pipeline, as the LoRA file diffusers' ``save_lora_weights`` would write."""

    def __init__(self, name: str, data: bytes, weight: float, components: list[str]):
        self.name, self.data, self.weight, self.components = name, data, weight, components


def pipeline_adapters(pipe: Any, components: Iterable[str]) -> list[SavedAdapter]:
    """The active LoRA adapters peft holds on ``pipe``'s ``components``, each serialised in memory as
    ``save_lora_weights`` writes it (``<component>.<module>.lora_A.weight`` names, the peft config under
    ``lora_adapter_metadata``), with the weight ``set_adapters`` gave it. Adapters loaded but not active are
    left out (and said)."""
    found: dict[str, dict[str, Any]] = {}
    for component in components:
        module = getattr(pipe, component, None)
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict):
            for name in configs:
                found.setdefault(name, {})[component] = module
    if not found:
        return []
    active = set(pipe.get_active_adapters()) if hasattr(pipe, "get_active_adapters") else set(found)
    inactive = sorted(set(found) - active)
    if inactive:
        logger.info("save_dduf: adapters %s are loaded but not active: not saved", ", ".join(inactive))
    return [_saved_adapter(name, found[name]) for name in found if name in active]  # in load order: sums agree


def _saved_adapter(name: str, modules: Mapping[str, Any]) -> SavedAdapter:
    try:
        from peft.utils import get_peft_model_state_dict
    except ImportError as e:  # peft is the lora extra: a pipeline with adapters was built with it
        raise DDUFPackError(f"saving LoRA adapter {name!r} needs peft: pip install 'dduf_plus[lora]'") from e
    from safetensors.torch import save

    state: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    weight: float | None = None
    for component, module in sorted(modules.items()):
        layers = get_peft_model_state_dict(module, adapter_name=name)
        state.update({f"{component}.{k}": v.detach().contiguous() for k, v in layers.items()})
        config = module.peft_config[name].to_dict()
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
        metadata.update({f"{component}.{k}": v for k, v in config.items()})
        if weight is None or component in ("unet", "transformer"):
            weight = _adapter_weight(module, name) or weight
    header = {"format": "pt", LORA_METADATA_KEY: adapter_metadata_json(metadata)}
    return SavedAdapter(name, save(state, metadata=header), round(weight if weight is not None else 1.0, 6),
                        sorted(modules))


def adapter_metadata_json(metadata: Mapping[str, Any]) -> str:
    """diffusers' serialisation of adapter metadata (sorted keys, indent 2), for writing LoRA files."""
    return json.dumps(dict(metadata), indent=2, sort_keys=True)
