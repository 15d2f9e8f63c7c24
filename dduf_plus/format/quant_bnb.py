"""bitsandbytes components as diffusers 0.42 / bitsandbytes 0.50 save them, read from safetensors headers and
their packed quant states (torch-free).

* bitsandbytes 4-bit: ``L.weight`` packed uint8 ``[ceil(N*K/2), 1]``, ``L.weight.absmax`` float32,
  ``L.weight.quant_map`` float32 ``[16]``, ``L.weight.quant_state.bitsandbytes__<nf4|fp4>`` packed uint8
  (a small JSON the backend parses), and with double quantization ``nested_absmax`` / ``nested_quant_map``.
* bitsandbytes 8-bit: ``L.weight`` int8 ``[N, K]``, ``L.SCB`` float32 ``[N]``, ``L.weight_format`` uint8.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from math import isfinite, prod
from typing import Any

from .quantization import SCALE_DTYPES, QuantError
from .safetensors_header import TensorInfo

MAX_QUANT_STATE_BYTES = 4096  # bitsandbytes' packed quant_state JSON (a real one is ~150 bytes)
BNB_BLOCKSIZES = frozenset({32, 64, 128, 256, 512, 1024, 2048, 4096})  # what bitsandbytes quantizes with
BNB_4BIT_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
# bitsandbytes' QuantState.valid_qs_keys (0.50): from_dict asserts a packed state holds no other field
BNB_QS_KEYS = frozenset({"absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state", "quant_type",
                         "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset"})
BNB_CODE_VALUES = {"quant_map": 16, "nested_quant_map": 256}  # 4-bit codes; dequantize_blockwise indexes by a byte


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


def check_bnb_config(qc: Mapping[str, Any], backend: str) -> None:
    """Q005: a 4-bit config's ``bnb_4bit_compute_dtype`` is a float dtype bitsandbytes computes in. diffusers
    resolves any torch dtype name (``getattr(torch, name)``) and each layer casts its input to it: ``int8``
    truncated the activations, ``float8_e4m3fn`` gave NaN, ``bool`` a bare NotImplementedError, all after a
    clean load."""
    value = qc.get("bnb_4bit_compute_dtype")
    if backend == "bitsandbytes_4bit" and value is not None and value not in SCALE_DTYPES:
        raise QuantError("Q005", f"bnb_4bit_compute_dtype {str(value)[:20]!r} is not float32, float16 or bfloat16")


def check_bnb_weight(name: str, parts: Mapping[str, TensorInfo], backend: str, scheme: str | None) -> None:
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
    if absmax.dtype not in SCALE_DTYPES | {"uint8"}:
        raise QuantError("Q003", f"{name}: absmax is {absmax.dtype}")
    quant_map = parts.get("quant_map")
    if quant_map is None or quant_map.shape != (16,) or quant_map.dtype not in SCALE_DTYPES:
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
            or value.get("dtype", "float32") not in SCALE_DTYPES:
        raise QuantError("Q005", f"{name}: quant_type {str(value['quant_type'])[:20]!r}, blocksize "
                         f"{value['blocksize']}, dtype {str(value.get('dtype'))[:20]!r}: not what bitsandbytes writes")
    unknown = sorted(set(value) - BNB_QS_KEYS)
    if unknown:  # QuantState.from_dict asserts its keys (an AssertionError, or nothing under python -O)
        raise QuantError("Q005", f"{name}: unknown quant state field {unknown[0][:40]!r}")
    nested = value.get("nested_blocksize")
    if nested is not None and nested not in BNB_BLOCKSIZES:
        raise QuantError("Q005", f"{name}: nested_blocksize {str(nested)[:20]!r}")
    if value.get("nested_dtype") is not None and value["nested_dtype"] not in SCALE_DTYPES:
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
        QuantError: ``Q004`` (its quant_type is not the one its tensor name, so the config, says), ``Q003``
            (shape / blocksize against the packed data and absmax) or ``Q007`` (a field a kernel indexes with:
            nested fields, dtype).
    """
    stored = parts.get("quant_state")  # its name says the scheme (checked against the config: Q004)
    named = stored.name.rpartition(".quant_state.bitsandbytes__")[2] if stored is not None else None
    if named and state["quant_type"] != named:  # bitsandbytes dequantizes with the JSON's: another code book
        raise QuantError("Q004", f"{name}: the quant state says {state['quant_type']!r}, its tensor name and the "
                         f"config say {named!r}")
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

