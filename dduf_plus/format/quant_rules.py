"""The Q0xx rules for quantized components saved by diffusers' quantizers (torchao, bitsandbytes, SDNQ): which
stored tensors are quantized data and which are scales, the index record that says so, and the check that a
component is self-consistent without importing its backend.

Everything here reads only a component's ``config.json`` (its ``quantization_config``) and its safetensors
headers (names, dtypes, shapes, ``__metadata__``): torch-free, like the rest of the format layer. Each backend's
layout, and the bounds on the metadata it parses (hostile input), is in its own module: :mod:`.quant_torchao`,
:mod:`.quant_bnb`, :mod:`.quant_sdnq`; what a config says and optimum-quanto's rules in :mod:`.quantization`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .findings import Finding, finding
from .quant_bnb import (
    bnb_cpu_repack_problem,
    bnb_groups,
    check_bnb_config,
    check_bnb_weight,
    check_quant_state,
    parse_quant_state,
)
from .quant_sdnq import (
    check_sdnq_config,
    check_sdnq_weight,
    sdnq_dtype,
    sdnq_groups,
    sdnq_skipped_but_stored,
    sdnq_storage_dtypes,
)
from .quant_torchao import check_torchao_parts, torchao_descriptions, torchao_groups
from .quantization import SCALE_DTYPES, QuantError, backend_of, quantization_config
from .safetensors_header import SafetensorsHeader, TensorInfo

_CAMEL = re.compile(r"(?<!^)(?=[A-Z][a-z])")


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
        # the weight's type the scheme names: int8_weight_only, int8_dynamic_activation_int8_weight -> int8
        weight = (scheme or "").removesuffix("_only").removesuffix("_weight").rpartition("_")[2]
        wanted = {"int8": "Int8Tensor", "float8": "Float8Tensor"}.get(weight)
        if wanted and any(k != wanted for k in kinds):
            raise QuantError("Q004", f"config scheme {scheme!r} but the tensors are {', '.join(kinds)}")
        acting = next((n for n in groups if (descriptions[n].get("_data") or {}).get("act_quant_kwargs")), None)
        if acting and (scheme or "").endswith("weight_only"):  # the layer would quantize its inputs too
            raise QuantError("Q004", f"config scheme {scheme!r} but {acting} quantizes its activations")
        missing = sorted(n for n, d in descriptions.items() if d["_type"] == "Tensor" and n not in tensors)
        if missing:
            raise QuantError("Q002", f"{missing[0]}: listed in tensor_names but not stored")

        return groups, kinds, lambda name, parts: check_torchao_parts(name, descriptions[name], parts)
    if backend == "sdnq":
        check_sdnq_config(qc)
        storages = sdnq_storage_dtypes(qc)
        groups = sdnq_groups(tensors, storages)
        skipped = sdnq_skipped_but_stored(qc, groups)
        if skipped is not None:
            raise QuantError("Q004", f"{skipped}: modules_to_not_convert lists it, but it is stored quantized")
        kinds = sorted({tensors[n].dtype for n in groups})
        return groups, kinds, lambda name, parts: check_sdnq_weight(name, parts, qc, storages)
    check_bnb_config(qc, backend)
    return bnb_groups(tensors, backend), [scheme or "?"], lambda name, parts: check_bnb_weight(name, parts, backend, scheme)


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
        QuantError: ``Q005`` (not a quant state bitsandbytes writes), ``Q004`` (its quant_type contradicts its
            name and the config), ``Q003`` / ``Q007`` (does not fit its tensors).
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


# --- optimum-quanto (its map, quanto_qmap.json, says each layer's qtype) --------------------------------------
QUANTO_QTYPES = {"qint8": (8, "int8"), "qfloat8": (8, "float8_e4m3fn"), "qfloat8_e4m3fn": (8, "float8_e4m3fn"),
                 "qfloat8_e4m3fnuz": (8, "float8_e4m3fnuz"), "qfloat8_e5m2": (8, "float8_e5m2"),
                 "qint4": (4, "uint8"), "qint2": (2, "uint8")}  # (bits, stored dtype: packed for 4 / 2 bits)


def quanto_weight_parts_problem(module: str, qtype: str, tensors: Mapping[str, TensorInfo]) -> str | None:
    """What contradicts the map in one layer's stored parts, from the headers alone (the layer's own shape is
    the loader's to check, Q006): data in the qtype's dtype, one float scale per row of it (4 / 2 bits: the
    packed rows hold that many rows, ``8 // bits`` per byte), ``_shift`` shaped like ``_scale``."""
    bits, dtype = QUANTO_QTYPES[qtype]
    data = tensors.get(f"{module}.weight._data" if bits == 8 else f"{module}.weight._data._data")
    scale, shift = tensors.get(f"{module}.weight._scale"), tensors.get(f"{module}.weight._shift")
    if data is None or scale is None:
        return None  # a missing part: the loader names every missing key
    if data.dtype != dtype:
        return f"{qtype} data {data.name} is {data.dtype}, not {dtype}"
    rows = scale.shape[0] if scale.shape else 0
    packed_rows = rows if bits == 8 else -(-rows // (8 // bits))
    if scale.dtype not in SCALE_DTYPES or len(scale.shape) != len(data.shape) \
            or any(d != 1 for d in scale.shape[1:]) or not data.shape or data.shape[0] != packed_rows:
        return (f"{qtype} scale {scale.dtype} {list(scale.shape)[:4]} is not one float per row of "
                f"{data.name} {list(data.shape)[:4]}")
    if shift is not None and shift.shape != scale.shape:
        return f"{qtype} shift {list(shift.shape)[:4]} is not shaped like its scale {list(scale.shape)[:4]}"
    return None


def quanto_findings(component: str, qmap: Any, headers: Iterable[SafetensorsHeader]) -> list[Finding]:
    """Q003 for an optimum-quanto component whose stored parts contradict its ``quanto_qmap.json`` (the first
    layer that does; a map that is no object of objects is the loader's to refuse)."""
    if not isinstance(qmap, Mapping):
        return []
    tensors = _all_tensors(headers)
    for module, entry in qmap.items():
        qtype = entry.get("weights") if isinstance(entry, Mapping) else None
        if isinstance(qtype, str) and qtype in QUANTO_QTYPES:
            problem = quanto_weight_parts_problem(str(module), qtype, tensors)
            if problem is not None:
                return [finding("Q003", f"{component}/quanto_qmap.json", f"optimum-quanto: {module}: {problem}")]
    return []
