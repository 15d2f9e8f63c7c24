"""Quantized components saved by diffusers' quantizers (torchao, bitsandbytes, SDNQ), as the format sees them:
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
* SDNQ (sdnq 0.2.8): ``L.weight`` in the storage dtype of ``weights_dtype`` (int8 ``[N, K]``, float8 ``[N, K]``,
  or a flat packed vector: uint4 is uint8 ``[N*K/2]``), ``L.scale`` ``[N, 1]`` or ``[N, G, 1]`` (G groups along
  K), for unsigned schemes ``L.zero_point`` shaped like the scale; the layers the quantizer skipped are named
  in ``quantization_config.modules_to_not_convert`` (names or ``*`` patterns SDNQ turns into regexes), which
  with the other config fields is what SDNQ parses: :func:`check_sdnq_config` bounds them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from math import isfinite, prod
from typing import Any, NamedTuple

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
# bitsandbytes' QuantState.valid_qs_keys (0.50): from_dict asserts a packed state holds no other field
BNB_QS_KEYS = frozenset({"absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state", "quant_type",
                         "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset"})
BNB_CODE_VALUES = {"quant_map": 16, "nested_quant_map": 256}  # 4-bit codes; dequantize_blockwise indexes by a byte
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
    if backend == "sdnq":
        kind = qc.get("weights_dtype", "int8")  # SDNQConfig's default
        return kind if isinstance(kind, str) and sdnq_dtype(kind) is not None else None
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


def _check_torchao_block_size(name: str, description: Mapping[str, Any], parts: Mapping[str, TensorInfo]) -> None:
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
        if t is not None and t.shape != grid:
            raise QuantError("Q007", f"{name}: {part} {list(t.shape)} is not the block grid {list(grid)} of qdata "
                             f"{list(qdata.shape)} in blocks of {block}")


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
    _check_bnb_kernel_parts(name, parts)


def _check_bnb_kernel_parts(name: str, parts: Mapping[str, TensorInfo]) -> None:
    """Q007: the 4-bit parts bitsandbytes' C kernels read through raw pointers, as they read them (0.50,
    backends/cpu/ops.py and csrc): ``quant_map`` / ``nested_quant_map`` are float32 code books of 16 / 256
    values (``cdequantize_blockwise_cpu_*`` reads ``code[byte]`` for every byte of the absmax it dequantizes:
    a shorter map is read past its end, into the next tensor or the heap); with double quantization absmax is
    its uint8 codes and ``nested_absmax`` float32, without it absmax is float32."""
    nested = [p for p in ("nested_absmax", "nested_quant_map") if p in parts]
    if len(nested) == 1:
        missing = "nested_quant_map" if nested == ["nested_absmax"] else "nested_absmax"
        raise QuantError("Q002", f"{name}: double-quantized weight lacks its {missing}")
    for part, count in BNB_CODE_VALUES.items():
        t = parts.get(part)
        if t is not None and (t.dtype != "float32" or t.shape != (count,)):
            raise QuantError("Q007", f"{name}: {part} is {t.dtype} {list(t.shape)[:4]}; bitsandbytes' kernel reads "
                             f"{count} float32 values")
    absmax, wanted = parts["absmax"], "uint8" if nested else "float32"
    if absmax.dtype != wanted:
        raise QuantError("Q007", f"{name}: absmax is {absmax.dtype}; with{'' if nested else 'out'} double "
                         f"quantization bitsandbytes reads {wanted}")
    inner = parts.get("nested_absmax")
    if inner is not None and (inner.dtype != "float32" or len(inner.shape) != 1 or not inner.shape[0]):
        raise QuantError("Q007", f"{name}: nested_absmax is {inner.dtype} {list(inner.shape)[:4]}, not a float32 "
                         "vector")


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
    unknown = sorted(set(value) - BNB_QS_KEYS)
    if unknown:  # QuantState.from_dict asserts its keys (an AssertionError, or nothing under python -O)
        raise QuantError("Q005", f"{name}: unknown quant state field {unknown[0][:40]!r}")
    nested = value.get("nested_blocksize")
    if nested is not None and nested not in BNB_BLOCKSIZES:
        raise QuantError("Q005", f"{name}: nested_blocksize {str(nested)[:20]!r}")
    if value.get("nested_dtype") is not None and value["nested_dtype"] not in _SCALE_DTYPES:
        # bitsandbytes looks it up with getattr(torch, ...): any attribute of torch otherwise
        raise QuantError("Q005", f"{name}: nested_dtype {str(value['nested_dtype'])[:20]!r} is not a float dtype")
    offset = value.get("nested_offset")
    if offset is not None and (type(offset) not in (int, float) or not isfinite(offset)):
        raise QuantError("Q005", f"{name}: nested_offset {str(offset)[:20]!r} is not a finite number")
    return value


def check_quant_state(state: Mapping[str, Any], name: str, parts: Mapping[str, TensorInfo]) -> None:
    """A parsed 4-bit quant state fits its stored tensors as bitsandbytes' kernels index them (the header checks
    of the same parts ran in :func:`analyse`): its shape holds the packed values (two per byte) and one absmax
    per block; with double quantization, one nested_absmax per nested block of absmax bytes.

    Raises:
        QuantError: ``Q003`` (shape / blocksize against the packed data and absmax) or ``Q007`` (a field a
            kernel indexes with: nested fields, dtype).
    """
    values = prod(state["shape"])
    packed_bytes, absmax_count = parts["data"].nbytes, prod(parts["absmax"].shape)
    if -(-values // 2) != packed_bytes or -(-values // state["blocksize"]) != absmax_count:
        raise QuantError("Q003", f"{name}: quant state shape {state['shape'][:4]} / blocksize {state['blocksize']} "
                         f"do not fit {packed_bytes} packed bytes and {absmax_count} absmax values")
    if len(state["shape"]) != 2 or not values or "dtype" not in state:
        raise QuantError("Q007", f"{name}: quant state shape {state['shape'][:4]} is not a weight matrix, or it "
                         "names no dtype")
    nested = "nested_absmax" in parts
    fields = [k for k in ("nested_blocksize", "nested_dtype", "nested_offset") if k in state]
    if nested and len(fields) < 3:
        raise QuantError("Q007", f"{name}: nested_absmax is stored but the quant state lacks "
                         f"{', '.join(k for k in ('nested_blocksize', 'nested_dtype', 'nested_offset') if k not in fields)}")
    if not nested and fields:
        raise QuantError("Q007", f"{name}: the quant state names {fields[0]} but no nested_absmax is stored")
    if nested:  # dequantize_blockwise reads nested_absmax[i // nested_blocksize] for every absmax byte i
        count = prod(parts["nested_absmax"].shape)
        if count != -(-absmax_count // state["nested_blocksize"]):
            raise QuantError("Q007", f"{name}: {count} nested_absmax values for {absmax_count} absmax bytes in blocks "
                             f"of {state['nested_blocksize']} (bitsandbytes' kernel reads "
                             f"{-(-absmax_count // state['nested_blocksize'])})")


BNB_CPU_ROW_GROUP = 32  # bitsandbytes' AVX512-BF16 CPU kernel repacks a 4-bit weight's rows in groups of 32


def bnb_cpu_repack_problem(shape: Iterable[int], blocksize: int) -> str | None:
    """Why bitsandbytes' AVX512-BF16 CPU path cannot repack a 4-bit layer whose weight is ``shape`` [N, K]
    quantized in blocks of ``blocksize``, or None when it can.

    On a CPU with ``avx512_bf16``, ``Linear4bit.forward`` first repacks the weight for its fused kernel
    (``_convert_weight_packed_for_cpu``, bitsandbytes 0.50): N rows in groups of 32, each row a whole number of
    blocks (so at least one). Elsewhere the plain path takes any shape."""
    dims = list(shape)
    if len(dims) != 2:
        return f"weight shape {dims[:4]} is not a matrix"
    rows, columns = dims
    if columns < blocksize:
        return f"in_features {columns} is narrower than one block ({blocksize})"
    if columns % blocksize:
        return f"in_features {columns} is not a multiple of the block size {blocksize}"
    if rows % BNB_CPU_ROW_GROUP:
        return f"out_features {rows} is not a multiple of {BNB_CPU_ROW_GROUP}"
    return None


# --- optimum-quanto ----------------------------------------------------------------------------------
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


# --- SDNQ -------------------------------------------------------------------------------------------
SDNQ_PARTS = ("scale", "zero_point", "scale_2", "scale_zero_point", "zero_point_scale", "zero_point_2", "svd_up",
              "svd_down")
MAX_SDNQ_PATTERNS = 8192  # names over modules_to_not_convert & co. (a saved SDXL unet lists ~1,000; SDNQ tries
#                           each against every parameter name, so this bounds the load's work too)
MAX_SDNQ_PATTERN_CHARS = 512
# patterns with '*': sdnq.utils.check_param_name_in calls re.match(pattern string) per parameter, so past the
# re module's cache (512 entries) each call compiles again: 8,192 of them added 19 s to a tiny UNet's load
MAX_SDNQ_WILDCARD_PATTERNS = 256
MAX_SDNQ_WILDCARDS = 3  # '*' per pattern: SDNQ turns such a pattern into a regex (one '.*' per '*')
MAX_SDNQ_MODULE_CONFIGS = 256  # modules_quant_config entries (per-module overrides)
_SDNQ_PATTERN = re.compile(r"[\w.*\-]+")  # module paths: no regex syntax reaches SDNQ's re.match
_SDNQ_INTS = {"group_size": (-2, 1 << 16), "svd_rank": (1, 4096), "svd_steps": (0, 1000), "codebook_steps": (0, 1000),
              "hadamard_group_size": (1, 1 << 16), "minimum_allowed_numel": (0, 1 << 40),
              "minimum_allowed_channel_size": (0, 1 << 30)}  # the loops and allocations SDNQ sizes from them
_SDNQ_BOOLS = ("use_svd", "use_hadamard", "use_codebook", "use_codebook_scale", "use_quantized_matmul",
               "use_quantized_matmul_conv", "dequantize_fp32", "quant_conv", "quant_embedding", "is_training",
               "use_dynamic_quantization", "use_static_quantization", "use_stochastic_rounding")
_SDNQ_LISTS = ("modules_to_not_convert", "modules_to_not_use_matmul")
_SDNQ_PLAIN = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "float8_e4m3fn": "float8_e4m3fn", "fp8": "float8_e4m3fn",
               "float8_e5m2": "float8_e5m2", "float8_e8m0fnu": "float8_e8m0fnu",
               "float8_e4m3fnuz": "float8_e4m3fnuz", "float8_e5m2fnuz": "float8_e5m2fnuz"}
_SDNQ_INT = re.compile(r"(u?)int(\d{1,2})")
_SDNQ_FLOAT = re.compile(r"float(\d{1,2})_e(\d)m(\d{1,2})fn(u?)|(u?)fp(\d{1,2})")
_SDNQ_MINIMUM = re.compile(r"(?:minimum[-_]?)?(?:u?int)?\d{1,2}(?:[-_]?bits?)?")


class SDNQDtype(NamedTuple):
    storage: str  # the safetensors dtype (torch spelling) its weights are stored in
    bits: int
    packed: bool  # several values per stored element (uint4: two per uint8)
    unsigned: bool  # asymmetric: stored with a zero_point
    integer: bool


def _packed_storage(bits: int) -> str:
    return "uint8" if bits <= 8 else "uint16" if bits == 16 else "int16"


def sdnq_dtype(name: str) -> SDNQDtype | None:
    """What SDNQ's ``weights_dtype`` name means (sdnq.common.dtype_dict, 0.2.8), torch-free; None if unknown."""
    if name in _SDNQ_PLAIN:
        storage = _SDNQ_PLAIN[name]
        return SDNQDtype(storage, 32 if storage == "float32" else 16 if "16" in storage else 8, False, False, False)
    if name in ("bool", "int1", "uint1"):
        return SDNQDtype("bool", 1, True, True, True)
    if name == "float8_e4m3fn_sdnq":
        return SDNQDtype("uint8", 8, True, False, False)
    if m := _SDNQ_INT.fullmatch(name):
        bits, unsigned = int(m.group(2)), bool(m.group(1))
        if not 2 <= bits <= 32 or (bits > 16 and bits != 32):
            return None
        if bits in (8, 16, 32):
            return SDNQDtype(f"{m.group(1)}int{bits}", bits, False, unsigned, True)
        return SDNQDtype(_packed_storage(bits), bits, True, unsigned, True)
    if m := _SDNQ_FLOAT.fullmatch(name):
        if m.group(1):
            bits, unsigned = int(m.group(1)), bool(m.group(4))
            if not 1 <= int(m.group(2)) <= 5 or int(m.group(2)) + int(m.group(3)) + (not unsigned) != bits:
                return None
        else:
            bits, unsigned = int(m.group(6)), bool(m.group(5)) or m.group(6) == "1"
        if 1 <= bits <= 16:
            return SDNQDtype(_packed_storage(bits), bits, True, unsigned, False)
    return None


def _check_sdnq_patterns(qc: Mapping[str, Any]) -> None:
    """The module-name lists SDNQ matches every parameter name against (patterns with '*' as regexes)."""
    patterns: list[Any] = []
    for field in _SDNQ_LISTS:
        value = qc.get(field)
        patterns.extend([value] if isinstance(value, str) else value if isinstance(value, list) else [])
        if value is not None and not isinstance(value, (str, list)):
            raise QuantError("Q005", f"{field} is a {type(value).__name__}, not a list of names")
    dtypes = qc.get("modules_dtype_dict") or {}
    if not isinstance(dtypes, Mapping):
        raise QuantError("Q005", "modules_dtype_dict is not an object")
    for key, value in dtypes.items():
        low = str(key).lower()
        if sdnq_dtype(low) is None and not (_SDNQ_MINIMUM.fullmatch(low) and (low.startswith("minimum") or "bit" in low)):
            raise QuantError("Q005", f"modules_dtype_dict key {str(key)[:40]!r} is no SDNQ dtype or minimum-bits rule")
        patterns.extend([value] if isinstance(value, str) else value if isinstance(value, list) else [None])
    if len(patterns) > MAX_SDNQ_PATTERNS:
        raise QuantError("Q005", f"{len(patterns)} module patterns (over {MAX_SDNQ_PATTERNS})")
    wild = sum(1 for p in patterns if isinstance(p, str) and "*" in p)
    if wild > MAX_SDNQ_WILDCARD_PATTERNS:
        raise QuantError("Q005", f"{wild} module patterns with '*' (over {MAX_SDNQ_WILDCARD_PATTERNS}: SDNQ compiles "
                         "each one again for every parameter past Python's regex cache)")
    for pattern in patterns:
        if not isinstance(pattern, str) or len(pattern) > MAX_SDNQ_PATTERN_CHARS or not _SDNQ_PATTERN.fullmatch(pattern) \
                or pattern.count("*") > MAX_SDNQ_WILDCARDS:
            raise QuantError("Q005", f"module pattern {str(pattern)[:60]!r}: not a module path of at most "
                             f"{MAX_SDNQ_PATTERN_CHARS} characters and {MAX_SDNQ_WILDCARDS} '*'")


def check_sdnq_config(qc: Mapping[str, Any], *, nested: bool = False) -> None:
    """An SDNQ ``quantization_config`` within what SDNQ parses safely: known dtype names, integers in range
    (they size SDNQ's loops), booleans, bounded module-name lists and per-module overrides.

    Raises:
        QuantError: ``Q005`` naming the field.
    """
    for field in ("weights_dtype", "scale_dtype", "zero_point_dtype", "quantized_matmul_dtype"):
        value = qc.get(field)
        if value is not None and value != "none" and not (isinstance(value, str) and sdnq_dtype(value)):
            raise QuantError("Q005", f"{field} {str(value)[:40]!r} is not an SDNQ dtype")
    for field, (low, high) in _SDNQ_INTS.items():
        value = qc.get(field)
        if value is not None and (type(value) is not int or not low <= value <= high):
            raise QuantError("Q005", f"{field} {str(value)[:40]!r} is not an integer in [{low}, {high}]")
    for field in _SDNQ_BOOLS:
        if qc.get(field) is not None and not isinstance(qc.get(field), bool):
            raise QuantError("Q005", f"{field} is not a boolean")
    _check_sdnq_patterns(qc)
    overrides = qc.get("modules_quant_config") or {}
    if not isinstance(overrides, Mapping) or (nested and overrides) or len(overrides) > MAX_SDNQ_MODULE_CONFIGS:
        raise QuantError("Q005", f"modules_quant_config must be an object of at most {MAX_SDNQ_MODULE_CONFIGS} "
                         "per-module configs (not nested)")
    for key, sub in overrides.items():
        if not isinstance(sub, Mapping) or not isinstance(key, str) or not _SDNQ_PATTERN.fullmatch(key):
            raise QuantError("Q005", f"modules_quant_config entry {str(key)[:40]!r} is not a module pattern and object")
        check_sdnq_config(sub, nested=True)


def sdnq_storage_dtypes(qc: Mapping[str, Any]) -> set[str]:
    """The dtypes SDNQ may store quantized weights in under this config (its scheme, the per-module ones)."""
    names = {qc.get("weights_dtype", "int8")}
    names.update(str(k).lower() for k in (qc.get("modules_dtype_dict") or {}))
    names.update(sub.get("weights_dtype") for sub in (qc.get("modules_quant_config") or {}).values())
    found = {sdnq_dtype(n) for n in names if isinstance(n, str)}
    storages = {d.storage for d in found if d is not None}
    if None in found:
        storages |= {"uint8", "int8", "int16"}  # a minimum-bits rule: SDNQ picks an (u)intN per module
    return storages


def sdnq_groups(tensors: Mapping[str, TensorInfo], storages: set[str]) -> dict[str, dict[str, str]]:
    """{quantized weight: {part: stored tensor name}}: every ``L.weight`` stored with an ``L.scale`` or in a
    dtype only quantized weights have (then a missing scale is reported, not ignored)."""
    plain = _SCALE_DTYPES | {"float64"}
    groups: dict[str, dict[str, str]] = {}
    for name, info in tensors.items():
        module, _, attr = name.rpartition(".")
        if attr != "weight" or not module:
            continue
        if f"{module}.scale" in tensors or (info.dtype not in plain and info.dtype in storages | {"int8", "uint8"}):
            parts = {"weight": name}
            parts.update({p: f"{module}.{p}" for p in SDNQ_PARTS if f"{module}.{p}" in tensors})
            groups[name] = parts
    return groups


def _check_sdnq(name: str, parts: Mapping[str, TensorInfo], qc: Mapping[str, Any], storages: set[str]) -> None:
    """One SDNQ layer: weight in the scheme's storage dtype, a float scale with one value per group, a
    zero point shaped like it for unsigned schemes, as many stored values as the groups need."""
    weight, scale, zero = parts["weight"], parts.get("scale"), parts.get("zero_point")
    scheme = sdnq_dtype(str(qc.get("weights_dtype", "int8")))
    if weight.dtype not in storages:
        raise QuantError("Q004", f"{name} is stored as {weight.dtype}; the config's {qc.get('weights_dtype', 'int8')} "
                         f"stores {', '.join(sorted(storages))}")
    if scale is None:
        raise QuantError("Q002", f"{name}: quantized weight lacks its scale")
    if qc.get("scale_dtype") not in (None, "none"):
        return  # the scale is itself quantized (scale_2...): its layout is SDNQ's to check
    # the reduced axis is kept as 1: [N, 1], [N, G, 1], a conv's [O, 1, kh, kw], a matmul-transposed [1, N]
    if scale.dtype not in _SCALE_DTYPES | {"float64"} or len(scale.shape) < 2 or not all(scale.shape) \
            or 1 not in scale.shape:
        raise QuantError("Q003", f"{name}: scale {scale.dtype} {list(scale.shape)} is not a float tensor with its "
                         "reduced axis kept as 1")
    groups = prod(scale.shape)
    unpacked = prod(weight.shape) if len(weight.shape) > 1 else None
    # a matmul-transposed layer ([K, N] weight) keeps one scale per column: [1, N], never a lone [1, 1] that
    # SDNQ's dequantizer would broadcast over every output (a silently different model)
    transposed = scale.shape[0] == 1 and weight.shape[0] != 1
    if unpacked is not None and (unpacked % groups or scale.shape[0] not in (weight.shape[0], 1)
                                 or (transposed and scale.shape != (1, weight.shape[-1]))):
        raise QuantError("Q003", f"{name}: scale {list(scale.shape)} does not fit weight {list(weight.shape)}")
    if unpacked is None and scheme is not None and scheme.packed and weight.nbytes * 8 // scheme.bits < groups:
        raise QuantError("Q003", f"{name}: {weight.nbytes} packed bytes cannot hold {groups} groups")
    overrides = qc.get("modules_dtype_dict") or qc.get("modules_quant_config")
    wants_zero = bool(scheme and scheme.unsigned and scheme.integer and not qc.get("use_codebook") and not overrides)
    if wants_zero and zero is None:
        raise QuantError("Q002", f"{name}: an unsigned ({qc.get('weights_dtype')}) weight lacks its zero_point")
    if zero is not None and qc.get("zero_point_dtype") in (None, "none") and (
            zero.shape != scale.shape or zero.dtype not in _SCALE_DTYPES | {"float64"}):
        raise QuantError("Q003", f"{name}: zero_point {zero.dtype} {list(zero.shape)} does not match its scale "
                         f"{scale.dtype} {list(scale.shape)}")


def _sdnq_skipped_but_stored(qc: Mapping[str, Any], groups: Mapping[str, Any]) -> str | None:
    """A weight the config lists as not converted (an exact name) but stored quantized."""
    skipped = qc.get("modules_to_not_convert") or []
    skipped = {skipped} if isinstance(skipped, str) else set(skipped)
    return next((name for name in groups if name in skipped or name.rpartition(".")[0] in skipped), None)


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


ANALYSED = ("torchao", "bitsandbytes_4bit", "bitsandbytes_8bit", "sdnq")  # the backends these rules check


def _groups(backend: str, scheme: str | None, qc: Mapping[str, Any], headers: list[SafetensorsHeader],
            tensors: Mapping[str, TensorInfo]) -> tuple[dict[str, dict[str, str]], list[str], Any]:
    """The component's quantized weights ({weight: {part: tensor}}), their tensor kinds, and the check of one
    weight's stored parts; the backend's own metadata checked first (Q004/Q005)."""
    if backend == "torchao":
        descriptions = torchao_descriptions(_metadata(headers))
        groups = torchao_groups(descriptions)
        kinds = sorted({str(descriptions[n]["_type"]) for n in groups})
        if scheme and scheme.startswith("int8") and any(k != "Int8Tensor" for k in kinds):
            raise QuantError("Q004", f"config scheme {scheme!r} but the tensors are {', '.join(kinds)}")
        missing = sorted(n for n, d in descriptions.items() if d["_type"] == "Tensor" and n not in tensors)
        if missing:
            raise QuantError("Q002", f"{missing[0]}: listed in tensor_names but not stored")

        def check_torchao(name: str, parts: Mapping[str, TensorInfo]) -> None:
            if descriptions[name]["_type"] == "Int8Tensor":
                _check_torchao_int8(name, parts)
                _check_torchao_block_size(name, descriptions[name], parts)
        return groups, kinds, check_torchao
    if backend == "sdnq":
        check_sdnq_config(qc)
        storages = sdnq_storage_dtypes(qc)
        groups = sdnq_groups(tensors, storages)
        skipped = _sdnq_skipped_but_stored(qc, groups)
        if skipped is not None:
            raise QuantError("Q004", f"{skipped}: modules_to_not_convert lists it, but it is stored quantized")
        kinds = sorted({tensors[n].dtype for n in groups})
        return groups, kinds, lambda name, parts: _check_sdnq(name, parts, qc, storages)
    return bnb_groups(tensors, backend), [scheme or "?"], lambda name, parts: _check_bnb(name, parts, backend, scheme)


def analyse(config: Any, headers: Iterable[SafetensorsHeader]) -> dict[str, Any] | None:
    """The quantization record of a component (``backend``, ``scheme``, ``quantized``: weights count, ``roles``:
    which stored tensors are quantized data and which scales / states, by suffix), or None when its config
    names no torchao / bitsandbytes quantization.

    Raises:
        QuantError: the component is not self-consistent (its Q0xx code says how).
    """
    backend = backend_of(config)
    if backend not in ANALYSED:
        return None
    headers = list(headers)
    tensors = _all_tensors(headers)
    scheme = scheme_of(config)
    groups, kinds, check = _groups(backend, scheme, quantization_config(config) or {}, headers, tensors)
    if not groups and backend != "sdnq":
        raise QuantError("Q004", f"config says {backend} {scheme or ''} but no stored tensor is quantized")
    # SDNQ skips every layer under its minimum sizes (16,384 weights, 32 channels by default): diffusers writes a
    # small model's config with no stored tensor quantized, which loads as it does in diffusers (the skeleton SDNQ
    # builds from the config must still match the tensors, Q006 at load): recorded as quantized 0, not refused.
    roles: dict[str, str] = {}
    for name, parts in groups.items():
        stored = {part: tensors.get(tensor) for part, tensor in parts.items()}
        absent = sorted(p for p, t in stored.items() if t is None and not (backend == "bitsandbytes_8bit"
                                                                           and p == "weight_format"))
        if absent:
            raise QuantError("Q002", f"{name}: quantized weight lacks its {', '.join(absent)}")
        check(name, {p: t for p, t in stored.items() if t is not None})
        module = name.rpartition(".")[0]
        for part, tensor in parts.items():  # by suffix after the layer's name: "._weight_scale", ".weight.absmax"
            roles.setdefault(part, tensor[len(module):] if tensor.startswith(module) else tensor)
    record = {"backend": backend, "scheme": scheme, "tensor_types": kinds, "quantized": len(groups),
              "roles": dict(sorted(roles.items()))}
    if backend == "sdnq":  # the weights its config keeps unquantized (names or patterns)
        skipped = (quantization_config(config) or {}).get("modules_to_not_convert") or []
        record["skipped"] = len(skipped) if isinstance(skipped, list) else 1
    return record


def index_record(config: Any, headers: Iterable[SafetensorsHeader]) -> dict[str, Any] | None:
    """The extra index record of a component quantized by torchao / bitsandbytes / SDNQ, or None."""
    record = analyse(config, headers)
    if record is None:
        return None
    return {"quantization": {"method": record["backend"], **record}}


def check_quant_states(headers: Iterable[SafetensorsHeader],
                       read_tensor: Callable[[str], bytes]) -> list[tuple[str, str]]:
    """bitsandbytes 4-bit: every packed quant_state (at most :data:`MAX_QUANT_STATE_BYTES`, which
    :func:`analyse` checked first) parsed as the backend would and fitted to its packed data, absmax and
    nested parts (:func:`check_quant_state`). Returns the layers bitsandbytes' AVX512-BF16 CPU path cannot
    repack, with why (:func:`bnb_cpu_repack_problem`: rule Q009, a warning).

    Raises:
        QuantError: ``Q005`` (not a quant state bitsandbytes writes), ``Q003`` / ``Q007`` (does not fit its tensors).
    """
    tensors = _all_tensors(headers)
    unfit: list[tuple[str, str]] = []
    for name, parts in bnb_groups(tensors, "bitsandbytes_4bit").items():
        state = parse_quant_state(read_tensor(parts["quant_state"]), parts["quant_state"])
        check_quant_state(state, name, {p: tensors[t] for p, t in parts.items() if t in tensors})
        problem = bnb_cpu_repack_problem(state["shape"], state["blocksize"])
        if problem is not None:
            unfit.append((name, problem))
    return unfit


def repack_finding(component: str, unfit: list[tuple[str, str]]) -> Finding:
    """Q009 for the 4-bit layers bitsandbytes' AVX512-BF16 CPU path cannot repack (one finding per component)."""
    layer, problem = unfit[0]
    more = f" (and {len(unfit) - 1} more layers)" if len(unfit) > 1 else ""
    return finding("Q009", f"{component}/config.json",
                   f"bitsandbytes_4bit: {layer}: {problem}{more}: diffusers' own load fails in the first forward on "
                   "CPUs with avx512_bf16 (its weight repack); dduf_plus keeps such layers on the plain CPU path")


def findings_for(component: str, config: Any, headers: Iterable[SafetensorsHeader],
                 read_tensor: Callable[[str], bytes] | None = None) -> list[Finding]:
    """Q001-Q005 for one component: [] when it is consistent or not quantized by a backend we check.
    With ``read_tensor`` (a stored tensor's bytes by name), bitsandbytes' packed quant states are parsed and
    checked too (:func:`check_quant_states`)."""
    qc = quantization_config(config)
    if qc is None:
        return []
    backend = backend_of(config)
    if backend is None:
        return [finding("Q001", f"{component}/config.json", "quantization_config has no 'quant_method'")]
    if backend in ANALYSED and scheme_of(config) is None:
        return [finding("Q001", f"{component}/config.json", f"{backend} quantization_config names no scheme")]
    headers = list(headers)
    try:
        record = analyse(config, headers)
        unfit = check_quant_states(headers, read_tensor) \
            if backend == "bitsandbytes_4bit" and read_tensor is not None else []
    except QuantError as e:
        return [finding(e.code, f"{component}/config.json", f"{backend}: {e}")]
    out = [repack_finding(component, unfit)] if unfit else []
    if record is not None and record["quantized"] == 0:  # SDNQ under its minimum sizes: loads, unquantized
        out.append(finding("Q010", f"{component}/config.json", f"{backend}: no stored weight is quantized: it loads "
                                                               "in full precision"))
    return out
