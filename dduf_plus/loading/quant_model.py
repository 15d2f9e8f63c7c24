"""The skeleton every quantized loader shares (quanto in :mod:`.quant`, torchao and bitsandbytes in
:mod:`.quant_backends`, SDNQ in :mod:`.quant_sdnq`): the requested dtype, the model on the meta device within the
construction budget, the check that the stored tensors are exactly the model's, and the last steps (tie, nothing
left on meta, freeze, move). Each loader imports these from here, so that none of them imports another's
private pieces and the loaders form no circle."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import DDUFLoadError
from ..torchkit.meta_model import meta_model
from .files import ComponentFiles, tensor_metadata

if TYPE_CHECKING:  # pragma: no cover
    import torch


def torch_dtype(dtype: Any) -> torch.dtype | None:
    """``dtype`` as a ``torch.dtype`` (``"bfloat16"``, ``"torch.float16"``, a dtype); None for None or ``"auto"``."""
    import torch

    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise DDUFLoadError(f"unknown dtype {dtype!r}")
    return value


def empty_model(model_cls: type[Any], config: Mapping[str, Any], where: str, files: ComponentFiles,
                variant: str | None) -> torch.nn.Module:
    """The model on the meta device (:func:`~dduf_plus.torchkit.meta_model.meta_model`), within the
    construction budget of the tensors ``files`` stores for ``variant`` (a config asking for 3,000 layers
    over a few stored ones ran 46 s here before it was refused); a class that is neither a diffusers nor a
    transformers model is refused."""
    model = meta_model(model_cls, config, where, tensor_metadata(files, files.weight_files(variant)))
    if model is None:
        raise DDUFLoadError(f"{where}: {model_cls.__name__} is neither a diffusers nor a transformers model")
    return model


def tied_keys(model: torch.nn.Module) -> set[str]:
    """The state-dict keys the model ties to another (they may be absent from the stored tensors)."""
    tied = getattr(model, "_tied_weights_keys", None)
    if isinstance(tied, Mapping):
        return set(tied)
    return set(tied or [])


def check_state_keys(state: Mapping[str, Any], expected: set[str], model: torch.nn.Module, problem: str) -> None:
    """The stored tensors are exactly the quantized model's state-dict keys (tied ones may be absent)."""
    missing = expected - set(state) - tied_keys(model)
    unexpected = set(state) - expected
    if missing or unexpected:
        shown = ", ".join(sorted(missing)[:5]) or "-"
        extra = ", ".join(sorted(unexpected)[:5]) or "-"
        raise DDUFLoadError(f"{problem} ({len(missing)} missing: {shown}; {len(unexpected)} unexpected: {extra})")


def finish_model(model: torch.nn.Module, where: str, device: Any) -> torch.nn.Module:
    """Tie weights, check nothing is left on the meta device, freeze, move to ``device``."""
    import torch

    if tied_keys(model) and callable(tie_weights := getattr(model, "tie_weights", None)):
        tie_weights()
    on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if on_meta:
        raise DDUFLoadError(f"{where}: {len(on_meta)} tensors were not loaded (first: {on_meta[0]})")
    model.requires_grad_(False)
    model.eval()
    if device is not None and torch.device(device).type != "cpu":
        model.to(device)  # quanto moves _data/_scale and picks the device's kernels (Marlin, AWQ, ...)
    return model
