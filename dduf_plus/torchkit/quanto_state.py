"""Saving a module quantized with optimum-quanto: its state as plain tensors and its quantization map
(``quanto_qmap.json``), and a component folder ``dduf pack`` takes. ``save_dduf`` (:mod:`dduf_plus.packing.save`)
streams the same state into an archive; :mod:`dduf_plus.loading.quant` loads it back.

A module quantized with optimum-quanto (``quantize`` + ``freeze``) has a ``state_dict()`` of plain tensors: a
quantized weight ``W`` of a layer ``L`` is flattened into ``L.weight._data`` (int8 or float8 values; for
qint4/qint2 the packed uint8 ``L.weight._data._data``), ``L.weight._scale`` and, for qint4/qint2,
``L.weight._shift``; every quantized layer adds ``L.input_scale`` / ``L.output_scale``. optimum-quanto is
imported on first use, with the Hub off (:mod:`.backend_import`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DDUFPackError
from ..format import spec
from ..format.quantization import QMAP_NAME, QUANTO_ALIGNMENT
from ..format.weights import weights_name as default_weights_name
from ..storage.confined import Confined
from .backend_import import import_backend
from .meta_model import is_diffusers_model

if TYPE_CHECKING:  # pragma: no cover
    import torch


def aligned_order(nbytes_by_name: Mapping[str, tuple[int, int]]) -> list[str]:
    """An order for writing tensors into a safetensors file so that as many as possible start on a
    64-byte boundary of a page-aligned data section, without padding (safetensors forbids holes): tensors
    whose size is a multiple of 64 first, then the rest, each group widest element first (which keeps
    every tensor aligned to its element size). ``nbytes_by_name`` maps name -> (nbytes, element size).

    Quantized int8 weights that land misaligned must be copied at load time (quanto's CPU int8 kernel
    needs aligned data), so a writer of quanto components should use this order."""
    return sorted(nbytes_by_name, key=lambda n: (nbytes_by_name[n][0] % QUANTO_ALIGNMENT != 0,
                                                 -nbytes_by_name[n][1], n))


def quanto_state(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], bytes] | None:
    """The tensors and quantization map to store for a quanto-quantized module, or None when ``module``
    holds no quanto layer (or optimum-quanto is not installed: then nothing can be quantized).

    Every returned tensor is a plain, contiguous CPU ``torch.Tensor`` whose storage no other entry shares
    (safetensors' requirement); the names are those ``module.state_dict()`` uses, which are those
    :func:`~dduf_plus.loading.quant.load_quanto_component` expects. The map bytes are ``quanto_qmap.json``.

    Example:
        >>> quantize(pipe.unet, weights=qint8); freeze(pipe.unet)
        >>> tensors, qmap = quanto_state(pipe.unet)
        >>> tensors["conv_in.weight._data"].dtype
        torch.int8

    Raises:
        DDUFPackError: some quantized layer is not frozen (its weights are still floats: call
            ``optimum.quanto.freeze(module)`` first).
    """
    try:
        quanto = import_backend("optimum.quanto")
    except ImportError:
        return None
    import torch

    qmap = quanto.quantization_map(module)
    if not qmap:
        return None
    unfrozen = [name for name, m in module.named_modules()
                if isinstance(m, quanto.QModuleMixin) and m.weight_qtype is not None and not m.frozen]
    if unfrozen:
        raise DDUFPackError(f"{len(unfrozen)} quantized layers are not frozen (first: {unfrozen[0]!r}); call "
                            "optimum.quanto.freeze(model) before saving")
    out: dict[str, torch.Tensor] = {}
    storages: set[tuple[int, int]] = set()
    for name, value in module.state_dict().items():
        if type(value) is not torch.Tensor:  # quanto flattens its tensors; anything else is a bug upstream
            raise DDUFPackError(f"{name}: state_dict holds a {type(value).__name__}, not a plain tensor")
        tensor = value.detach().to("cpu").contiguous()
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
        if tensor.numel() and key in storages:
            tensor = tensor.clone()  # tied/shared storage: safetensors stores each tensor once
        storages.add((tensor.untyped_storage().data_ptr(), int(tensor.storage_offset())))
        out[name] = tensor
    return out, (json.dumps(qmap, indent=4, sort_keys=True) + "\n").encode()


def save_quanto_component(module: torch.nn.Module, folder: str | os.PathLike, *,
                          weights_name: str | None = None) -> Path:
    """Write a frozen quanto-quantized model as a component folder ``dduf pack`` takes: its config
    (``save_config`` / ``config.save_pretrained``), one safetensors file with the tensors in
    :func:`aligned_order` (so no quantized weight needs a copy at load) and ``quanto_qmap.json``.

    Example:
        >>> quantize(pipe.unet, weights=qint8); freeze(pipe.unet)
        >>> pipe.save_pretrained("sd-q8")             # the other components, as usual
        >>> save_quanto_component(pipe.unet, "sd-q8/unet")
        >>> # dduf pack sd-q8 -o sd-q8.dduf

    Raises:
        DDUFPackError: ``module`` holds no quanto layer, or one that is not frozen.
    """
    import torch

    folder = Path(folder).absolute()  # Confined resolves a relative path against its root: anchor it here
    state = quanto_state(module)
    if state is None:
        raise DDUFPackError(f"{type(module).__name__} holds no optimum-quanto layer (quantize + freeze it first)")
    tensors, qmap = state
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.safetensors*"):
        old.unlink()  # a previous (unquantized) save's shards would be picked up as weights
    config = getattr(module, "config", None)
    if callable(save_config := getattr(module, "save_config", None)):  # diffusers ModelMixin
        save_config(folder)
    elif config is not None and hasattr(config, "save_pretrained"):  # transformers PreTrainedModel
        config.save_pretrained(folder)
    name = weights_name or default_weights_name("diffusers" if is_diffusers_model(type(module)) else "transformers")
    order = aligned_order({k: (t.nbytes, t.element_size()) for k, t in tensors.items()})
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    position = 0
    for key in order:
        t = tensors[key]
        dtype = spec.DTYPE_BY_TORCH[str(t.dtype).removeprefix("torch.")].safetensors
        header[key] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [position, position + t.nbytes]}
        position += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with Confined(folder).atomic(folder / name, fsync=False, mode=0o644) as out:  # exclusive temp, then rename
        out.file.write(len(raw).to_bytes(8, "little") + raw)
        for key in order:  # little-endian hosts, as safetensors requires
            out.file.write(tensors[key].reshape(-1).view(torch.uint8).numpy().data)
    Confined(folder).write_bytes(folder / QMAP_NAME, qmap, mode=0o644)
    return folder
