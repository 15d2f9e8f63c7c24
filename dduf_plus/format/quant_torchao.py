"""torchao components as diffusers 0.42 / torchao 0.18 save them, read from safetensors headers (torch-free).

* torchao: a quantized ``L.weight`` is flattened into ``L._weight_<part>`` tensors (``Int8Tensor``:
  ``qdata`` int8 ``[N, K]``, ``scale`` ``[N, 1]``, ``zero_point`` ``[N, 1]``); ``__metadata__["tensor_names"]``
  lists every state key and ``__metadata__[key]`` describes it (``{"_type": "Int8Tensor", "_data": {...},
  "_tensor_data_names": [...]}`` or ``{"_type": "Tensor"}``).

torchao parses the JSON description of each tensor from ``__metadata__`` and instantiates the classes it names:
:func:`torchao_descriptions` bounds and checks it (sizes, depth, class names, dtype names) before any loader
hands it to torchao."""

from __future__ import annotations

import json
from collections.abc import Mapping
from math import prod
from typing import Any

from .quantization import SCALE_DTYPES, QuantError
from .safetensors_header import TensorInfo

# torchao's allow-list (torchao/prototype/safetensors/safetensors_utils.py, 0.18): the classes its loader
# instantiates from __metadata__. A name outside it is refused here before torchao ever sees it.
TORCHAO_TENSOR_TYPES = frozenset({"Float8Tensor", "Int4Tensor", "Int4TilePackedTo4dTensor", "IntxUnpackedToInt8Tensor",
                                  "Int8Tensor", "Int4PlainInt32Tensor", "MXTensor", "NVFP4Tensor"})
TORCHAO_CLASSES = TORCHAO_TENSOR_TYPES | {"Float8MMConfig", "QuantizeTensorToFloat8Kwargs", "QuantizeTensorToInt8Kwargs",
                                          "PerRow", "PerTensor", "KernelPreference", "MappingType",
                                          "QuantizeTensorToMXKwargs", "ScaleCalculationMode",
                                          "QuantizeTensorToNVFP4Kwargs", "torch.dtype", "Tensor"}
TORCH_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64",
                          "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float4_e2m1fn_x2",
                          "float8_e8m0fnu", "bool", "uint16", "uint32", "uint64",
                          *(f"{u}int{bits}" for u in ("", "u") for bits in range(1, 8))})  # sub-byte: Intx weights
MAX_DESCRIPTION_BYTES = 16 * 1024  # one tensor's JSON description (a real Int8Tensor's is ~250 bytes)
MAX_DESCRIPTION_DEPTH = 6  # real ones nest 4 deep ({"_data": {"dtype": {"_data": ...}}})


def _check_node(value: Any, depth: int, key: str) -> None:
    if depth > MAX_DESCRIPTION_DEPTH:
        raise QuantError("Q005", f"{key}: description nests deeper than {MAX_DESCRIPTION_DEPTH}")
    if isinstance(value, list):
        for item in value:
            _check_node(item, depth + 1, key)
    elif isinstance(value, dict):
        kind = value.get("_type")
        if kind is not None and not (isinstance(kind, str) and kind in TORCHAO_CLASSES):  # a list is unhashable
            raise QuantError("Q005", f"{key}: names class {str(kind)[:80]!r}, outside torchao's allow-list")
        if kind == "torch.dtype" and not (isinstance(value.get("_data"), str) and value["_data"] in TORCH_DTYPES):
            raise QuantError("Q005", f"{key}: dtype {str(value.get('_data'))[:80]!r} is not a torch dtype")
        data = value.get("_data")
        if kind in ("PerRow", "PerTensor") and not (data is None or isinstance(data, dict) and all(
                type(v) is int and abs(v) < 64 for v in data.values())):  # PerRow(dim: int): a dimension index
            raise QuantError("Q005", f"{key}: {kind} {str(data)[:40]} is not a dimension index")
        if kind is not None and isinstance(value.get("_data"), str) and value["_data"].startswith("_"):
            # torchao looks enum members up by this name (getattr): no dunder or private attribute
            raise QuantError("Q005", f"{key}: {kind} value {value['_data'][:80]!r} is not a member name")
        for item in value.values():
            _check_node(item, depth + 1, key)


def torchao_descriptions(metadata: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """The per-tensor descriptions of torchao's ``__metadata__`` (``tensor_names`` + one JSON per name),
    checked: each within :data:`MAX_DESCRIPTION_BYTES` and :data:`MAX_DESCRIPTION_DEPTH`, naming only
    torchao's allowed classes and real dtype names, ``_tensor_data_names`` a list of identifiers.

    Raises:
        QuantError: ``Q005`` with what is wrong.
    """
    raw_names = metadata.get("tensor_names")
    try:
        names = json.loads(raw_names) if isinstance(raw_names, str) else None
    except ValueError:
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise QuantError("Q005", "__metadata__['tensor_names'] is not a JSON list of names")
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        text = metadata.get(name)
        if not isinstance(text, str):
            raise QuantError("Q005", f"{name}: listed in tensor_names but has no description")
        if len(text) > MAX_DESCRIPTION_BYTES:
            raise QuantError("Q005", f"{name}: description of {len(text)} bytes (over {MAX_DESCRIPTION_BYTES})")
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            raise QuantError("Q005", f"{name}: description is not JSON") from None
        if not isinstance(value, dict) or not isinstance(value.get("_type"), str):
            raise QuantError("Q005", f"{name}: description is not an object with a '_type'")
        if value["_type"] != "Tensor" and not isinstance(value.get("_data", {}), dict):
            # a tensor subclass's fields (block_size, dtype, act_quant_kwargs): torchao builds it with **_data
            raise QuantError("Q005", f"{name}: {value['_type']}'s '_data' is not an object of its fields")
        _check_node(value, 0, name)
        parts = value.get("_tensor_data_names", [])
        if value["_type"] != "Tensor" and (not isinstance(parts, list) or not parts
                                            or not all(isinstance(p, str) and p.isidentifier()
                                                       and not p.startswith("_") for p in parts)):  # no dunder
            raise QuantError("Q005", f"{name}: '_tensor_data_names' is not a list of names")
        out[name] = value
    return out


def torchao_groups(descriptions: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """{quantized state key: {part: stored tensor name}}: ``L.weight`` -> ``{"qdata": "L._weight_qdata", ...}``."""
    groups: dict[str, dict[str, str]] = {}
    for name, value in descriptions.items():
        if value.get("_type") == "Tensor":
            continue
        module, _, attr = name.rpartition(".")
        prefix = f"{module}._{attr}_" if module else f"_{attr}_"
        groups[name] = {part: prefix + part for part in value.get("_tensor_data_names", [])}
    return groups


FLOAT8_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})
# the types whose parts these rules fit (others: torchao's own); IntxUnpackedToInt8Tensor (IntxWeightOnlyConfig,
# int1..int8 values kept one per int8) has Int8Tensor's layout: qdata [N, K], scale / zero_point the block grid
CHECKED_TYPES = ("Int8Tensor", "IntxUnpackedToInt8Tensor", "Float8Tensor")


def check_torchao_float8(name: str, parts: Mapping[str, TensorInfo]) -> None:
    """Float8Tensor: float8 ``qdata`` [N, K] and a float ``scale`` (its block grid: :func:`check_torchao_block_size`).
    torchao dequantizes ``qdata.to(dtype) * scale`` by broadcasting: int8 bytes taken as float8 values, or one
    scale row spread over every output, load and run as another model."""
    qdata, scale = parts.get("qdata"), parts.get("scale")
    if qdata is None or qdata.dtype not in FLOAT8_DTYPES or len(qdata.shape) != 2:
        raise QuantError("Q003", f"{name}: Float8Tensor qdata must be a float8 matrix, not "
                         f"{qdata.dtype if qdata else None} {list(qdata.shape)[:4] if qdata else []}")
    if scale is None or scale.dtype not in SCALE_DTYPES:
        raise QuantError("Q003", f"{name}: Float8Tensor scale must be float32, float16 or bfloat16")


def check_torchao_parts(name: str, description: Mapping[str, Any], parts: Mapping[str, TensorInfo]) -> None:
    """The parts of a quantized weight of a type in :data:`CHECKED_TYPES` fit as torchao computes with them."""
    if description["_type"] in ("Int8Tensor", "IntxUnpackedToInt8Tensor"):
        check_torchao_int8(name, parts)
    elif description["_type"] == "Float8Tensor":
        check_torchao_float8(name, parts)
    else:
        return
    check_torchao_block_size(name, description, parts)
    dtype = (description.get("_data") or {}).get("dtype")  # the weight's own dtype: what it dequantizes to
    if isinstance(dtype, Mapping) and not (isinstance(dtype.get("_data"), str)
                                           and dtype["_data"] in SCALE_DTYPES | {"float64"}):
        raise QuantError("Q005", f"{name}: {description['_type']} dtype {str(dtype.get('_data'))[:20]!r} is not a "
                         "floating dtype (load_state_dict fails on it)")


def check_torchao_int8(name: str, parts: Mapping[str, TensorInfo]) -> None:
    """Int8Tensor: int8 ``qdata`` [N, K]; ``scale`` and ``zero_point`` with one row per output and
    as many columns as there are blocks along K."""
    qdata = parts.get("qdata")
    if qdata is None or qdata.dtype != "int8" or len(qdata.shape) != 2:
        raise QuantError("Q003", f"{name}: qdata must be an int8 matrix, not {qdata.dtype if qdata else None} "
                         f"{list(qdata.shape)[:4] if qdata else []}")
    for part in ("scale", "zero_point"):
        t = parts.get(part)
        if t is None:
            continue
        if len(t.shape) != 2 or t.shape[0] != qdata.shape[0] or t.shape[1] < 1 or qdata.shape[1] % t.shape[1]:
            raise QuantError("Q003", f"{name}: {part} {list(t.shape)} does not fit qdata {list(qdata.shape)}")
        wanted = SCALE_DTYPES if part == "scale" else SCALE_DTYPES | {"int8"}
        if t.dtype not in wanted:
            raise QuantError("Q003", f"{name}: {part} is {t.dtype}")


def check_torchao_block_size(name: str, description: Mapping[str, Any], parts: Mapping[str, TensorInfo]) -> None:
    """Q007: Int8Tensor's ``block_size`` (from the description) is what torchao computes with: per-row when it
    spans K (``y = x @ qdata.T * scale.flatten()``), else per-group (dequantize_affine views qdata in blocks of
    it against scale / zero_point). It must tile qdata exactly, into scale's grid; otherwise the forward
    fails or, worse, broadcasts a scale over the wrong rows."""
    qdata, block = parts["qdata"], (description.get("_data") or {}).get("block_size")
    if not isinstance(block, list) or len(block) != len(qdata.shape) \
            or not all(type(b) is int and b > 0 for b in block):
        raise QuantError("Q007", f"{name}: block_size {str(block)[:40]} is not {len(qdata.shape)} positive integers")
    if any(n % b for n, b in zip(qdata.shape, block, strict=True)):
        raise QuantError("Q007", f"{name}: block_size {block} does not tile qdata {list(qdata.shape)}")
    grid = tuple(n // b for n, b in zip(qdata.shape, block, strict=True))
    for part in ("scale", "zero_point"):
        t = parts.get(part)
        if t is not None and t.shape != grid and not (prod(grid) == 1 and prod(t.shape) == 1):  # per tensor: [] too
            raise QuantError("Q007", f"{name}: {part} {list(t.shape)} is not the block grid {list(grid)} of qdata "
                             f"{list(qdata.shape)} in blocks of {block}")

