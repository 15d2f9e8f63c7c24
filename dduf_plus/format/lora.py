"""LoRA adapters, read from safetensors headers: the layout a file's tensor names follow, its modules (rank,
shapes, alpha), the components it targets, what its trainer wrote about it, and the ``_lora/`` folder of an
adapter archive. Torch-free: ``dduf validate`` and ``dduf info`` check adapters without loading anything.

The archive layout (docs/lora.md): ``_lora/config.json`` lists the adapters, ``_lora/<name>.safetensors`` holds
each one byte for byte as its trainer wrote it, and model_index.json names the folder under ``_lora`` (an
underscore key, which diffusers and huggingface_hub skip as pipeline configuration, while huggingface_hub's rule
that every folder be named in model_index.json holds)."""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from .findings import Finding, finding
from .index import ADAPTER_PREFIX
from .safetensors_header import SafetensorsHeader, TensorInfo

LORA_FOLDER = ADAPTER_PREFIX.rstrip("/")  # defined with the index, which keeps no tensor table for it
LORA_KEY = LORA_FOLDER  # model_index.json key: huggingface_hub requires every folder be named there
LORA_CONFIG = f"{LORA_FOLDER}/config.json"
LORA_MARKER = ["dduf_plus", "LoraAdapters"]  # its value: [library, class], as components are named
LORA_FORMAT = "dduf_plus.lora"
LORA_METADATA_KEY = "lora_adapter_metadata"  # diffusers' key for the peft config in a LoRA file's metadata
MAX_ADAPTERS = 64  # an archive of a base and its styles: a few; past this, a config is hostile
MAX_RANK = 8192  # real LoRAs: 4..256, full-rank extractions of SDXL layers up to 2,560
MAX_ALPHA_RATIO = 4096.0  # alpha / rank: 1 is common, 2..16 seen; beyond this the adapter swamps the weight
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

# (suffix, role). Longest first: ".lora_A.weight" before ".A.weight"-like tails.
_ROLES = (
    (".lora_A.default.weight", "down"), (".lora_B.default.weight", "up"),
    (".lora_linear_layer.down.weight", "down"), (".lora_linear_layer.up.weight", "up"),
    (".lora_A.weight", "down"), (".lora_B.weight", "up"),
    (".lora_down.weight", "down"), (".lora_up.weight", "up"),
    (".lora.down.weight", "down"), (".lora.up.weight", "up"),
    (".down.weight", "down"), (".up.weight", "up"),
    (".alpha", "alpha"),
)
# Tensors LoRA files carry besides the pairs, which diffusers reads or drops: DoRA magnitudes, biases of
# lora_B, Flux norm "diffs".
_EXTRAS = (".dora_scale", ".lora_magnitude_vector", ".lora_B.bias", ".lora_up.bias", ".diff", ".diff_b",
           ".lora_B.default.bias")

# Key prefixes: (prefix, layout, target). "denoiser" is the pipeline's unet or transformer.
_PREFIXES = (
    ("lora_unet_", "kohya", "denoiser"), ("lora_transformer_", "kohya", "denoiser"),
    ("lora_te1_", "kohya", "text_encoder"), ("lora_te2_", "kohya", "text_encoder_2"),
    ("lora_te3_", "kohya", "text_encoder_3"), ("lora_te_", "kohya", "text_encoder"),
    ("unet.", "diffusers", "unet"), ("transformer.", "diffusers", "transformer"),
    ("text_encoder_2.", "diffusers", "text_encoder_2"), ("text_encoder_3.", "diffusers", "text_encoder_3"),
    ("text_encoder.", "diffusers", "text_encoder"),
    ("diffusion_model.", "bfl", "denoiser"), ("base_model.model.", "peft", "denoiser"),
)
DENOISERS = ("unet", "transformer", "prior", "decoder")
_FLOATS = {"float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"}


class LoraModule(NamedTuple):
    """One adapted layer: ``key`` is its name in the file without the down/up suffix."""

    key: str
    target: str  # the component ("unet", "text_encoder_2") or "denoiser"
    down: TensorInfo | None
    up: TensorInfo | None
    alpha: TensorInfo | None

    @property
    def rank(self) -> int | None:
        return self.down.shape[0] if self.down is not None and self.down.shape else None


class LoraFile(NamedTuple):
    """What a LoRA file's header says: its layout, modules by target, and other tensors."""

    layout: str  # "diffusers", "kohya", "bfl", "peft", "xlabs", "mixed" or "unknown"
    modules: dict[str, LoraModule]
    extras: list[str]  # tensors that are not a pair half or alpha (DoRA magnitudes, biases, norm diffs)
    unknown: list[str]  # tensors of no role at all
    metadata: dict[str, str]

    def targets(self) -> dict[str, list[LoraModule]]:
        out: dict[str, list[LoraModule]] = {}
        for m in self.modules.values():
            out.setdefault(m.target, []).append(m)
        return out


def _role(name: str) -> tuple[str, str] | None:
    for suffix, role in _ROLES:
        if name.endswith(suffix):
            return name[: -len(suffix)], role
    return None


def _prefix(key: str) -> tuple[str, str]:
    for prefix, layout, target in _PREFIXES:
        if key.startswith(prefix):
            return layout, target
    if key.startswith(("double_blocks.", "single_blocks.")):  # XLabs / BFL without a prefix
        return ("xlabs" if ".processor." in key else "bfl"), "denoiser"
    return "unknown", "denoiser"


def read_lora(header: SafetensorsHeader) -> LoraFile:
    """The LoRA structure of a safetensors header (nothing checked; see :func:`lora_file_findings`)."""
    halves: dict[str, dict[str, TensorInfo]] = {}
    extras: list[str] = []
    unknown: list[str] = []
    for name, info in header.tensors.items():
        found = _role(name)
        if found is None:
            (extras if name.endswith(_EXTRAS) else unknown).append(name)
            continue
        key, role = found
        halves.setdefault(key, {})[role] = info
    modules: dict[str, LoraModule] = {}
    layouts: set[str] = set()
    for key, parts in halves.items():
        layout, target = _prefix(key)
        layouts.add(layout)
        modules[key] = LoraModule(key, target, parts.get("down"), parts.get("up"), parts.get("alpha"))
    layout = layouts.pop() if len(layouts) == 1 else ("mixed" if layouts else "unknown")
    metadata = {k: v for k, v in (header.metadata or {}).items() if isinstance(v, str)}
    return LoraFile(layout, modules, sorted(extras), sorted(unknown), metadata)


def alpha_value(raw: bytes, info: TensorInfo) -> float | None:
    """A scalar alpha tensor's value from its bytes (None: not a one-element float tensor)."""
    formats = {"float32": "<f", "float16": "<e", "float64": "<d"}
    if info.dtype == "bfloat16" and len(raw) == 2:
        return float(struct.unpack("<f", b"\0\0" + raw)[0])
    fmt = formats.get(info.dtype)
    if fmt is None or len(raw) != struct.calcsize(fmt):
        return None
    return float(struct.unpack(fmt, raw)[0])


def _pair_problem(m: LoraModule) -> str | None:
    if m.down is None or m.up is None:
        return f"has {'no down' if m.down is None else 'no up'} half"
    down, up = m.down.shape, m.up.shape
    if len(down) not in (2, 4) or len(up) not in (2, 4):
        return f"down {list(down)} / up {list(up)}: a LoRA pair is 2-D (linear) or 4-D (conv)"
    if down[0] != up[1] or not 0 < down[0] <= MAX_RANK:
        return f"down {list(down)} / up {list(up)}: ranks differ or are outside 1..{MAX_RANK}"
    if m.down.dtype not in _FLOATS or m.up.dtype not in _FLOATS:
        return f"dtypes {m.down.dtype}/{m.up.dtype}: LoRA weights are floating point"
    return None


def _alpha_problem(m: LoraModule, read: Callable[[TensorInfo], bytes] | None) -> str | None:
    if m.alpha is None or read is None:
        return None
    if m.alpha.nbytes > 8 or math.prod(m.alpha.shape) != 1:
        return f"alpha has shape {list(m.alpha.shape)}: one number is expected"
    value = alpha_value(read(m.alpha), m.alpha)
    rank = m.rank or 1
    if value is None or not math.isfinite(value) or value <= 0 or value / rank > MAX_ALPHA_RATIO:
        return f"alpha {value} (rank {rank}): a finite number in (0, {MAX_ALPHA_RATIO:g} x rank] is expected"
    return None


def lora_file_findings(lora: LoraFile, entry: str, read: Callable[[TensorInfo], bytes] | None = None
                       ) -> list[Finding]:
    """A002-A004 (and A008) for one adapter file: it holds LoRA pairs, each pair fits, alphas are sane.
    ``read(info)`` gives a tensor's bytes (only alpha scalars are read); without it alphas are not read."""
    if not lora.modules:
        return [finding("A002", entry, "holds no LoRA pair (no lora_A/lora_B, lora_down/lora_up or down/up weights): "
                        "not a LoRA file")]
    out: list[Finding] = []
    if lora.unknown:
        out.append(finding("A002", entry, f"{len(lora.unknown)} tensor(s) of no LoRA role, e.g. "
                           f"{lora.unknown[0]!r}: diffusers' LoRA loaders refuse such files"))
    for m in lora.modules.values():
        why = _pair_problem(m)
        if why is not None:
            out.append(finding("A003", entry, f"module {m.key!r}: {why}"))
            continue
        why = _alpha_problem(m, read)
        if why is not None:
            out.append(finding("A004", entry, f"module {m.key!r}: {why}"))
        if len(out) >= 20:  # one broken layer is enough to refuse; a forged file can have thousands
            break
    return out


def resolve_target(target: str, components: Mapping[str, Any]) -> str | None:
    """The pipeline component an adapter target names (``denoiser``: the pipeline's unet or transformer)."""
    if target != "denoiser":
        return target if target in components else None
    return next((d for d in DENOISERS if d in components), None)


def base_name_map(tensors: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    """{module name: its weight} for a base component's tensors, under both spellings LoRA files use: the
    dotted module path and kohya's underscored one."""
    out: dict[str, TensorInfo] = {}
    for name, info in tensors.items():
        if name.endswith(".weight"):
            module = _plain(name[: -len(".weight")])
            out[module] = info
            out[module.replace(".", "_")] = info
    return out


def _plain(module: str) -> str:
    """A module path without transformers' ``text_model.`` level (transformers 5 saves CLIP without it; LoRA
    files trained on earlier versions name it, and diffusers maps both)."""
    for level in ("text_model.", "text_model_"):
        if module.startswith(level):
            return module[len(level):]
    return module


def _strip_prefix(key: str) -> str:
    for prefix, _layout, _target in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def fit_problem(m: LoraModule, base: TensorInfo) -> str | None:
    """Why the pair does not fit the base weight it adapts (None: it fits)."""
    if m.down is None or m.up is None or len(base.shape) < 2:
        return None
    out_f, in_f = base.shape[0], base.shape[1]
    if m.up.shape[0] != out_f or m.down.shape[1] != in_f:
        return (f"module {m.key!r}: up {list(m.up.shape)} / down {list(m.down.shape)} do not fit the base weight "
                f"{list(base.shape)} (out {out_f}, in {in_f})")
    return None


class TargetCheck(NamedTuple):
    """A header-only check of one adapter against a base component: modules matched by name, unmatched."""

    component: str
    matched: int
    unmatched: list[str]
    problems: list[str]


def check_against_base(modules: list[LoraModule], component: str, base_tensors: Mapping[str, TensorInfo]
                       ) -> TargetCheck:
    """Match ``modules`` (one target) to the base component's weights by name and check their shapes. Names
    of other layouts (SGM's ``input_blocks``, BFL's ``double_blocks``) do not match: diffusers converts them,
    and the loader checks them after its conversion."""
    names = base_name_map(base_tensors)
    matched, unmatched, problems = 0, [], []
    for m in modules:
        stem = _plain(_strip_prefix(m.key))
        base = names.get(stem)
        if base is None:
            if ".processor." not in m.key:  # diffusers' old attention-processor names: converted when loaded
                unmatched.append(m.key)
            continue
        matched += 1
        why = fit_problem(m, base)
        if why is not None:
            problems.append(why)
    return TargetCheck(component, matched, unmatched, problems)


# --- what trainers wrote -------------------------------------------------------------------------------
FAMILY_WORDS = (  # (family, words in metadata) — first match wins, so more specific families first
    ("sdxl", ("xl",)), ("sd3", ("sd3", "stable-diffusion-3", "stable-diffusion-v3")), ("flux", ("flux",)),
    ("sd", ("sd_v1", "sd_v2", "stable-diffusion-v1", "stable-diffusion-v2", "sd1", "sd2", "v1-5", "v2-1")),
)
METADATA_SHOWN = ("modelspec.title", "modelspec.architecture", "modelspec.author", "modelspec.description",
                  "modelspec.trigger_phrase", "ss_base_model_version", "ss_sd_model_name", "ss_output_name",
                  "ss_network_module", "ss_network_dim", "ss_network_alpha", "ss_tag_frequency")


def metadata_family(metadata: Mapping[str, str]) -> tuple[str, str] | None:
    """(family, the metadata key that says so) from ModelSpec / kohya metadata, when it names one."""
    for key in ("modelspec.architecture", "ss_base_model_version"):
        value = metadata.get(key, "").lower()
        for family, words in FAMILY_WORDS:
            if value and any(w in value for w in words):
                return family, key
    return None


def pipeline_family(class_name: str | None) -> str | None:
    """The LoRA family of a diffusers pipeline class (``StableDiffusionXLPipeline`` -> ``sdxl``)."""
    name = class_name or ""
    for prefix, family in (("StableDiffusionXL", "sdxl"), ("StableDiffusion3", "sd3"), ("Flux", "flux"),
                           ("StableDiffusion", "sd")):
        if name.startswith(prefix):
            return family
    return None


def trigger_words(metadata: Mapping[str, str]) -> list[str]:
    """Trigger phrases a trainer recorded (ModelSpec ``modelspec.trigger_phrase``; comma separated)."""
    raw = metadata.get("modelspec.trigger_phrase", "")
    return [w.strip() for w in raw.split(",") if w.strip()][:16]


# --- the _lora/config.json of an archive --------------------------------------------------------------
class AdapterEntry(NamedTuple):
    name: str
    file: str  # entry name: _lora/<name>.safetensors
    weight: float
    record: dict[str, Any]


def config_findings(config: object, entries: Mapping[str, Any]) -> tuple[list[AdapterEntry], list[Finding]]:
    """A001: ``_lora/config.json`` is an object whose ``adapters`` list names files the archive holds, with
    plain unique names and finite weights."""
    if not isinstance(config, dict) or not isinstance(config.get("adapters"), list):
        return [], [finding("A001", LORA_CONFIG, "must be an object with an \"adapters\" list")]
    adapters, problems, seen = [], [], set()
    raw = config["adapters"]
    if len(raw) > MAX_ADAPTERS:
        return [], [finding("A001", LORA_CONFIG, f"{len(raw)} adapters: at most {MAX_ADAPTERS}")]
    for i, item in enumerate(raw):
        where = f"adapter {i}"
        if not isinstance(item, dict):
            problems.append(finding("A001", LORA_CONFIG, f"{where} is not an object"))
            continue
        name, weight = item.get("name"), item.get("weight", 1.0)
        file = f"{LORA_FOLDER}/{item.get('file')}"
        if not isinstance(name, str) or not ADAPTER_NAME.match(name) or name in seen:
            problems.append(finding("A001", LORA_CONFIG, f"{where}: name {name!r} is not a plain, unique name"))
        elif not isinstance(item.get("file"), str) or "/" in item["file"] or file not in entries \
                or not file.endswith(".safetensors"):
            problems.append(finding("A001", LORA_CONFIG, f"adapter {name!r}: file {item.get('file')!r} is not a "
                                    f".safetensors file in {LORA_FOLDER}/"))
        elif isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or abs(weight) > 1e4:
            problems.append(finding("A001", LORA_CONFIG, f"adapter {name!r}: weight {weight!r} is not a finite "
                                    "number"))
        else:
            seen.add(name)
            adapters.append(AdapterEntry(name, file, float(weight), item))
    return adapters, problems


def lora_config(adapters: list[dict[str, Any]], version: str) -> dict[str, Any]:
    """``_lora/config.json``'s object for ``adapters`` (each {name, file, weight, layout, targets, ...})."""
    return {"_class_name": LORA_MARKER[1], "_dduf_plus_version": version, "format": LORA_FORMAT,
            "adapters": adapters}


def archive_findings(model_index: Mapping[str, Any], entries: Mapping[str, Any],
                     headers: Mapping[str, SafetensorsHeader], config: object,
                     read: Callable[[str, TensorInfo], bytes] | None) -> list[Finding]:
    """Every adapter rule for an archive's ``_lora/`` (``config``: its parsed config.json): A001 for the
    config, A002-A004 per file (``read(entry, info)`` gives a tensor's bytes: alphas), A005 targets the base's
    model_index.json names, A006 against base components the archive stores (a referenced one is checked
    when the pipeline loads), A007 the trainer's metadata against the pipeline's class."""
    from .structure import component_specs

    adapters, out = config_findings(config, entries)
    components = {n: c for n, c in component_specs(model_index).items() if c[0] is not None}
    mine = pipeline_family(model_index.get("_class_name") if isinstance(model_index.get("_class_name"), str) else None)
    for a in adapters:
        header = headers.get(a.file)
        if header is None:
            continue  # S001-S011 say why
        lora = read_lora(header)
        reader: Callable[[TensorInfo], bytes] | None = None
        if read is not None:
            def reader(info: TensorInfo, entry: str = a.file) -> bytes:
                assert read is not None
                return read(entry, info)
        out.extend(lora_file_findings(lora, a.file, reader))
        for target, modules in sorted(lora.targets().items()):
            component = resolve_target(target, components)
            if component is None:
                out.append(finding("A005", a.file, f"{len(modules)} module(s) target {target} (e.g. "
                                   f"{modules[0].key!r}), which model_index.json does not name as a model"))
                continue
            stored = {n: h for n, h in headers.items() if n.startswith(component + "/")}
            if stored and component not in (model_index.get("_dduf_plus_references") or {}):
                tensors = {k: v for h in stored.values() for k, v in h.tensors.items()}
                check = check_against_base(modules, component, tensors)
                out.extend(finding("A006", a.file, why) for why in check.problems[:5])
                if lora.layout == "diffusers":
                    out.extend(finding("A006", a.file, f"module {key!r} is not in {component}")
                               for key in check.unmatched[:5])
        said = metadata_family(lora.metadata)
        if said is not None and mine is not None and said[0] != mine:
            out.append(finding("A007", a.file, f"its {said[1]} ({lora.metadata[said[1]][:80]!r}) names {said[0]}; "
                               f"the pipeline is {model_index.get('_class_name')} ({mine})"))
    return out


def describe_adapters(config: object, entries: Mapping[str, Any], headers: Mapping[str, SafetensorsHeader]
                      ) -> list[dict[str, Any]]:
    """``dduf info``'s view of an archive's adapters (headers only): name, weight, layout, bytes, base, targets
    {component: {modules, ranks}}, and the trainer's metadata (ModelSpec title, architecture, trigger words)."""
    adapters, _problems = config_findings(config, entries)
    out = []
    for a in adapters:
        header = headers.get(a.file)
        lora = read_lora(header) if header is not None else None
        targets: dict[str, Any] = {}
        for target, modules in sorted((lora.targets() if lora else {}).items()):
            targets[target] = {"modules": len(modules), "ranks": sorted({m.rank for m in modules if m.rank})}
        recorded = a.record.get("targets")
        if isinstance(recorded, dict) and all(isinstance(v, dict) for v in recorded.values()):
            # the config names components ("unet" for kohya's lora_unet_): prefer its names when counts agree
            if sorted(v.get("modules") for v in recorded.values()) == sorted(v["modules"] for v in targets.values()):
                targets = {str(k): {"modules": v.get("modules"), "ranks": v.get("ranks")} for k, v in recorded.items()}
        metadata = {k: v[:200] for k, v in (lora.metadata if lora else {}).items() if k in METADATA_SHOWN}
        base = a.record.get("base")
        out.append({"name": a.name, "file": a.file, "weight": a.weight, "layout": lora.layout if lora else None,
                    "bytes": getattr(entries.get(a.file), "length", None), "base": base if isinstance(base, str) else None,
                    "targets": targets, "metadata": metadata, "trigger_words": trigger_words(metadata)})
    return out
