"""Quantized components as the format sees them: the optimum-quanto map entry and its index record,
and a config's ``quant_method``. Torch-free: packing and validation use it without the loader."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

QMAP_NAME = "quanto_qmap.json"  # optimum-quanto's module -> qtype map, beside the weights


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


def quantization_method(config: Mapping[str, Any]) -> str | None:
    """``quant_method`` of a config.json's ``quantization_config`` (diffusers/transformers), or None."""
    qc = config.get("quantization_config") if isinstance(config, Mapping) else None
    method = qc.get("quant_method") if isinstance(qc, Mapping) else None
    if method == "bitsandbytes" and isinstance(qc, Mapping):  # diffusers splits bnb by bit width
        method = "bitsandbytes_4bit" if qc.get("load_in_4bit") else "bitsandbytes_8bit"
    return method if isinstance(method, str) else None
