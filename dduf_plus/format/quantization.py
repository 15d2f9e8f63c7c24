"""Quantized components as the format sees them, backend by backend's common ground: what a config's
``quantization_config`` says (:func:`backend_of`), the error every Q0xx check raises, and optimum-quanto's map
entry, index record and alignment rule. Torch-free: packing, validation and the loaders share it. The per-backend
layouts are in :mod:`.quant_torchao`, :mod:`.quant_bnb` and :mod:`.quant_sdnq`; :mod:`.quant_rules` runs them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .findings import Finding, finding
from .safetensors_header import TensorInfo

QMAP_NAME = "quanto_qmap.json"  # optimum-quanto's module -> qtype map, beside the weights
SCALE_DTYPES = frozenset({"float32", "float16", "bfloat16"})  # what the backends store scales in


class QuantError(ValueError):
    """A quantized component that is not self-consistent: ``code`` is its Q0xx rule."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def quantization_config(config: Any) -> Mapping[str, Any] | None:
    qc = config.get("quantization_config") if isinstance(config, Mapping) else None
    return qc if isinstance(qc, Mapping) else None


def backend_of(config: Any) -> str | None:
    """``torchao``, ``bitsandbytes_4bit``, ``bitsandbytes_8bit``, another ``quant_method``, or None."""
    qc = quantization_config(config)
    method = qc.get("quant_method") if qc is not None else None
    if method == "bitsandbytes" and qc is not None:
        return "bitsandbytes_4bit" if qc.get("load_in_4bit") else "bitsandbytes_8bit"
    return method if isinstance(method, str) else None



def quanto_index_record(qmap: Mapping[str, Any]) -> dict[str, Any]:
    """The extra index record of a quanto component (for ``write_archive(extra_components=...)``): the
    map's entry name and which qtypes it uses. Torch-free.

    Example:
        >>> quanto_index_record({"conv_in": {"weights": "qint8", "activations": "none"}})
        {'quantization': {'method': 'optimum-quanto', 'map': 'quanto_qmap.json', 'modules': 1, 'weights': ['qint8'], 'activations': []}}
    """
    weights = sorted({str(v.get("weights")) for v in qmap.values() if isinstance(v, dict)} - {"none", "None"})
    acts = sorted({str(v.get("activations")) for v in qmap.values() if isinstance(v, dict)} - {"none", "None"})
    return {"quantization": {"method": "optimum-quanto", "map": QMAP_NAME, "modules": len(qmap),
                             "weights": weights, "activations": acts}}


# --- optimum-quanto's alignment ------------------------------------------------------------------------------
QUANTO_ALIGNMENT = 64  # bytes; quanto's bf16 CPU int8 kernel (torch._weight_int8pack_mm) needs 16, AVX-512 paths 64


def quanto_unaligned(tensors: Iterable[tuple[TensorInfo, int]]) -> list[TensorInfo]:
    """The int8 quantized weights (``*._data``) of an optimum-quanto component that start off a
    :data:`QUANTO_ALIGNMENT` boundary, from (tensor, absolute start: entry data offset + data section + begin).

    quanto's bf16 CPU kernel crashes (SIGSEGV) on int8 data that is not 16-byte aligned, and which kernel runs
    depends on the dtype the model runs in (a cast after loading too), not on the file: the loader copies every
    tensor listed here, and validate says so (Q008) from the same list."""
    return [t for t, start in tensors if t.dtype == "int8" and t.name.endswith("._data") and start % QUANTO_ALIGNMENT]


def unaligned_finding(component: str, unaligned: list[TensorInfo]) -> Finding:
    """Q008: the quanto int8 weights the loader will copy (one finding per component)."""
    more = f" and {len(unaligned) - 1} more" if len(unaligned) > 1 else ""
    return finding("Q008", component, f"optimum-quanto int8 weight {unaligned[0].name}{more} not "
                   f"{QUANTO_ALIGNMENT}-byte aligned: the loader copies them ({sum(t.nbytes for t in unaligned)} bytes)")

