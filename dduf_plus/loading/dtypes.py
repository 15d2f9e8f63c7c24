"""Which dtype each tensor of a component is loaded in: ``torch_dtype="auto"`` and explicit requests.

The rule (docs/loading.md repeats it):

1. Only floating tensors take part; integer/bool tensors always keep their dtype. fp8 tensors are
   *storage*: they keep their dtype and the model gets diffusers' layerwise casting (fp8 storage,
   ``compute_dtype`` compute); the dduf_plus index may declare ``storage_dtype``/``compute_dtype``.
2. The component dtype ``D``:
   - explicit request (``torch.float16``, ``"bfloat16"``, a per-component dict entry): that dtype;
   - ``"auto"``: the dtype holding most bytes among the component's floating, non-fp8 tensors, leaving
     out fp32 tensors of the modules the class keeps in fp32 (so an fp16 model saved with fp32
     norms is fp16); a tie goes to the wider dtype.
3. Each floating tensor is then loaded in float32 if it belongs to a module the class keeps in fp32
   (diffusers: ``_keep_in_fp32_modules``, any ``D``; transformers: ``_keep_in_fp32_modules`` when ``D`` is
   fp16, ``_keep_in_fp32_modules_strict`` when ``D`` is fp16 or bf16, as transformers itself decides),
   else in ``D``. A tensor already in its target dtype is used as it is (a view of the archive: no copy).

So "auto" on a component saved in one dtype (or saved the way its library saves mixed models) converts
nothing."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import DDUFLoadError
from ..format import spec

if TYPE_CHECKING:  # pragma: no cover
    import torch

AUTO = "auto"
_ALIASES = {
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp64": "float64", "double": "float64",
    "fp8": "float8_e4m3fn", "float8": "float8_e4m3fn",
}
_WIDTH = {"float64": 64, "float32": 32, "bfloat16": 16, "float16": 16}  # tie-break order: wider first


def parse_dtype(value: Any, where: str = "dtype") -> torch.dtype | str:
    """A ``torch.dtype`` from a dtype, ``"bfloat16"``, ``"torch.float16"``, ``"fp16"``...; ``"auto"`` stays."""
    import torch

    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        name = value.strip().removeprefix("torch.").lower()
        if name == AUTO:
            return AUTO
        name = _ALIASES.get(name, name)
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            return dtype
    raise DDUFLoadError(f"{where}={value!r} is not a floating torch dtype, a dtype name or 'auto'")


def resolve_request(torch_dtype: Any, dtype: Any) -> torch.dtype | str | dict[str, torch.dtype | str]:
    """Merge ``torch_dtype=`` and its alias ``dtype=`` into "auto", one dtype, or {component: dtype}."""
    if dtype is not None and torch_dtype not in (None, AUTO) and dtype != torch_dtype:
        raise DDUFLoadError(f"torch_dtype={torch_dtype!r} and dtype={dtype!r} disagree; pass one of them")
    value, arg = (dtype, "dtype") if dtype is not None else (torch_dtype, "torch_dtype")  # messages name it
    if value is None:
        return AUTO
    if isinstance(value, Mapping):
        return {str(k): parse_dtype(v, f"{arg}[{k!r}]") for k, v in value.items()}
    return parse_dtype(value, arg)


def requested_for(request: torch.dtype | str | Mapping[str, Any], component: str) -> torch.dtype | str:
    """The request for one component; a dict without the component nor "default" means "auto"."""
    if isinstance(request, Mapping):
        return request.get(component, request.get("default", AUTO))
    return request


# --- keep-in-fp32 declarations ---------------------------------------------------------------------------
def keep_fp32_matcher(model_cls: type[Any] | None, library: str, dtype: torch.dtype) -> Callable[[str], bool]:
    """Whether a tensor name belongs to a module ``model_cls`` keeps in fp32 when loaded in ``dtype``,
    matched the way the class's library matches it."""
    import torch

    if model_cls is None:
        return lambda name: False
    if library == "transformers":
        patterns: list[str] = []
        if getattr(model_cls, "_keep_in_fp32_modules", None) and dtype == torch.float16:
            patterns += list(model_cls._keep_in_fp32_modules)
        strict = getattr(model_cls, "_keep_in_fp32_modules_strict", None)
        if strict and dtype in (torch.float16, torch.bfloat16):
            patterns += list(strict)
        if not patterns:
            return lambda name: False
        regex = re.compile("|".join(p.replace("*", ".*") for p in patterns))  # transformers: regex search
        return lambda name: regex.search(name) is not None
    modules = getattr(model_cls, "_keep_in_fp32_modules", None) or []
    if isinstance(modules, str):
        modules = [modules]
    if not modules:
        return lambda name: False
    wanted = frozenset(modules)
    return lambda name: not wanted.isdisjoint(name.split("."))  # diffusers: a module name in the path


def declared_fp32(model_cls: type[Any] | None, library: str) -> Callable[[str], bool]:
    """Every module the class might keep in fp32, whatever the dtype (used to pick "auto"'s dtype)."""
    import torch

    matchers = [keep_fp32_matcher(model_cls, library, d) for d in (torch.float16, torch.bfloat16)]
    return lambda name: any(m(name) for m in matchers)


# --- the plan ------------------------------------------------------------------------------------------------
class DtypePlan(NamedTuple):
    """How one component's tensors are loaded."""

    dtype: torch.dtype  # the component's dtype (what ``model.dtype`` reports; compute dtype under fp8)
    storage_dtype: torch.dtype | None  # fp8 storage: tensors in it stay, layerwise casting is applied
    keep_fp32: Callable[[str], bool]
    converted: int  # how many tensors change dtype (0: a zero-copy load on CPU)

    def dtype_for(self, name: str, tensor: torch.Tensor) -> torch.dtype | None:
        """Target dtype of one tensor, or None to keep it as stored (materialize's ``dtype_for``)."""
        return self.target(name, tensor.dtype)

    def target(self, name: str, stored: torch.dtype) -> torch.dtype | None:
        import torch

        if not stored.is_floating_point or stored == self.storage_dtype:
            return None
        want = torch.float32 if self.keep_fp32(name) else self.dtype
        return None if want == stored else want


def plan_dtypes(
    request: torch.dtype | str,
    metadata: Mapping[str, tuple[str, tuple[int, ...], int]],
    *,
    model_cls: type[Any] | None,
    library: str,
    declared: Mapping[str, Any] | None = None,
    where: str = "component",
) -> DtypePlan:
    """Apply the rule to one component. ``metadata`` is {tensor: (dtype name, shape, nbytes)};
    ``declared`` is the component's record in the dduf_plus index (``storage_dtype``/``compute_dtype``)."""
    import torch

    declared = declared or {}
    storage = _declared_dtype(declared.get("storage_dtype"), where)
    compute = _declared_dtype(declared.get("compute_dtype"), where)
    fp8_bytes: dict[str, int] = {}
    explained = declared_fp32(model_cls, library)
    candidates: dict[str, int] = {}
    every: dict[str, int] = {}
    for name, (dtype_name, _shape, nbytes) in metadata.items():
        info = spec.DTYPE_BY_TORCH.get(dtype_name)
        if info is None or not info.floating:
            continue
        if dtype_name in spec.FP8_TORCH_NAMES:
            fp8_bytes[dtype_name] = fp8_bytes.get(dtype_name, 0) + nbytes
            continue
        every[dtype_name] = every.get(dtype_name, 0) + nbytes
        if not (dtype_name == "float32" and explained(name)):
            candidates[dtype_name] = candidates.get(dtype_name, 0) + nbytes
    if storage is None and fp8_bytes:
        storage = getattr(torch, max(sorted(fp8_bytes), key=lambda k: fp8_bytes[k]))
    if request != AUTO:
        dtype = request
    elif compute is not None and storage is not None:
        dtype = compute
    else:
        pool = candidates or every
        if pool:
            best = max(sorted(pool), key=lambda k: (pool[k], _WIDTH.get(k, 0)))
            dtype = getattr(torch, best)
        else:
            dtype = compute or (torch.bfloat16 if storage is not None else torch.float32)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or str(dtype).removeprefix("torch.") in spec.FP8_TORCH_NAMES:
        raise DDUFLoadError(f"{where}: cannot load in {dtype} (fp8 is a storage dtype; pick a compute dtype)")
    keep = keep_fp32_matcher(model_cls, library, dtype)
    plan = DtypePlan(dtype, storage, keep, 0)
    converted = sum(
        1 for name, (dtype_name, _s, _n) in metadata.items()
        if (t := getattr(torch, dtype_name, None)) is not None and isinstance(t, torch.dtype)
        and plan.target(name, t) is not None
    )
    return plan._replace(converted=converted)


def _declared_dtype(value: Any, where: str) -> torch.dtype | None:
    if value is None:
        return None
    import torch

    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise DDUFLoadError(f"{where}: the dduf_plus index declares an unknown dtype {value!r}")
    return dtype


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")
