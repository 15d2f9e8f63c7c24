"""Components quantized by SDNQ (SD.Next's quantizer, ``quant_method: "sdnq"``), rebuilt from the archive's views.

diffusers' ``from_pretrained(folder)`` of an SDNQ model asks sdnq's own quantizer to turn the meta skeleton's
layers into ``SDNQLinear`` (...) layers whose ``weight`` / ``scale`` / ``zero_point`` are meta parameters, then
loads each stored tensor into them, casting on the way. This module does the same without a folder and
without a copy:

1. the config and tensors checked torch-free (:mod:`dduf_plus.format.quant_rules`: SDNQ's config budgets, every
   quantized weight with its scale / zero point, the scheme's storage dtype);
2. the model on the meta device, and sdnq's quantizer run on it (``preprocess_model``: the same layers, the same
   dequantizer settings diffusers gets), with the compute dtype of the stored unquantized tensors;
3. every stored tensor compared with the skeleton's (shape, and dtype for the quantized weights): a mismatch is
   refused with rule Q006 before anything is assigned;
4. ``load_state_dict(assign=True)``: the quantized weights, scales and every other tensor are views of the
   archive, kept as saved. diffusers' reload with ``torch_dtype=bfloat16`` rounds SDNQ's float32 scales
   through bfloat16 on the way (then back to float32); this loader keeps the stored scales (docs/precision.md).

sdnq is optional: without it the loader raises a :class:`~dduf_plus.errors.DDUFLoadError` naming the component,
the backend and the pip command."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import DDUFLoadError
from ..format.quant_sdnq import SDNQ_PARTS
from .files import ComponentFiles
from .quant_backends import checked_quantizer, preprocess_model, register_quantizer, require_backend
from .quant_model import check_state_keys, empty_model, finish_model, torch_dtype

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)

SDNQ_KEYS = ("weight", *SDNQ_PARTS)  # the tensors an SDNQ layer owns (sdnq.common.sdnq_keys)


def _saved_dtype(state: Mapping[str, torch.Tensor], quantized: set[str]) -> torch.dtype:
    """The dtype most stored unquantized floating tensors have (biases, norms, skipped layers): the compute
    dtype the component was saved in."""
    import torch

    counts = Counter(t.dtype for k, t in state.items() if k not in quantized and t.is_floating_point())
    return counts.most_common(1)[0][0] if counts else torch.float32


def _sdnq_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if hasattr(m, "sdnq_dequantizer")}


def check_layers(model: torch.nn.Module, state: Mapping[str, torch.Tensor], where: str) -> set[str]:
    """Q006: each SDNQ layer's stored tensors have the shapes the skeleton built (and its weight the dtype);
    returns the state keys those layers own."""
    owned: set[str] = set()
    for name, layer in _sdnq_layers(model).items():
        for key in SDNQ_KEYS:
            expected = getattr(layer, key, None)
            stored = state.get(f"{name}.{key}")
            if expected is None or stored is None or not hasattr(expected, "shape"):
                continue  # a missing or unexpected key is the state-key check's to report
            owned.add(f"{name}.{key}")
            if stored.shape != expected.shape or (key == "weight" and stored.dtype != expected.dtype):
                raise DDUFLoadError(
                    f"{where}: Q006: {name}.{key} is stored as {str(stored.dtype).removeprefix('torch.')} "
                    f"{list(stored.shape)}; the {type(layer).__name__} that SDNQ builds from this config holds "
                    f"{str(expected.dtype).removeprefix('torch.')} {list(expected.shape)}", code="Q006")
    return owned


def _cast(state: dict[str, torch.Tensor], skeleton: Mapping[str, torch.Tensor], owned: set[str],
          target: torch.dtype) -> None:
    """An explicit dtype: unquantized floating tensors take it, scales and zero points take the dtype SDNQ's
    skeleton holds for it; quantized weights (fp8 ones too) keep their stored layout."""
    for key, tensor in state.items():
        if not tensor.is_floating_point() or (key in owned and key.endswith(".weight")):
            continue
        wanted = skeleton[key].dtype if key in owned else target
        if tensor.dtype != wanted:
            state[key] = tensor.to(wanted)


def load_sdnq_component(model_cls: type[Any], config: Mapping[str, Any], files: ComponentFiles, *, device: Any = None,
                        dtype: Any = None, variant: str | None = None) -> torch.nn.Module:
    """Rebuild a component saved by diffusers' SDNQ quantizer as the modules its ``from_pretrained`` builds.

    ``dtype``: None or ``"auto"`` keeps every tensor as saved (the dequantizers compute in the dtype of the
    stored unquantized tensors); another dtype casts the unquantized floating tensors, and the scales to what
    SDNQ keeps for that dtype (float32 with ``dequantize_fp32``, its default).

    Raises:
        DDUFLoadError: sdnq missing (with the pip command), the component not self-consistent (its Q0xx rule), a
            stored tensor unlike the layer SDNQ builds (Q006), tensors missing or unexpected for the model.
    """

    where = str(getattr(files, "description", None) or getattr(files, "name", "component"))
    require_backend("sdnq", where)
    weight_files, quantizer = checked_quantizer(config, files, variant, where, "sdnq")
    state = dict(files.tensors(weight_files))
    target = torch_dtype(dtype)
    quantized = {k for k in state if k.rpartition(".")[2] in SDNQ_KEYS}
    quantizer.update_torch_dtype(target or _saved_dtype(state, quantized))
    model = empty_model(model_cls, config, where, files, variant)
    preprocess_model(quantizer, model, where)  # sdnq's own skeleton: SDNQ layers with meta weight / scale / zero_point
    owned = check_layers(model, state, where)
    check_state_keys(state, set(model.state_dict()), model, f"{where}: stored tensors do not match the "
                      f"SDNQ-quantized {model_cls.__name__}")
    if target is not None:
        _cast(state, model.state_dict(), owned, target)
    model.load_state_dict(state, strict=False, assign=True)
    register_quantizer(model, quantizer, target)  # as diffusers: requires_grad off, matmul layouts, config
    return finish_model(model, where, device)
