"""The dtype names that pack-time conversion accepts (``dduf pack --dtype``, ``pack(dtype=...)``) and the
argument's grammar. Torch-free, so the command line refuses a bad value before it imports torch
(:mod:`dduf_plus.packing.convert` uses these names too)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from .assignments import parse_assignments
from .errors import DDUFPackError

FP8 = ("float8_e4m3fn", "float8_e5m2")
STORAGE_DTYPES = ("float16", "bfloat16", "float32") + FP8
COMPUTE_DTYPES = ("float16", "bfloat16", "float32")
ALIASES = {
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "f16": "float16", "fp32": "float32",
    "float": "float32", "f32": "float32", "fp8": "float8_e4m3fn", "float8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
}
DEFAULT_KEY = "default"


class Target(NamedTuple):
    """Where a component's floating tensors go: ``storage`` dtype, and for fp8 the ``compute`` dtype
    (None: the component's dominant source dtype)."""

    storage: str
    compute: str | None = None


def canonical(name: str) -> str:
    """``"BF16"`` / ``"torch.bfloat16"`` -> ``"bfloat16"``; unknown names come back lower-cased."""
    name = name.strip().lower().removeprefix("torch.")
    return ALIASES.get(name, name)


def parse_target(text: str, what: str) -> Target:
    """``"bfloat16"`` / ``"bf16"`` / ``"float8_e4m3fn:float16"`` -> :class:`Target`; ``what`` is the argument
    as the user spelled it (``--dtype unet=fp8``), named in the error."""
    storage_text, _, compute_text = text.partition(":")
    storage = canonical(storage_text)
    if storage not in STORAGE_DTYPES:
        raise DDUFPackError(f"{what}: {storage_text.strip()!r} is not a storage dtype (one of "
                            f"{', '.join(STORAGE_DTYPES)}, or an alias such as bf16, fp16, fp8)")
    compute = canonical(compute_text) if compute_text else None
    if compute is not None:
        if storage not in FP8:
            raise DDUFPackError(f"{what}: a ':compute' dtype only applies to float8 storage")
        if compute not in COMPUTE_DTYPES:
            raise DDUFPackError(f"{what}: {compute_text.strip()!r} is not a compute dtype (one of "
                                f"{', '.join(COMPUTE_DTYPES)})")
    return Target(storage, compute)


def parse_dtype_args(values: Iterable[str]) -> dict[str, str]:
    """CLI spelling -> mapping, every value checked: ``["bfloat16", "unet=float8_e4m3fn:float16"]`` ->
    ``{"default": "bfloat16", "unet": "float8_e4m3fn:float16"}``. A component (or the default) named twice
    is refused (:func:`dduf_plus.assignments.parse_assignments`, the parser ``--ref`` uses too)."""
    out = parse_assignments(values, "--dtype", default_key=DEFAULT_KEY, value_name="DTYPE", error=DDUFPackError)
    for key, text in out.items():
        parse_target(text, f"--dtype {text if key == DEFAULT_KEY else f'{key}={text}'}")
    return out
