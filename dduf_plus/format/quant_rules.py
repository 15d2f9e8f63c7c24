"""Quantized components saved by diffusers' quantizers (torchao, bitsandbytes), as the format sees them:
which stored tensors are quantized data and which are scales, the index record that says so, and the Q0xx
rules that check a component is self-consistent without importing its backend.

Everything here reads only a component's ``config.json`` (its ``quantization_config``) and its safetensors
headers (names, dtypes, shapes, ``__metadata__``): torch-free, like the rest of the format layer. The
backend's own metadata is hostile input: torchao parses a JSON description per tensor from the safetensors
``__metadata__`` and instantiates classes it names, so :func:`torchao_descriptions` bounds and checks it
(sizes, depth, class names, dtype names) before any loader hands it to torchao.

Layouts (diffusers 0.42 / torchao 0.18 / bitsandbytes 0.50):

* torchao: a quantized ``L.weight`` is flattened into ``L._weight_<part>`` tensors (``Int8Tensor``:
  ``qdata`` int8 ``[N, K]``, ``scale`` ``[N, 1]``, ``zero_point`` ``[N, 1]``); ``__metadata__["tensor_names"]``
  lists every state key and ``__metadata__[key]`` describes it (``{"_type": "Int8Tensor", "_data": {...},
  "_tensor_data_names": [...]}`` or ``{"_type": "Tensor"}``).
* bitsandbytes 4-bit: ``L.weight`` packed uint8 ``[ceil(N*K/2), 1]``, ``L.weight.absmax`` float32,
  ``L.weight.quant_map`` float32 ``[16]``, ``L.weight.quant_state.bitsandbytes__<nf4|fp4>`` packed uint8
  (a small JSON the backend parses), and with double quantization ``nested_absmax`` / ``nested_quant_map``.
* bitsandbytes 8-bit: ``L.weight`` int8 ``[N, K]``, ``L.SCB`` float32 ``[N]``, ``L.weight_format`` uint8.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from math import prod
from typing import Any

from .findings import Finding, finding
from .safetensors_header import SafetensorsHeader, TensorInfo

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
                          "float8_e8m0fnu", "bool"})
MAX_DESCRIPTION_BYTES = 16 * 1024  # one tensor's JSON description (a real Int8Tensor's is ~250 bytes)
MAX_DESCRIPTION_DEPTH = 6  # real ones nest 4 deep ({"_data": {"dtype": {"_data": ...}}})
MAX_QUANT_STATE_BYTES = 4096  # bitsandbytes' packed quant_state JSON (a real one is ~150 bytes)
BNB_BLOCKSIZES = frozenset({32, 64, 128, 256, 512, 1024, 2048, 4096})  # what bitsandbytes quantizes with
BNB_4BIT_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_SCALE_DTYPES = frozenset({"float32", "float16", "bfloat16"})
_CAMEL = re.compile(r"(?<!^)(?=[A-Z][a-z])")


class QuantError(ValueError):
    """A quantized component that is not self-consistent: ``code`` is its Q0xx rule."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


# --- what a config says ------------------------------------------------------------------------------
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


def scheme_of(config: Any) -> str | None:
    """The scheme in the backend's own words: ``int8_weight_only`` (torchao ``Int8WeightOnlyConfig``),
    ``nf4`` / ``fp4`` (bitsandbytes 4-bit), ``int8`` (bitsandbytes 8-bit); None when the config names none."""
    qc = quantization_config(config) or {}
    backend = backend_of(config)
    if backend == "torchao":
        kind = qc.get("quant_type")
        if isinstance(kind, Mapping):  # serialized AOBaseConfig: {"default": {"_type": "Int8WeightOnlyConfig"}}
            kind = kind.get("default", kind)
            kind = kind.get("_type") if isinstance(kind, Mapping) else None
        if not isinstance(kind, str):
            return None
        return _CAMEL.sub("_", kind.removesuffix("Config")).lower() if kind[:1].isupper() else kind
    if backend == "bitsandbytes_4bit":
        kind = qc.get("bnb_4bit_quant_type", "fp4")
        return kind if isinstance(kind, str) else None
    if backend == "bitsandbytes_8bit":
        return "int8"
    return None


# --- torchao's __metadata__ ----------------------------------------------------------------------------
def _check_node(value: Any, depth: int, key: str) -> None:
    if depth > MAX_DESCRIPTION_DEPTH:
        raise QuantError("Q005", f"{key}: description nests deeper than {MAX_DESCRIPTION_DEPTH}")
    if isinstance(value, list):
        for item in value:
            _check_node(item, depth + 1, key)
    elif isinstance(value, dict):
        kind = value.get("_type")
        if kind is not None and kind not in TORCHAO_CLASSES:
            raise QuantError("Q005", f"{key}: names class {str(kind)[:80]!r}, outside torchao's allow-list")
        if kind == "torch.dtype" and value.get("_data") not in TORCH_DTYPES:
            raise QuantError("Q005", f"{key}: dtype {str(value.get('_data'))[:80]!r} is not a torch dtype")
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
        _check_node(value, 0, name)
        parts = value.get("_tensor_data_names", [])
        if value["_type"] != "Tensor" and (not isinstance(parts, list) or not parts
                                            or not all(isinstance(p, str) and p.isidentifier() for p in parts)):
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


def _check_torchao_int8(name: str, parts: Mapping[str, TensorInfo]) -> None:
    """Int8Tensor: int8 ``qdata`` [N, K]; ``scale`` and ``zero_point`` with one row per output and
    as many columns as there are blocks along K."""
    qdata = parts.get("qdata")
    if qdata is None or qdata.dtype != "int8" or len(qdata.shape) != 2:
        raise QuantError("Q003", f"{name}: Int8Tensor qdata must be an int8 matrix")
    for part in ("scale", "zero_point"):
        t = parts.get(part)
        if t is None:
            continue
        if len(t.shape) != 2 or t.shape[0] != qdata.shape[0] or t.shape[1] < 1 or qdata.shape[1] % t.shape[1]:
            raise QuantError("Q003", f"{name}: {part} {list(t.shape)} does not fit qdata {list(qdata.shape)}")
        wanted = _SCALE_DTYPES if part == "scale" else _SCALE_DTYPES | {"int8"}
        if t.dtype not in wanted:
            raise QuantError("Q003", f"{name}: {part} is {t.dtype}")


# --- bitsandbytes ------------------------------------------------------------------------------------
def bnb_groups(tensors: Mapping[str, TensorInfo], backend: str) -> dict[str, dict[str, str]]:
    """{quantized weight: {part: stored tensor name}} from the names bitsandbytes gives its state."""
    groups: dict[str, dict[str, str]] = {}
    if backend == "bitsandbytes_4bit":
        for name in tensors:
            head, marker, tail = name.partition(".quant_state.bitsandbytes__")
            if marker:
                parts = {"data": head, "quant_state": name}
                parts.update({p: f"{head}.{p}" for p in BNB_4BIT_PARTS if f"{head}.{p}" in tensors})
                groups[head] = parts
    else:
        for name in tensors:  # a layer is quantized when it stores either of its 8-bit parts
            module = name.removesuffix(".SCB").removesuffix(".weight_format")
            if module != name:
                groups[f"{module}.weight"] = {"data": f"{module}.weight", "SCB": f"{module}.SCB",
                                             "weight_format": f"{module}.weight_format"}
    return groups


def _check_bnb(name: str, parts: Mapping[str, TensorInfo], backend: str, scheme: str | None) -> None:
    data = parts.get("data")
    if backend == "bitsandbytes_8bit":
        scb = parts.get("SCB")
        if data is None or data.dtype != "int8" or len(data.shape) != 2:
            raise QuantError("Q003", f"{name}: an 8-bit weight must be an int8 matrix")
        if scb is None or scb.dtype != "float32" or scb.shape != (data.shape[0],):
            raise QuantError("Q003", f"{name}: SCB must be float32 [{data.shape[0]}]")
        return
    state = next(p for k, p in parts.items() if k == "quant_state")
    kind = state.name.rsplit("bitsandbytes__", 1)[-1]
    if scheme is not None and kind != scheme:
        raise QuantError("Q004", f"{name}: quant_state says {kind!r}, the config says {scheme!r}")
    if data is None or data.dtype != "uint8":
        raise QuantError("Q003", f"{name}: a 4-bit weight must be packed uint8")
    if state.dtype != "uint8" or len(state.shape) != 1 or state.nbytes > MAX_QUANT_STATE_BYTES:
        raise QuantError("Q005", f"{name}: quant_state must be a uint8 vector of at most {MAX_QUANT_STATE_BYTES} bytes")
    absmax = parts.get("absmax")
    if absmax is None or len(absmax.shape) != 1 or absmax.shape[0] < 1:
        raise QuantError("Q002", f"{name}: absmax is missing")
    if absmax.dtype not in _SCALE_DTYPES | {"uint8"}:
        raise QuantError("Q003", f"{name}: absmax is {absmax.dtype}")
    quant_map = parts.get("quant_map")
    if quant_map is None or quant_map.shape != (16,) or quant_map.dtype not in _SCALE_DTYPES:
        raise QuantError("Q003", f"{name}: quant_map must be 16 floats")
    values = 2 * prod(data.shape)
    if -(-values // absmax.shape[0]) > 4096:  # bitsandbytes' blocks are 32..4096 values
        raise QuantError("Q003", f"{name}: {absmax.shape[0]} absmax values for {values} weights")


def parse_quant_state(raw: bytes, name: str) -> dict[str, Any]:
    """bitsandbytes' packed ``quant_state`` (JSON in a uint8 tensor), checked before the backend sees it."""
    if len(raw) > MAX_QUANT_STATE_BYTES:
        raise QuantError("Q005", f"{name}: {len(raw)} bytes, over {MAX_QUANT_STATE_BYTES}")
    try:
        value = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise QuantError("Q005", f"{name}: not JSON") from None
    if not isinstance(value, dict) or not isinstance(value.get("shape"), list) \
            or not all(isinstance(n, int) and 0 <= n < 1 << 40 for n in value["shape"]) \
            or not isinstance(value.get("quant_type"), str) or not isinstance(value.get("blocksize"), int):
        raise QuantError("Q005", f"{name}: not a bitsandbytes quant state (shape, quant_type, blocksize)")
    if value["quant_type"] not in ("nf4", "fp4") or value["blocksize"] not in BNB_BLOCKSIZES \
            or value.get("dtype", "float32") not in _SCALE_DTYPES:
        raise QuantError("Q005", f"{name}: quant_type {str(value['quant_type'])[:20]!r}, blocksize "
                         f"{value['blocksize']}, dtype {str(value.get('dtype'))[:20]!r}: not what bitsandbytes writes")
    nested = value.get("nested_blocksize")
    if nested is not None and nested not in BNB_BLOCKSIZES:
        raise QuantError("Q005", f"{name}: nested_blocksize {nested!r}")
    return value


def check_quant_state(state: Mapping[str, Any], name: str, packed_bytes: int, absmax_count: int) -> None:
    """A parsed 4-bit quant state fits its tensors: its shape holds the packed values (two per byte) and
    one absmax per block."""
    values = prod(state["shape"])
    if -(-values // 2) != packed_bytes or -(-values // state["blocksize"]) != absmax_count:
        raise QuantError("Q003", f"{name}: quant state shape {state['shape'][:4]} / blocksize {state['blocksize']} "
                         f"do not fit {packed_bytes} packed bytes and {absmax_count} absmax values")


# --- one component -----------------------------------------------------------------------------------
def _all_tensors(headers: Iterable[SafetensorsHeader]) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for header in headers:
        out.update(header.tensors)
    return out


def _metadata(headers: Iterable[SafetensorsHeader]) -> dict[str, str]:
    merged: dict[str, str] = {}
    for header in headers:
        merged.update(header.metadata or {})
    return merged


def analyse(config: Any, headers: Iterable[SafetensorsHeader]) -> dict[str, Any] | None:
    """The quantization record of a component (``backend``, ``scheme``, ``quantized``: weights count, ``roles``:
    which stored tensors are quantized data and which scales / states, by suffix), or None when its config
    names no torchao / bitsandbytes quantization.

    Raises:
        QuantError: the component is not self-consistent (its Q0xx code says how).
    """
    backend = backend_of(config)
    if backend not in ("torchao", "bitsandbytes_4bit", "bitsandbytes_8bit"):
        return None
    headers = list(headers)
    tensors = _all_tensors(headers)
    scheme = scheme_of(config)
    if backend == "torchao":
        descriptions = torchao_descriptions(_metadata(headers))
        groups = torchao_groups(descriptions)
        kinds = sorted({str(descriptions[n]["_type"]) for n in groups})
        if scheme and scheme.startswith("int8") and any(k != "Int8Tensor" for k in kinds):
            raise QuantError("Q004", f"config scheme {scheme!r} but the tensors are {', '.join(kinds)}")
        missing = sorted(n for n, d in descriptions.items() if d["_type"] == "Tensor" and n not in tensors)
        if missing:
            raise QuantError("Q002", f"{missing[0]}: listed in tensor_names but not stored")
    else:
        groups = bnb_groups(tensors, backend)
        kinds = [scheme or "?"]
    if not groups:
        raise QuantError("Q004", f"config says {backend} {scheme or ''} but no stored tensor is quantized")
    roles: dict[str, str] = {}
    for name, parts in groups.items():
        stored = {part: tensors.get(tensor) for part, tensor in parts.items()}
        absent = sorted(p for p, t in stored.items() if t is None and not (backend == "bitsandbytes_8bit"
                                                                           and p == "weight_format"))
        if absent:
            raise QuantError("Q002", f"{name}: quantized weight lacks its {', '.join(absent)}")
        present = {p: t for p, t in stored.items() if t is not None}
        if backend == "torchao" and descriptions[name]["_type"] == "Int8Tensor":
            _check_torchao_int8(name, present)
        elif backend != "torchao":
            _check_bnb(name, present, backend, scheme)
        module = name.rpartition(".")[0]
        for part, tensor in parts.items():  # by suffix after the layer's name: "._weight_scale", ".weight.absmax"
            roles.setdefault(part, tensor[len(module):] if tensor.startswith(module) else tensor)
    return {"backend": backend, "scheme": scheme, "tensor_types": kinds, "quantized": len(groups),
            "roles": dict(sorted(roles.items()))}


def index_record(config: Any, headers: Iterable[SafetensorsHeader]) -> dict[str, Any] | None:
    """The extra index record of a component quantized by torchao / bitsandbytes, or None."""
    record = analyse(config, headers)
    if record is None:
        return None
    return {"quantization": {"method": record["backend"], **record}}


def findings_for(component: str, config: Any, headers: Iterable[SafetensorsHeader]) -> list[Finding]:
    """Q001-Q005 for one component: [] when it is consistent or not quantized by a backend we check."""
    qc = quantization_config(config)
    if qc is None:
        return []
    backend = backend_of(config)
    if backend is None:
        return [finding("Q001", f"{component}/config.json", "quantization_config has no 'quant_method'")]
    if backend in ("torchao", "bitsandbytes_4bit", "bitsandbytes_8bit") and scheme_of(config) is None:
        return [finding("Q001", f"{component}/config.json", f"{backend} quantization_config names no scheme")]
    try:
        analyse(config, headers)
    except QuantError as e:
        return [finding(e.code, f"{component}/config.json", f"{backend}: {e}")]
    return []
