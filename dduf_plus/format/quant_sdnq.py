"""SDNQ components as diffusers 0.42 / sdnq 0.2.8 save them, read from a config and safetensors headers
(torch-free).

* SDNQ (sdnq 0.2.8): ``L.weight`` in the storage dtype of ``weights_dtype`` (int8 ``[N, K]``, float8 ``[N, K]``,
  or a flat packed vector: uint4 is uint8 ``[N*K/2]``), ``L.scale`` ``[N, 1]`` or ``[N, G, 1]`` (G groups along
  K), for unsigned schemes ``L.zero_point`` shaped like the scale; the layers the quantizer skipped are named
  in ``quantization_config.modules_to_not_convert`` (names or ``*`` patterns SDNQ turns into regexes), which
  with the other config fields is what SDNQ parses: :func:`check_sdnq_config` bounds them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from math import prod
from typing import Any, NamedTuple

from .quantization import SCALE_DTYPES, QuantError
from .safetensors_header import TensorInfo

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
    plain = SCALE_DTYPES | {"float64"}
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


def check_sdnq_weight(name: str, parts: Mapping[str, TensorInfo], qc: Mapping[str, Any], storages: set[str]) -> None:
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
    if scale.dtype not in SCALE_DTYPES | {"float64"} or len(scale.shape) < 2 or not all(scale.shape) \
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
            zero.shape != scale.shape or zero.dtype not in SCALE_DTYPES | {"float64"}):
        raise QuantError("Q003", f"{name}: zero_point {zero.dtype} {list(zero.shape)} does not match its scale "
                         f"{scale.dtype} {list(scale.shape)}")


def sdnq_skipped_but_stored(qc: Mapping[str, Any], groups: Mapping[str, Any]) -> str | None:
    """A weight the config lists as not converted (an exact name) but stored quantized."""
    skipped = qc.get("modules_to_not_convert") or []
    skipped = {skipped} if isinstance(skipped, str) else set(skipped)
    return next((name for name in groups if name in skipped or name.rpartition(".")[0] in skipped), None)

