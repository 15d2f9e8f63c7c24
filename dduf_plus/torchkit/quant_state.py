"""The state diffusers' ``save_pretrained`` writes for a model its quantizer quantized, without copying it.

``ModelMixin.save_pretrained`` of a quantized model writes ``hf_quantizer.get_state_dict_and_metadata(
model.state_dict())`` with ``{"format": "pt", **metadata}`` as the safetensors ``__metadata__``. This module
gives the same tensors and metadata for :func:`~dduf_plus.packing.save.save_dduf` to stream:

* torchao: each tensor subclass (``Int8Tensor``...) flattened into ``L._weight_<part>`` tensors plus its JSON
  description, as torchao's ``flatten_tensor_state_dict`` does, but over views of the parts (torchao clones
  every part: a second copy of the quantized weights);
* bitsandbytes: ``model.state_dict()`` (packed 4-bit data + ``absmax`` / ``quant_map`` / packed
  ``quant_state``; int8 ``weight`` + ``SCB`` + ``weight_format``), except for 4-bit layers a CPU forward
  repacked (bitsandbytes' AVX512-BF16 layout: ``packing_format_for_cpu``). Those are saved in the canonical
  layout computed on the side (the live layer keeps its fast layout); see :func:`canonical_4bit`;
* SDNQ: its quantizer's own ``get_state_dict_and_metadata``, unchanged.

Other diffusers backends (its deprecated ``QuantoConfig``, GGUF...) are refused: save them with
``save_pretrained`` and pack the folder.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

import torch

from ..errors import DDUFPackError

logger = logging.getLogger(__name__)


SAVED = ("torchao", "bitsandbytes", "sdnq", "quanto")  # diffusers quant_method values save_dduf stores


def quant_method(model: Any) -> str:
    """The model's diffusers quantization method (``torchao``, ``bitsandbytes``, ``sdnq``...)."""
    method = model.hf_quantizer.quantization_config.quant_method
    return str(getattr(method, "value", method))


def backend_state(name: str, model: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, safetensors ``__metadata__``) of ``model`` exactly as diffusers' ``save_pretrained`` writes them.

    Raises:
        DDUFPackError: the quantizer cannot serialize to safetensors (diffusers' save_pretrained refuses too).
    """
    quantizer = model.hf_quantizer
    method = quant_method(model)
    if method not in SAVED:
        raise DDUFPackError(f"component {name!r} is quantized with {method}; save_dduf stores the backends "
                            f"dduf_plus records and loads ({', '.join(SAVED)}): save it with save_pretrained and "
                            "pack the folder")
    if not (_flag(quantizer, "is_serializable") and _flag(quantizer, "supports_safetensors_serialization")):
        raise DDUFPackError(f"component {name!r} is quantized with {method}, which diffusers cannot save as "
                            "safetensors (its save_pretrained refuses it too)")
    if method == "torchao":
        state, metadata = torchao_flat_state(model.state_dict())
    elif method == "bitsandbytes":
        state, metadata = bnb_state(name, model), {}
    else:  # the backend's own flattening (it may copy: small backends, no layout of ours to keep)
        state, metadata = quantizer.get_state_dict_and_metadata(model.state_dict(), safe_serialization=True)
    out = {"format": "pt", **metadata}  # diffusers' order and str() of non-strings
    return dict(state), {k: v if isinstance(v, str) else str(v) for k, v in out.items()}


def _flag(quantizer: Any, name: str) -> bool:
    """A quantizer capability: a property in diffusers' quantizers, a method in SDNQ's."""
    value = getattr(quantizer, name, False)
    return bool(value() if callable(value) else value)


def torchao_flat_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """torchao's ``flatten_tensor_state_dict`` (0.16+), same names, order and metadata, over views: no clone."""
    from torchao.prototype.safetensors.safetensors_utils import (
        ALLOWED_TENSORS_SUBCLASSES,
        TensorSubclassAttributeJSONEncoder,
    )

    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for key, tensor in state.items():
        if type(tensor).__name__ in ALLOWED_TENSORS_SUBCLASSES:
            names = [*getattr(tensor, "tensor_data_names", ()), *getattr(tensor, "optional_tensor_data_names", ())]
            stem, _, attr = key.rpartition(".")
            for part in names:
                value = getattr(tensor, part)
                if value is not None:
                    tensors[f"{stem}._{attr}_{part}"] = value.detach()
            metadata[key] = json.dumps(tensor, cls=TensorSubclassAttributeJSONEncoder)
        elif type(tensor) is torch.Tensor:
            tensors[key] = tensor
            metadata[key] = json.dumps({"_type": torch.Tensor.__name__})
        else:
            raise DDUFPackError(f"{key}: torchao cannot serialize a {type(tensor).__name__}")
    metadata["tensor_names"] = json.dumps(list(state))
    return tensors, metadata


def bnb_state(name: str, model: Any) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every CPU-repacked 4-bit layer in bitsandbytes' canonical layout.

    The live layers are left as they are: bitsandbytes' own ``_save_to_state_dict`` would undo their repack
    in place (and, for layers without double quantization, write ``absmax`` transposed in bfloat16: not a
    layout any loader reads)."""
    import bitsandbytes as bnb

    swapped: list[tuple[Any, torch.Tensor, Any]] = []
    try:
        for module in model.modules():
            weight: Any = getattr(module, "weight", None)
            state = getattr(weight, "quant_state", None)
            if isinstance(module, bnb.nn.Linear4bit) and getattr(state, "packing_format_for_cpu", False):
                data, canonical = canonical_4bit(weight.data, state)
                swapped.append((weight, weight.data, state))
                weight.data, weight.quant_state = data, canonical
        out = model.state_dict()
    finally:
        for weight, data, state in swapped:
            weight.data, weight.quant_state = data, state
    if swapped:
        logger.warning("%s: %d bitsandbytes 4-bit layers were repacked for the CPU by a forward pass; stored in "
                       "the canonical layout again, with the absmax that repack rounded to bfloat16 (save before "
                       "the first CPU forward to keep the original values)", name, len(swapped))
    return out


def canonical_4bit(data: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
    """(packed data, quant state) of a CPU-repacked 4-bit weight in bitsandbytes' canonical layout, computed on a
    copy of ``state``. The data un-shuffle is exact. ``absmax`` is what the repack kept (bfloat16, the original
    float32 values are gone), back in its canonical order and float32; with double quantization it is
    quantized again as ``quantize_4bit`` does (offset = mean, blockwise 256)."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse, quantize_blockwise

    packed_absmax = state.absmax
    nested = bool(getattr(state, "original_nested", False))
    out = copy.copy(state)
    if nested:  # bitsandbytes' inverse would quantize from the compute dtype; quantize_4bit does it in float32
        out.original_nested = False
    data, out = _convert_weight_packed_for_cpu_inverse(data, out)
    absmax = packed_absmax.T.reshape(-1).to(torch.float32)
    if nested:
        offset = absmax.mean()
        out.absmax, out.state2 = quantize_blockwise(absmax - offset, blocksize=256)
        out.offset, out.nested = offset, True
    else:
        out.absmax = absmax
    return data, out
