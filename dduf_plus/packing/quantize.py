"""Quantize at pack time: ``dduf pack SRC --quantize unet=bnb-nf4`` (Python: ``pack(..., quantize={"unet": "bnb-nf4"})``).

The component is quantized by diffusers' own quantizer, fed from the full-precision source a batch of tensors at a
time (at most :data:`BATCH_BYTES`, 32 MiB, of source tensors in memory, each read with ``pread``: no mmap keeps pages
resident), and written as its ``save_pretrained`` would write it
(:func:`~dduf_plus.torchkit.quant_state.backend_state`): the same tensors, safetensors ``__metadata__`` and
``config.json`` (with its ``quantization_config``) as quantizing with diffusers
(``from_pretrained(quantization_config=...)``) then packing the saved folder. Peak memory is the quantized
component plus one batch, never the whole component in full precision.

The steps are diffusers' ``from_pretrained`` ones, in order: the model on the meta device, the quantizer's
``update_torch_dtype`` (each backend's default dtype for the unquantized layers: bitsandbytes float16, torchao
bfloat16, SDNQ as stored; ``--dtype`` for that component overrides it, as ``torch_dtype=`` does),
``preprocess_model`` (which layers become quantized: ``modules_to_not_convert``, ``_keep_in_fp32_modules``),
``load_model_dict_into_meta`` (cast, quantize per parameter), ``postprocess_model``. bitsandbytes runs on the CPU
here; only diffusers' "No GPU found" environment check is not called.

Scheme names are each backend's own words, prefixed by the backend: ``bnb-nf4``, ``bnb-fp4``, ``bnb-int8``
(bitsandbytes), ``torchao-int8`` (torchao ``Int8WeightOnlyConfig``), ``sdnq-int8``, ``sdnq-uint4``,
``sdnq-float8_e4m3fn`` (SDNQ ``weights_dtype``). The names are checked torch-free (:func:`parse_quantize`)."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..assignments import PackNameError, check_names, closest, parse_assignments
from ..errors import DDUFPackError
from ..format.json_budget import read_json
from ..format.pack import EntrySource, FileRegion, FolderPlan
from ..format.structure import component_specs
from ..format.weights import classify, weights_name
from ..format.writer import open_source_file
from ..torchkit.backend_import import offline_imports

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)

SCHEMES: dict[str, str] = {  # --quantize name -> what it is, in the backend's words
    "bnb-nf4": "bitsandbytes 4-bit NF4 (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'))",
    "bnb-fp4": "bitsandbytes 4-bit FP4 (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='fp4'))",
    "bnb-int8": "bitsandbytes LLM.int8 (BitsAndBytesConfig(load_in_8bit=True))",
    "torchao-int8": "torchao int8 weight-only (TorchAoConfig(Int8WeightOnlyConfig()))",
    "sdnq-int8": "SDNQ int8 weights (SDNQConfig(weights_dtype='int8'))",
    "sdnq-uint4": "SDNQ packed uint4 weights (SDNQConfig(weights_dtype='uint4'))",
    "sdnq-float8_e4m3fn": "SDNQ fp8 e4m3 weights (SDNQConfig(weights_dtype='float8_e4m3fn'))",
    "quanto-int8": "optimum-quanto int8 weights (QuantoConfig(weights_dtype='int8'))",
    "quanto-float8": "optimum-quanto fp8 weights (QuantoConfig(weights_dtype='float8'))",
}
ALIASES = {"bitsandbytes-nf4": "bnb-nf4", "bitsandbytes-fp4": "bnb-fp4", "bitsandbytes-int8": "bnb-int8",
           "torchao-int8_weight_only": "torchao-int8", "torchao-int8wo": "torchao-int8", "sdnq-fp8": "sdnq-float8_e4m3fn"}
BATCH_BYTES = 32 << 20  # source tensors handed to diffusers' loader at once


def scheme_name(text: str, what: str = "--quantize ") -> str:
    """The canonical scheme name for ``text`` (case-insensitive, aliases accepted).

    Raises:
        PackNameError: an unknown scheme, with the nearest known one and the list.
    """
    key = text.strip().lower()
    key = ALIASES.get(key, key)
    if key in SCHEMES:
        return key
    near = closest(key, [*SCHEMES, *ALIASES])
    near = ALIASES.get(near, near) if near else None
    hint = f" (did you mean {near}?)" if near else ""
    raise PackNameError(f"{what}{text}: not a quantization scheme{hint}; known: {', '.join(SCHEMES)}",
                        names=[text], known=list(SCHEMES), suggestions={text: near})


def parse_quantize(values: Iterable[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """``["unet=bnb-nf4"]`` or ``{"unet": "bnb-nf4"}`` -> ``{"unet": "bnb-nf4"}``, every scheme checked
    (torch-free). Each entry names its component: quantizing every component at once is not offered.

    Raises:
        PackNameError: no component named, or an unknown scheme.
    """
    if values is None:
        return {}
    pairs = dict(values) if isinstance(values, Mapping) else parse_assignments(
        values, "--quantize", default_key="", value_name="SCHEME", error=PackNameError)
    if "" in pairs:
        raise PackNameError(f"--quantize {pairs['']}: name the component (--quantize unet={pairs['']})")
    # a diffusers config object (BitsAndBytesConfig(...), SDNQConfig(...)) is taken as given (Python API)
    return {name: scheme_name(scheme, f"--quantize {name}=") if isinstance(scheme, str) else scheme
            for name, scheme in pairs.items()}


def quantization_config(scheme: str) -> Any:
    """The diffusers config object ``from_pretrained(quantization_config=...)`` takes for ``scheme``."""
    backend, _, kind = scheme.partition("-")
    if backend == "bnb":
        from diffusers import BitsAndBytesConfig

        if kind == "int8":
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind)
    if backend == "torchao":
        from diffusers import TorchAoConfig
        from torchao.quantization import Int8WeightOnlyConfig

        return TorchAoConfig(Int8WeightOnlyConfig())
    if backend == "quanto":
        from diffusers import QuantoConfig

        return QuantoConfig(weights_dtype=kind)
    from diffusers import SDNQConfig

    return SDNQConfig(weights_dtype=kind)


_BACKEND_MODULE = {"bnb": "bitsandbytes", "torchao": "torchao", "sdnq": "sdnq", "quanto": "optimum.quanto"}


def _require(scheme: str, component: str) -> None:
    import importlib.util

    module = _BACKEND_MODULE.get(scheme.partition("-")[0])
    if module is not None and importlib.util.find_spec(module) is None:
        raise DDUFPackError(f"--quantize {component}={scheme}: {module} is not installed here; install it with: "
                            "pip install 'dduf_plus[quant]'")


# --- the torch side ---------------------------------------------------------------------------------------------
@offline_imports  # diffusers and the backend are imported here: no Hub request (backend_import)
def quantize_sources(plan: FolderPlan, quantize: Mapping[str, Any], *, dtype: Any = None
                     ) -> tuple[list[EntrySource], dict[str, dict[str, Any]]]:
    """``plan``'s sources with each component ``quantize`` names replaced by its quantized weights entry and
    config.json, and the index record of each (as ``dduf pack`` gives diffusers' saved folder).
    ``dtype``: ``pack``'s ``dtype=`` (a name or a per-component dict): the ``torch_dtype`` of that component.

    Raises:
        PackNameError: a name that is not a component.
        DDUFPackError: a component that is not a diffusers model, already quantized, or its backend missing.
    """
    specs = component_specs(plan.model_index)
    check_names(quantize, specs, what="--quantize", where="the pipeline", error=PackNameError)
    sources = list(plan.sources)
    records: dict[str, dict[str, Any]] = {}
    for component, scheme in quantize.items():
        if isinstance(scheme, str):
            _require(scheme, component)
        mine = [s for s in sources if s.name.startswith(f"{component}/")]
        new, record = quantize_component(component, specs[component], mine, scheme, _dtype_for(dtype, component))
        sources = [s for s in sources if s not in mine] + new
        if record:
            records[component] = record
    return sources, records


def _dtype_for(dtype: Any, component: str) -> Any:
    from ..dtype_names import DEFAULT_KEY

    if isinstance(dtype, Mapping):
        return dtype.get(component, dtype.get(DEFAULT_KEY))
    return dtype


def quantize_component(component: str, class_spec: Any, sources: list[EntrySource], scheme: Any,
                       dtype: Any) -> tuple[list[EntrySource], dict[str, Any] | None]:
    """One component quantized: (its new sources: config.json, the weights entry, its other files; index record)."""
    from ..format import quant_rules
    from ..format.quantization import backend_of
    from ..format.quantization import quantization_config as stored_quantization
    from ..torchkit.quant_state import backend_state
    from ..torchkit.tensor_stream import tensor_source

    config_source = next((s for s in sources if s.name == f"{component}/config.json"), None)
    weights = [s for s in sources if s.name.endswith(".safetensors") and s.file is not None and s.header is not None]
    if config_source is None or config_source.file is None or not weights:
        raise DDUFPackError(f"--quantize {component}: it has no config.json and safetensors weights to quantize")
    config = read_json(config_source.read_bytes(), config_source.name, where=f"--quantize {component}")  # D007/D013
    if not isinstance(config, dict):
        raise DDUFPackError(f"--quantize {component}: D007 {config_source.name} is not a JSON object")
    if stored_quantization(config) is not None:
        raise DDUFPackError(f"--quantize {component}: it is already quantized "
                            f"({backend_of(config)}); pack it as it is")
    model = quantized_model(component, class_spec, config, weights, scheme, dtype)
    state, metadata = backend_state(component, model)
    stored = classify(weights[0].name.rsplit("/", 1)[-1])  # fp16 of unet/diffusion_pytorch_model.fp16.safetensors
    variant = stored.variant if stored is not None else None
    entry = tensor_source(f"{component}/{weights_name('diffusers', variant)}", state, metadata=metadata, what=component)
    with tempfile.TemporaryDirectory(prefix="dduf-quantize-") as tmp:
        model.save_config(tmp)  # ModelMixin.save_pretrained's config step: quantization_config included
        config_bytes = (Path(tmp) / "config.json").read_bytes()
    try:
        record = quant_rules.index_record(json.loads(config_bytes), [entry.header] if entry.header else [])
    except ValueError as e:  # QuantError: what validate would refuse in the archive
        raise DDUFPackError(f"--quantize {component}: {getattr(e, 'code', 'Q001')}: {e}") from None
    others = [s for s in sources if s is not config_source and s not in weights
              and not s.name.endswith(".safetensors.index.json")]
    return [*others, EntrySource(config_source.name, data=config_bytes), entry], record


def quantized_model(component: str, class_spec: Any, config: Mapping[str, Any], weights: list[EntrySource],
                    scheme: Any, dtype: Any) -> Any:
    """The model diffusers' ``from_pretrained(folder, quantization_config=..., torch_dtype=dtype)`` builds, fed one
    batch of source tensors at a time (see the module docstring)."""
    from diffusers.models.model_loading_utils import load_model_dict_into_meta
    from diffusers.quantizers import DiffusersAutoQuantizer

    from ..torchkit.meta_model import is_diffusers_model, meta_model
    from .convert import import_class

    library, class_name = class_spec
    cls = import_class(library, class_name)
    if cls is None or not is_diffusers_model(cls):
        raise DDUFPackError(f"--quantize {component}: {library}.{class_name} is not a diffusers model (transformers "
                            "components: quantize them with transformers and pack the saved folder)")
    qconfig = quantization_config(scheme) if isinstance(scheme, str) else scheme
    quantizer = DiffusersAutoQuantizer.from_config(qconfig, pre_quantized=False)
    torch_dtype = _compute_dtype(component, dtype)
    if _method(quantizer) != "bitsandbytes":  # bitsandbytes' check only says "No GPU found": it runs on the CPU
        quantizer.validate_environment(torch_dtype=torch_dtype, device_map=None)  # (torchao sets its state here)
    torch_dtype = quantizer.update_torch_dtype(torch_dtype)
    stored = {n: (i.dtype, i.shape, i.nbytes) for s in weights if s.header for n, i in s.header.tensors.items()}
    model = meta_model(cls, config, component, stored)
    assert model is not None  # a diffusers model class
    model.register_to_config(quantization_config=qconfig)  # type: ignore[operator]  # as from_pretrained's config
    keep = list(cls._keep_in_fp32_modules or []) if getattr(quantizer, "use_keep_in_fp32_modules", False) else []
    device_map: dict[str, Any] = {"": "cpu"}
    quantizer.preprocess_model(model=model, device_map=device_map, keep_in_fp32_modules=keep)
    fix: Any = getattr(model, "_fix_state_dict_keys_on_load", None)  # from_pretrained's key renames
    for batch in _batches(weights):
        if callable(fix):
            fix(batch)
        load_model_dict_into_meta(model, batch, dtype=torch_dtype,  # type: ignore[arg-type]  # an OrderedDict in its hints
                                  hf_quantizer=quantizer, device_map=dict(device_map), keep_in_fp32_modules=keep,
                                  unexpected_keys=[])
        batch.clear()  # the full-precision source of the layers just quantized goes now, before the next read
        _trim_heap()
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if missing:
        raise DDUFPackError(f"--quantize {component}: the source stores no {', '.join(missing[:3])}"
                            f"{' ...' if len(missing) > 3 else ''} ({len(missing)} tensors of the model missing)")
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    register: Any = model.register_to_config
    register(_pre_quantization_dtype=torch_dtype)  # from_pretrained's; save_config drops it
    return model.eval()


def _method(quantizer: Any) -> str:
    method = quantizer.quantization_config.quant_method
    return str(getattr(method, "value", method))


def _batches(weights: list[EntrySource]) -> Iterator[dict[str, torch.Tensor]]:
    """The source tensors, in file order, in dicts of about :data:`BATCH_BYTES` (one bigger tensor alone)."""
    batch: dict[str, torch.Tensor] = {}
    size = 0
    for source in weights:
        assert source.file is not None and source.header is not None
        for name, tensor in _read_tensors(source.file, source.header):
            batch[name] = tensor
            size += tensor.nbytes
            if size >= BATCH_BYTES:
                yield batch
                batch, size = {}, 0
    if batch:
        yield batch


def _read_tensors(file: Path | FileRegion, header: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a safetensors file (or of an archive's entry: a region of its file), read (``pread``: nothing
    of the file stays mapped) into its own anonymous mapping: freed, it goes back to the system at once, whatever
    malloc's thresholds."""
    import mmap

    import torch

    path, base = (file.path, file.offset) if isinstance(file, FileRegion) else (file, 0)
    fd = open_source_file(str(file), path)[0]  # a regular file only, never waited on
    try:
        for info in sorted(header.tensors.values(), key=lambda i: i.begin):
            buffer = mmap.mmap(-1, max(info.nbytes, 1))
            with memoryview(buffer) as whole:
                _pread_into(fd, whole, info.nbytes, base + header.data_start + info.begin, f"{file}: tensor {info.name}")
            dtype = getattr(torch, info.dtype)
            tensor = torch.frombuffer(buffer, dtype=dtype) if info.nbytes else torch.empty(0, dtype=dtype)
            yield info.name, tensor.reshape(info.shape)
    finally:
        os.close(fd)


def _trim_heap() -> None:
    """Give the heap's free space back to the system (glibc ``malloc_trim``; elsewhere nothing). The backends'
    per-layer temporaries (float32 copies, packed halves) land on the heap once glibc's adaptive mmap threshold
    has grown; freed, they stayed resident: quantizing a 628 MB fp16 UNet to nf4 (483 MB) peaked at 1,018 MB
    over the baseline without this, 509 MB with it."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):  # not glibc
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None


def _pread_into(fd: int, view: memoryview, size: int, offset: int, what: str) -> None:
    at = 0
    while at < size:
        got = os.preadv(fd, [view[at:size]], offset + at)
        if got <= 0:
            raise DDUFPackError(f"{what}: the file ends inside it")
        at += got


def _compute_dtype(component: str, dtype: Any) -> torch.dtype | None:
    """``pack``'s ``dtype`` for a quantized component: the ``torch_dtype`` of its unquantized tensors."""
    import torch

    from .convert import COMPUTE_DTYPES, parse_target

    if dtype is None:
        return None
    target = parse_target(dtype, f"--dtype {component}")
    if target.storage not in COMPUTE_DTYPES or target.compute:
        raise DDUFPackError(f"--dtype {component}={target.storage}: a quantized component takes a compute dtype "
                            f"({', '.join(COMPUTE_DTYPES)}) for its unquantized layers, as torch_dtype= does")
    return getattr(torch, target.storage)
