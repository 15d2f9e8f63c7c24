"""safetensors bytes of in-memory tensors, streamed: the header computed from names, dtypes and shapes, then
every tensor's bytes handed to the writer as a view of the tensor itself (a converted copy of ONE tensor when a
dtype rule changes it). Byte-identical to ``safetensors.torch.save``. Used by ``save_dduf`` and by pack-time
quantization (:mod:`dduf_plus.packing.quantize`); imports torch, so it is imported lazily."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..errors import DDUFPackError
from ..format import spec
from ..format.pack import EntrySource
from ..format.safetensors_header import parse_header

PIECE_BYTES = 64 << 20  # big tensors are handed to the writer in slices: smooth progress, same bytes

# safetensors sorts tensors by dtype (descending, in the order of its Rust ``Dtype`` enum) then by name.
# Measured from safetensors 0.8's output; tests/test_save.py checks it against ``safetensors.torch.save``.
_SAFETENSORS_DTYPE_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
                            "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64")
_DTYPE_RANK = {name: rank for rank, name in enumerate(_SAFETENSORS_DTYPE_ORDER)}
DtypeRule = Callable[[str, torch.Tensor], "torch.dtype | None"]  # (tensor name, tensor) -> dtype to store


def tensor_source(
    entry: str,
    state: Mapping[str, torch.Tensor],
    *,
    dtype_for: DtypeRule | None = None,
    metadata: Mapping[str, str] | None = None,
    what: str = "",
    order: Sequence[str] | None = None,
) -> EntrySource:
    """An :class:`EntrySource` whose chunks are a safetensors file of ``state``, byte-identical to
    ``safetensors.torch.save(state, metadata)``, produced tensor by tensor without a full copy.

    ``order`` (every name of ``state``) lays the tensors out in that order instead of safetensors' own.
    """
    dtype_for = dtype_for or (lambda name, tensor: None)
    metadata = {"format": "pt"} if metadata is None else dict(metadata)
    plan: list[tuple[str, torch.Tensor, torch.dtype]] = []
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise DDUFPackError(f"{what}: state dict entry {name!r} is not a tensor")
        plan.append((name, tensor, dtype_for(name, tensor) or tensor.dtype))
    if order is not None:
        for _name, _tensor, target in plan:
            _st_dtype(target, what)
        rank = {name: i for i, name in enumerate(order)}
        plan.sort(key=lambda p: rank[p[0]])
    else:
        plan.sort(key=lambda p: (-_DTYPE_RANK[_st_dtype(p[2], what)], p[0]))
    raw, data_size = _header_json(plan, metadata)
    size = 8 + len(raw) + data_size
    header, problems = parse_header(raw, len(raw), size, entry)
    errors = [p for p in problems if p.severity == "error"]
    if header is None or errors:  # our own bug, not the user's: say so plainly
        raise DDUFPackError(f"{entry}: computed safetensors header is invalid: {(errors or problems)[0]}")

    def chunks() -> Iterator[Any]:
        yield len(raw).to_bytes(8, "little") + raw
        for _name, tensor, target in plan:
            yield from tensor_bytes(tensor, target)

    return EntrySource(entry, size=size, chunks=chunks, header=header)


def _st_dtype(dtype: torch.dtype, what: str) -> str:
    name = str(dtype).removeprefix("torch.")
    info = spec.DTYPE_BY_TORCH.get(name)
    if info is None or info.safetensors not in _DTYPE_RANK:
        raise DDUFPackError(f"{what}: dtype {name} cannot be stored in safetensors")
    return info.safetensors


def _header_json(plan: list[tuple[str, torch.Tensor, torch.dtype]], metadata: Mapping[str, str]) -> tuple[bytes, int]:
    header: dict[str, Any] = {spec.SAFETENSORS_METADATA_KEY: dict(metadata)} if metadata else {}
    offset = 0
    for name, tensor, target in plan:
        nbytes = tensor.numel() * torch.empty((), dtype=target).element_size()
        header[name] = {"dtype": _st_dtype(target, name), "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes with spaces
    return raw, offset


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> Iterator[memoryview]:
    """The little-endian bytes of ``tensor`` (converted to ``dtype``), as views: of the tensor itself
    when it is a contiguous CPU tensor of that dtype, else of one converted / moved copy of it."""
    t = tensor.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)  # on the tensor's own device: a GPU converts faster than the CPU
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return
    if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian
        raise DDUFPackError("save_dduf needs a little-endian host")
    # uint8 view: bf16/fp8 have no numpy dtype, and bytes are bytes.
    flat = memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only on Python >= 3.12
    for at in range(0, len(flat), PIECE_BYTES):
        yield flat[at : at + PIECE_BYTES]

