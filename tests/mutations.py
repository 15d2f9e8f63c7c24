"""Structured mutations of small valid DDUF archives, and the commands they are run through: the engine
behind tests/test_fuzz_loader.py and bench/fuzz_loader.py.

Byte-level fuzzing (tests/test_validate_property.py, tests/fuzz/fuzz_validate.py) mostly stops at the
ZIP parser: a flipped byte breaks a CRC or a record and the archive is refused before anything is built.
These mutations edit *values* instead: JSON values in ``model_index.json``, component configs, tokenizer
files, ``_dduf_plus_references`` and the dduf_plus index; dtypes, shapes and offsets in safetensors
headers (kept parseable); which entries exist. The archive is then written again with ``DDUFWriter``
(``make_hostile.write_valid``: a consistent index, CRCs, alignment), so it passes the structural checks and
the loader really runs on it. A few raw byte edits on top keep the ZIP level in the mix.

Every input is a pure function of ``(seed, number)``: a finding is reproduced by its two numbers.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import re
import shutil
import signal
import struct
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from conftest import PIPELINES, load_make_hostile
from dduf_plus.errors import DDUFError, DDUFPackError, DDUFValidationError
from dduf_plus.format import spec
from dduf_plus.format.archive import DDUFArchive

FIXTURE = "tiny-dit"  # the smallest fixture pipeline (480 KB): five components of four kinds
REFERENCED = "vae"  # in the partial base, stored as a reference to a local folder

# --- value pools ------------------------------------------------------------------------------------------
PIPELINE_CLASSES = ["PixArtAlphaPipeline", "PixArtSigmaPipeline", "StableDiffusionPipeline", "DiffusionPipeline",
                    "StableDiffusionXLPipeline", "DDPMPipeline", "FluxPipeline", "AutoPipelineForText2Image",
                    "ModularPipeline", "FlaxStableDiffusionPipeline", "Bogus", "", "__class__"]
LIBRARIES = ["diffusers", "transformers", "pixart_alpha", "stable_diffusion", "torch", "os", "builtins",
             "dduf_plus", "diffusers.models", "onnxruntime.training", "", None, 0]
CLASSES = ["AutoencoderKL", "PixArtTransformer2DModel", "UNet2DConditionModel", "Transformer2DModel",
           "AutoModel", "T5EncoderModel", "CLIPTextModel", "T5Tokenizer", "T5TokenizerFast", "CLIPTokenizer",
           "AutoTokenizer", "CLIPImageProcessor", "DPMSolverMultistepScheduler", "DDPMScheduler",
           "FlowMatchEulerDiscreteScheduler", "ClassifierFreeGuidance", "VaeImageProcessor", "ModularPipeline",
           "StableDiffusionSafetyChecker", "PreTrainedModel", "ModelMixin", "ConfigMixin", "SchedulerMixin",
           "DiffusionPipeline", "Module", "system", "__import__", "Bogus", "", None]
DTYPE_NAMES = ["float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "int8", "uint8",
               "bool", "complex64", "float4_e2m1fn_x2", "auto", "fp16", "torch.float16", "bogus", ""]
STRINGS = ["", "x", "float16", "bfloat16", "auto", "none", "null", "gelu", "silu", "t5", "clip", "default",
           "..", "../..", "/", "/etc/passwd", "\x00", "\x1b]0;pwned\x07\x1b[2J", "a" * 300, "pt", "np", "flax",
           "org/repo", "https://127.0.0.1:9/x", "C:\\Windows", "model.safetensors", "__init__", "\u202e"]
KEYS = ["_class_name", "_diffusers_version", "auto_map", "quantization_config", "torch_dtype", "dtype",
        "_name_or_path", "model_type", "architectures", "_use_default_values", "subfolder", "variant",
        "tokenizer_class", "processor_class", "_dduf_plus_references", "num_layers", "vocab_size",
        "sample_size", "_ignore_files", "trust_remote_code", "_commit_hash", "use_safetensors", "device_map",
        "_auto_class", "custom_pipeline", "_from_pipe", "__metadata__", "tokenizer_file", "vocab_file"]
SPECIAL_VALUES: dict[str, list[Any]] = {  # values that mean something to diffusers/transformers for a key
    "auto_map": [{"AutoModel": "org/repo--modeling.Evil"}, {"AutoTokenizer": ["org/repo--tok.Evil", None]},
                 {"AutoConfig": "../evil.Config"}, "x", []],
    "quantization_config": [{"quant_method": "bitsandbytes", "load_in_4bit": True},
                            {"quant_method": "bitsandbytes", "load_in_8bit": True}, {"quant_method": "gguf"},
                            {"quant_method": "quanto", "weights_dtype": "int8"}, {"quant_method": "torchao"},
                            {"quant_method": "bogus"}, {"quant_method": None}, {}, "x", 1],
    "torch_dtype": DTYPE_NAMES, "dtype": DTYPE_NAMES,
    "custom_pipeline": ["org/repo", "../evil", "/tmp/evil.py"],
    "trust_remote_code": [True, "true", 1],
    "tokenizer_class": ["T5Tokenizer", "LlamaTokenizer", "AutoTokenizer", "PreTrainedTokenizerFast", "Bogus", None],
}
INTEGERS = [0, 1, -1, 2, 3, 7, 1 << 31, (1 << 31) - 1, 1 << 32, 1 << 53, 1 << 63, 1 << 64, -(1 << 63), 10**30]
HUGE_DIMENSION = 1 << 20  # a "dimension" a config may ask for: tests whether building stays cheap (meta device)

#: How often each kind of mutation is picked (relative weights).
WEIGHTS = {"model_index": 3, "component_class": 3, "pipeline_class": 1, "config": 6, "tokenizer_json": 2,
           "tokenizer_bytes": 1, "references": 3, "index": 2, "safetensors": 5, "entries": 2, "raw": 1,
           "encoding": 2}
#: With quantized bases (make_bases(quant=True)): quantization states, picked often (they apply to those bases only).
QUANT_WEIGHTS = {**WEIGHTS, "quant": 12}


# --- the archive, taken apart ---------------------------------------------------------------------------------
@dataclass
class Draft:
    """An archive taken apart: what mutations edit before :func:`write_draft` writes it again."""

    base: str
    model_index: Any
    entries: dict[str, bytes]
    index_edits: list[Callable[[dict], Any]] = field(default_factory=list)  # applied to the rebuilt index
    raw_edits: list[Callable[[bytes], bytes]] = field(default_factory=list)  # applied to the written bytes
    model_index_edits: list[Callable[[bytes], bytes]] = field(default_factory=list)  # to model_index.json's bytes


class Base(NamedTuple):
    name: str
    model_index: dict[str, Any]
    entries: dict[str, bytes]  # every entry but model_index.json and the dduf_plus index

    def draft(self) -> Draft:
        return Draft(self.name, json.loads(json.dumps(self.model_index)), dict(self.entries))


@dataclass
class Context:
    """What the mutations may point at: the work folder's paths (reference sources), nothing outside."""

    work: Path
    source: Path  # the fixture pipeline folder the partial base references
    archive_paths: list[Path]
    # Integers far out of range (2**31, 2**63, HUGE_DIMENSION) in configs. They make the model builder run
    # for minutes (num_layers=2**31 builds layers until stopped): the bench keeps them, CI does not.
    huge: bool = True
    quant: bool = False  # bases with quantized components among them: quantization mutations picked often

    def paths(self) -> list[str]:
        return [str(self.source), str(self.source / REFERENCED), str(self.work), str(self.work / "missing"),
                *map(str, self.archive_paths), str(self.source) + "/", "org/tiny-dit", "./" + REFERENCED]


def take_apart(path: Path, name: str) -> Base:
    with DDUFArchive(path) as archive:
        entries = {n: archive.read_bytes(n) for n in archive.entries if n not in (spec.MODEL_INDEX, spec.INDEX_NAME)}
        return Base(name, dict(archive.model_index), entries)


def make_bases(work: Path, *, huge: bool = True, quant: bool = False) -> tuple[list[Base], Context]:
    """Pack the fixture twice under ``work``: self-contained, and with ``vae`` as a reference to a copy of the
    fixture folder (so that reference mutations reach the resolver). With ``quant``, also the fixture with its
    transformer quantized by each backend load_dduf rebuilds (:func:`quant_bases`)."""
    from dduf_plus.format.pack import pack_folder
    from dduf_plus.packing.partial import pack_partial

    work.mkdir(parents=True, exist_ok=True)
    source = work / "source" / FIXTURE
    if not source.is_dir():
        shutil.copytree(PIPELINES / FIXTURE, source)
    full = pack_folder(source, work / "full.dduf", quiet=True).path
    partial = pack_partial(source, work / "partial.dduf", exclude=[REFERENCED], refs={"*": str(source)}, quiet=True).path
    bases = [take_apart(Path(full), "full"), take_apart(Path(partial), "partial")]
    if quant:
        bases += quant_bases(work / "quant", source)
    return bases, Context(work, source, [Path(full), Path(partial)], huge, quant)


QUANT_BASES = ("bnb4-nested", "bnb8", "torchao", "sdnq", "quanto")


def _quantized_transformer(kind: str, folder: Path) -> None:
    """Save the fixture's transformer quantized by ``kind`` into ``folder`` (as diffusers / dduf_plus save it)."""
    import torch
    from diffusers import BitsAndBytesConfig, PixArtTransformer2DModel, SDNQConfig, TorchAoConfig

    src = PIPELINES / FIXTURE / "transformer"
    if kind == "quanto":
        try:
            from optimum.quanto import freeze, qint8, quantize
        except ImportError as e:  # the quanto extra: installed wherever the fuzzer's quantized bases are made
            raise RuntimeError(f"quanto base: {e} (pip install -e '.[quanto]')") from e

        from dduf_plus.loading.quant import save_quanto_component

        model = PixArtTransformer2DModel.from_pretrained(src, torch_dtype=torch.bfloat16)
        quantize(model, weights=qint8)
        freeze(model)
        save_quanto_component(model, folder)
        return
    if kind == "torchao":
        try:
            from torchao.quantization import Int8WeightOnlyConfig
        except ImportError as e:  # the quant extra, likewise
            raise RuntimeError(f"torchao base: {e} (pip install -e '.[quant]')") from e

        config: Any = TorchAoConfig(Int8WeightOnlyConfig())
    elif kind == "sdnq":
        config = SDNQConfig(weights_dtype="uint4", minimum_allowed_numel=256, minimum_allowed_channel_size=16)
    else:
        config = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
                  if kind == "bnb4-nested" else BitsAndBytesConfig(load_in_8bit=True))
    from diffusers.quantizers.bitsandbytes import bnb_quantizer

    saved = {c: c.validate_environment for c in (bnb_quantizer.BnB4BitDiffusersQuantizer,
                                                  bnb_quantizer.BnB8BitDiffusersQuantizer)}
    try:  # bitsandbytes runs on CPU; diffusers' "No GPU found" gate is bypassed while saving
        for c in saved:
            c.validate_environment = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
        model = PixArtTransformer2DModel.from_pretrained(src, quantization_config=config, torch_dtype=torch.float32,
                                                         **({"device_map": "cpu"} if kind.startswith("bnb") else {}))
        model.save_pretrained(folder)
    finally:
        for c, method in saved.items():
            c.validate_environment = method  # type: ignore[method-assign]


def quant_bases(work: Path, source: Path) -> list[Base]:
    """The fixture with its transformer quantized by each of :data:`QUANT_BASES` whose backend is installed."""
    import importlib.util

    from dduf_plus.format.pack import pack_folder

    os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")  # sdnq would torch.compile its quantizer: minutes on CPU
    modules = {"bnb4-nested": "bitsandbytes", "bnb8": "bitsandbytes", "torchao": "torchao", "sdnq": "sdnq",
               "quanto": "optimum"}
    bases = []
    for kind in QUANT_BASES:
        if importlib.util.find_spec(modules[kind]) is None:
            continue
        folder = work / kind
        if not folder.is_dir():
            shutil.copytree(source, folder)
            shutil.rmtree(folder / "transformer")
            _quantized_transformer(kind, folder / "transformer")
        bases.append(take_apart(Path(pack_folder(folder, work / f"{kind}.dduf", quiet=True).path), kind))
    return bases


# --- JSON values --------------------------------------------------------------------------------------------
DEEP = "\x00deep\x00"  # placeholder replaced by deeply nested JSON text after serialisation


def _paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def _get(value: Any, path: tuple) -> Any:
    for p in path:
        value = value[p]
    return value


def interesting(rng: random.Random, old: Any, ctx: Context, key: Any = None) -> Any:
    """A replacement for ``old``: near it, of its type but extreme, or of another type."""
    if key in SPECIAL_VALUES and rng.random() < 0.5:
        return rng.choice(SPECIAL_VALUES[key])
    roll = rng.random()
    if roll < 0.15:  # another type altogether
        return rng.choice([None, True, False, 0, 1.5, "", [], {}, [None], {"": None}, "x", -1])
    if roll < 0.2:
        return DEEP
    if isinstance(old, bool):
        return rng.choice([not old, 0, 1, "true", None])
    if isinstance(old, int):
        near = [old + 1, old - 1, old * 2, old // 2, -old, old * 3 + 1]
        if ctx.huge and rng.random() < 0.05:
            return HUGE_DIMENSION
        far = INTEGERS if ctx.huge else [i for i in INTEGERS if abs(i) <= 4096]
        return rng.choice(near + far + [float(old), str(old)])
    if isinstance(old, float):
        return rng.choice([0.0, -0.0, -old, old * 1e6, 1e308, -1e308, 5e-324, float("nan"), float("inf"),
                           int(old) if math.isfinite(old) else 0])
    if isinstance(old, str):
        pool = STRINGS + CLASSES[:-1] + DTYPE_NAMES + ctx.paths()
        return rng.choice([old + "x", old.upper(), old[:-1], old * 2, old + "/..", rng.choice(pool), rng.choice(pool)])
    if isinstance(old, list):
        return rng.choice([[], old[:1], old * 2, old[::-1], [*old, None], [old], old[1:]])
    if isinstance(old, dict):
        return rng.choice([{}, dict(list(old.items())[: len(old) // 2]), {**old, rng.choice(KEYS): None}, [old]])
    return rng.choice([0, "", [], {}, "x", True])  # old is None


def mutate_json(rng: random.Random, obj: Any, ctx: Context, *, under: tuple = ()) -> tuple[Any, str]:
    """One edit somewhere in ``obj`` (at or below ``under``): replace a value, drop or add a key, or grow a
    list. Returns the new object and what was done."""
    root = _get(obj, under)
    paths = list(_paths(root, under))
    path = rng.choice(paths)
    parent_path, key = path[:-1], (path[-1] if path else None)
    op = rng.random()
    if not path:  # the root itself
        if isinstance(obj, dict) and op < 0.5:
            new_key = rng.choice(KEYS)
            obj[new_key] = interesting(rng, None, ctx, new_key)
            return obj, f"add {new_key!r}={obj[new_key]!r:.80}"
        return interesting(rng, obj, ctx), "replace the whole document"
    parent = _get(obj, parent_path)
    if isinstance(parent, dict) and op < 0.15:
        del parent[key]
        return obj, f"delete {'/'.join(map(str, path))}"
    if isinstance(parent, dict) and op < 0.3:
        new_key = rng.choice(KEYS)
        parent[new_key] = interesting(rng, None, ctx, new_key)
        return obj, f"add {'/'.join(map(str, parent_path + (new_key,)))}={parent[new_key]!r:.80}"
    if isinstance(parent, dict) and op < 0.35:
        new_name = interesting(rng, str(key), ctx)
        if isinstance(new_name, str):
            parent[new_name] = parent.pop(key)
            return obj, f"rename key {'/'.join(map(str, path))} -> {new_name!r:.80}"
    old = parent[key]
    parent[key] = interesting(rng, old, ctx, key if isinstance(key, str) else None)
    return obj, f"set {'/'.join(map(str, path))}: {old!r:.40} -> {parent[key]!r:.80}"


def dumps(obj: Any, rng: random.Random) -> bytes:
    """Serialise, expanding :data:`DEEP` into nested JSON (deep enough to trouble a recursive reader)."""
    text = json.dumps(obj, indent=2)
    placeholder = json.dumps(DEEP)
    while placeholder in text:
        depth = rng.choice([64, 1000, 20_000, 200_000])
        text = text.replace(placeholder, "[" * depth + "]" * depth, 1)
    return text.encode()


# --- mutations: each edits a draft and says what it did (or None: does not apply) ------------------------
Mutation = Callable[[random.Random, Draft, Context], "str | None"]


def _json_entries(draft: Draft, predicate: Callable[[str], bool]) -> list[str]:
    return sorted(n for n in draft.entries if n.endswith(".json") and predicate(n))


def _mutate_json_entry(rng: random.Random, draft: Draft, ctx: Context, names: list[str]) -> str | None:
    if not names:
        return None
    name = rng.choice(names)
    try:
        obj = json.loads(draft.entries[name])
    except (ValueError, RecursionError):
        return None  # already made unreadable by an earlier mutation
    obj, what = mutate_json(rng, obj, ctx)
    draft.entries[name] = dumps(obj, rng)
    return f"{name}: {what}"


def m_config(rng, draft, ctx):
    """A value in a component's config (model, scheduler)."""
    return _mutate_json_entry(rng, draft, ctx, _json_entries(draft, lambda n: n.endswith("config.json")
                                                             and not n.startswith("tokenizer/")))


def m_tokenizer_json(rng, draft, ctx):
    return _mutate_json_entry(rng, draft, ctx, _json_entries(draft, lambda n: n.startswith("tokenizer/")))


def m_tokenizer_bytes(rng, draft, ctx):
    """The SentencePiece model: a serialised protobuf read by C++."""
    name = "tokenizer/spiece.model"
    if name not in draft.entries:
        return None
    data = bytearray(draft.entries[name])
    if rng.random() < 0.3:
        keep = rng.randrange(len(data) + 1)
        draft.entries[name] = bytes(data[:keep])
        return f"{name}: truncated to {keep} bytes"
    flips = [(rng.randrange(len(data)), rng.randrange(8)) for _ in range(rng.randint(1, 6))]
    for at, bit in flips:
        data[at] ^= 1 << bit
    draft.entries[name] = bytes(data)
    return f"{name}: bit flips {flips}"


def _model_index(draft: Draft) -> dict | None:
    return draft.model_index if isinstance(draft.model_index, dict) else None


def m_model_index(rng, draft, ctx):
    """Any value of model_index.json except the references (m_references)."""
    mi = _model_index(draft)
    if mi is None:
        return None
    refs = mi.pop(spec.REFERENCES_KEY, None)
    obj, what = mutate_json(rng, mi, ctx)
    if isinstance(obj, dict) and refs is not None:
        obj[spec.REFERENCES_KEY] = refs
    draft.model_index = obj
    return f"model_index.json: {what}"


def _components(draft: Draft) -> list[str]:
    mi = _model_index(draft) or {}
    return sorted(k for k, v in mi.items() if not k.startswith("_") and isinstance(v, list))


def m_component_class(rng, draft, ctx):
    """[library, class] of a component, or the component renamed (with its folder)."""
    names = _components(draft)
    if not names:
        return None
    name = rng.choice(names)
    mi = draft.model_index
    if rng.random() < 0.15:  # rename the component and its folder consistently
        new = rng.choice(["safety_checker", "feature_extractor", "text_encoder_2", "unet", "image_encoder",
                          "vae2", "guider", "requires_safety_checker", "config", "_private"])
        if new in mi:
            return None
        mi[new] = mi.pop(name)
        draft.entries = {(f"{new}/{n.split('/', 1)[1]}" if n.startswith(name + "/") else n): d
                         for n, d in draft.entries.items()}
        refs = mi.get(spec.REFERENCES_KEY)
        if isinstance(refs, dict) and name in refs:
            refs[new] = refs.pop(name)
        return f"rename component {name} -> {new}"
    old = mi[name]
    if rng.random() < 0.2:
        mi[name] = rng.choice([[None, None], [], [old[0]], [*old, "x"], ["diffusers"], "AutoencoderKL", None])
    else:
        mi[name] = [rng.choice([old[0] if old else "diffusers"] * 3 + LIBRARIES), rng.choice(CLASSES)]
    return f"model_index.json: {name} {old} -> {mi[name]}"


def m_pipeline_class(rng, draft, ctx):
    mi = _model_index(draft)
    if mi is None:
        return None
    old, mi["_class_name"] = mi.get("_class_name"), rng.choice(PIPELINE_CLASSES)
    return f"model_index.json: _class_name {old} -> {mi['_class_name']}"


def m_references(rng, draft, ctx):
    """A value inside ``_dduf_plus_references`` (sizes, hashes, source, subfolder, type_hint, ...)."""
    mi = _model_index(draft)
    refs = mi.get(spec.REFERENCES_KEY) if mi else None
    if not isinstance(refs, dict) or not refs:
        return None
    if rng.random() < 0.1:  # a reference to a component the archive also stores, or to one it lacks
        target = rng.choice([n for n in _components(draft) if n not in refs] or ["missing"])
        refs[target] = json.loads(json.dumps(next(iter(refs.values()))))
        return f"references: copy a record to {target!r}"
    obj, what = mutate_json(rng, mi, ctx, under=(spec.REFERENCES_KEY,))
    return f"references: {what}"


def m_index(rng, draft, ctx):
    """A value of the rebuilt dduf_plus index (applied when the draft is written)."""
    seed = rng.random()

    def edit(index: dict) -> Any:
        local = random.Random(seed)
        if local.random() < 0.2:
            index["components"] = index.get("components", {})
            comp = local.choice(sorted(index["components"]) or ["x"])
            record = index["components"].setdefault(comp, {})
            key = local.choice(["storage_dtype", "compute_dtype", "library", "class", "external", "files", "summary"])
            record[key] = local.choice(DTYPE_NAMES + [None, 0, [], {}, "x"])
            return index
        under = local.choice([(), ("components",), ("format_version",), ("created_by",)])
        try:
            obj, _ = mutate_json(local, index, ctx, under=under)
        except (KeyError, IndexError, TypeError):
            return index
        return obj

    draft.index_edits.append(edit)
    return f"index: edit #{seed:.6f}"


def _header(data: bytes) -> tuple[dict, bytes] | None:
    if len(data) < 8:
        return None
    n = struct.unpack("<Q", data[:8])[0]
    try:
        header = json.loads(data[8 : 8 + n])
    except (ValueError, RecursionError):
        return None
    return (header, data[8 + n :]) if isinstance(header, dict) else None


def _with_header(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


_SAME_SIZE_DTYPES = {"F32": 32, "I32": 32, "U32": 32, "F16": 16, "BF16": 16, "I16": 16, "U16": 16, "F64": 64,
                     "I64": 64, "U64": 64, "C64": 64, "U8": 8, "I8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8,
                     "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6}


def _reshape(rng: random.Random, numel: int, old: list[int]) -> list[int]:
    """A shape with ``numel`` elements: flat, a 1 inserted, a factor moved, or the old rank kept."""
    choices = [[numel], [*old, 1], [1, *old], [numel, 1]]
    for d in (2, 4, 8, 3):
        if numel % d == 0:
            choices += [[d, numel // d], [numel // d, d]]
    if old and numel % max(1, _prod(old[:-1])) == 0 and old[:-1]:
        choices.append([*old[:-1], numel // _prod(old[:-1])])
    return rng.choice(choices)


def _prod(dims: list[int]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def m_safetensors(rng, draft, ctx):
    """A safetensors header edit that keeps it parseable: dtype (same byte span), shape (same numel), swapped
    offsets, renamed or dropped tensors, metadata; now and then one that breaks a rule (size, bounds)."""
    names = sorted(n for n in draft.entries if n.endswith(".safetensors") and _header(draft.entries[n]))
    if not names:
        return None
    name = rng.choice(names)
    header, body = _header(draft.entries[name])
    tensors = sorted(k for k in header if k != "__metadata__" and isinstance(header[k], dict))
    if not tensors:
        return None
    t = rng.choice(tensors)
    rec = header[t]
    op = rng.choice(["dtype", "dtype", "shape", "shape", "swap", "rename", "drop", "metadata", "break"])
    what = op
    try:
        span = rec["data_offsets"][1] - rec["data_offsets"][0]
        if op == "dtype":
            new = rng.choice(sorted(_SAME_SIZE_DTYPES))
            bits = _SAME_SIZE_DTYPES[new]
            if (span * 8) % bits:
                return None
            old = rec["dtype"]
            rec["dtype"], rec["shape"] = new, _reshape(rng, span * 8 // bits, rec["shape"])
            what = f"{t}: {old} -> {new}{rec['shape']}"
        elif op == "shape":
            old = rec["shape"]
            rec["shape"] = _reshape(rng, _prod(old), old)
            what = f"{t}: shape {old} -> {rec['shape']}"
        elif op == "swap":
            same = [k for k in tensors if k != t and header[k]["data_offsets"][1] - header[k]["data_offsets"][0] == span]
            if not same:
                return None
            other = rng.choice(same)
            rec["data_offsets"], header[other]["data_offsets"] = header[other]["data_offsets"], rec["data_offsets"]
            what = f"swap data of {t} and {other}"
        elif op == "rename":
            new = rng.choice([t.replace(".weight", ".bias"), "model." + t, t.split(".", 1)[-1], t + "_", "",
                              rng.choice(tensors) + ".x", "encoder." + t, t.replace("0", "1"), t.upper()])
            if new in header:
                return None
            header[new] = header.pop(t)
            what = f"rename tensor {t} -> {new}"
        elif op == "drop":  # keeps the bytes, so the header now has a hole: refused, cheaply
            del header[t]
            what = f"drop tensor {t}"
        elif op == "metadata":
            header["__metadata__"] = rng.choice([{"format": "np"}, {"format": "pt", "dduf_plus": "x"}, {}, {"format": "mlx"},
                                                 {"format": 1}, [], {"quanto": "int8"}, {"\x1b[2J": "x"}])
            what = f"__metadata__ = {header['__metadata__']!r}"
        else:
            key = rng.choice(["dtype", "shape", "data_offsets"])
            rec[key] = interesting(rng, rec[key], ctx)
            if rec[key] == DEEP:
                rec[key] = []
            what = f"{t}: {key} -> {rec[key]!r:.60}"
    except (KeyError, IndexError, TypeError):
        return None
    draft.entries[name] = _with_header(header, body)
    return f"{name}: {what}"


def m_entries(rng, draft, ctx):
    """Which entries exist: one dropped, copied under another name, or added."""
    names = sorted(draft.entries)
    op = rng.random()
    if op < 0.3 and names:
        name = rng.choice(names)
        del draft.entries[name]
        return f"drop entry {name}"
    components = _components(draft) or ["x"]
    if op < 0.6 and names:  # another component's file, or a weights file under a variant/stem name
        src = rng.choice(names)
        comp = rng.choice(components)
        stem = src.rsplit("/", 1)[-1]
        new = rng.choice([f"{comp}/{stem}", f"{comp}/diffusion_pytorch_model.fp16.safetensors",
                          f"{comp}/model.safetensors", f"{comp}/diffusion_pytorch_model.safetensors",
                          f"{comp}/model.fp16.safetensors", f"{comp}/config.json"])
        draft.entries[new] = draft.entries[src]
        return f"copy {src} -> {new}"
    comp = rng.choice(components)
    new, data = rng.choice([
        (f"{comp}/quanto_qmap.json", b'{"x": {"weights": "qint8", "activations": "none"}}'),
        (f"{comp}/quanto_qmap.json", b'[1, 2]'),
        (f"{comp}/diffusion_pytorch_model.safetensors.index.json",
         b'{"metadata": {}, "weight_map": {"x": "../../../etc/passwd"}}'),
        (f"{comp}/model.safetensors.index.json", b'{"weight_map": {"x": "model-00001-of-00002.safetensors"}}'),
        (f"{comp}/generation_config.json", b'{"_from_model_config": true}'),
        (f"{comp}/preprocessor_config.json", b'{"processor_class": "Bogus", "auto_map": {"AutoProcessor": "a--b.C"}}'),
        (f"{comp}/special_tokens_map.json", b'{"eos_token": {"content": 1}}'),
        (f"{comp}/added_tokens.json", b'{"\\u001b[2J": 5000000000}'),
        (f"{comp}/chat_template.json", b'{"chat_template": "{{ cycler.__init__.__globals__.os.system(1) }}"}'),
        (f"{comp}/modular_model_index.json", b'{"_class_name": "ModularPipeline", "unet": ["org/repo", null]}'),
        (f"{comp}/empty.json", b""),
        (f"{comp}/weights.safetensors", _with_header({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4))),
    ])
    draft.entries[new] = data
    return f"add {new} ({len(data)} bytes)"


def m_raw(rng, draft, ctx):
    """Bytes of the written archive: flips, a truncation, or an integer over a ZIP record field."""
    seed = rng.random()

    def edit(data: bytes) -> bytes:
        local = random.Random(seed)
        mh = load_make_hostile()
        out = bytearray(data)
        roll = local.random()
        if roll < 0.2:
            return bytes(out[: local.randrange(len(out))])
        try:
            layout = mh.Layout(data)
            hot = [*(at + i for at in layout.local.values() for i in range(46)),
                   *range(layout.cd_offset, len(data))]
        except (struct.error, UnicodeDecodeError, KeyError, OverflowError, ValueError, IndexError):  # an earlier raw edit
            hot = list(range(len(data)))
        if roll < 0.5:
            at, width = local.choice(hot), local.choice([2, 4, 8])
            value = local.choice([0, 1, 0xFF, 0xFFFF, 0xFFFFFFFF, 1 << 32, (1 << 64) - 1]) & ((1 << 8 * width) - 1)
            out[at : at + width] = value.to_bytes(width, "little")[: len(out) - at]
        else:
            for _ in range(local.randint(1, 4)):
                out[local.choice(hot if local.random() < 0.7 else range(len(out)))] ^= 1 << local.randrange(8)
        return bytes(out)

    draft.raw_edits.append(edit)
    return f"raw bytes #{seed:.6f}"


# --- encodings: what a hub sees from other writers (BOMs, UTF-16, -0, lone surrogates, streamed entries) ------
_BOM = b"\xef\xbb\xbf"


def _minus_zero(rng: random.Random, text: bytes) -> bytes | None:
    """One JSON number in ``text`` written ``-0`` (or ``-0.0``, ``0e0``): equal to 0 for a lax reader."""
    numbers = [m.span(1) for m in re.finditer(rb"[:\[,]\s*(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)", text)]
    if not numbers:
        return None
    start, end = rng.choice(numbers)
    return text[:start] + rng.choice([b"-0", b"-0.0", b"0e0", b"-0e5"]) + text[end:]


def _json_encoding_edit(rng: random.Random, data: bytes) -> tuple[bytes, str] | None:
    op = rng.choice(["bom", "utf-16", "utf-16-le", "utf-32", "surrogate", "nul", "minus-zero"])
    if op == "bom":
        return _BOM + data, op
    if op.startswith("utf-"):
        try:
            return data.decode().encode(op), f"re-encoded {op}"
        except UnicodeError:
            return None
    if op == "minus-zero":
        edited = _minus_zero(rng, data)
        return (edited, op) if edited is not None else None
    strings = [m.span() for m in re.finditer(rb'"(?:[^"\\]|\\.)*"', data)]
    if not strings:
        return None
    start, end = rng.choice(strings)
    escape = rng.choice([b"\\ud800", b"\\udc80", b"\\udbff\\u0041"]) if op == "surrogate" else b"\\u0000"
    return data[: end - 1] + escape + data[end - 1 :], f"{op} in {data[start:end][:40]!r}"


def _header_encoding_edit(rng: random.Random, data: bytes) -> tuple[bytes, str] | None:
    """A safetensors header's text edited as a foreign writer might: -0 numbers, lone surrogates or NUL in a
    tensor name, a BOM before the JSON; the header length kept true."""
    if len(data) < 8:
        return None
    n = struct.unpack("<Q", data[:8])[0]
    raw, body = data[8 : 8 + n], data[8 + n :]
    if len(raw) != n:
        return None
    op = rng.choice(["minus-zero", "minus-zero", "surrogate-name", "nul-name", "bom"])
    if op == "minus-zero":
        edited = _minus_zero(rng, raw)
    elif op == "bom":
        edited = _BOM + raw
    else:
        names = [m.end(1) for m in re.finditer(rb'"((?:[^"\\]|\\.)*)"\s*:\s*\{\s*"', raw)]
        if not names:
            return None
        at = rng.choice(names)
        edited = raw[:at] + (rb"\udc80" if op == "surrogate-name" else rb"\u0000") + raw[at:]
    if edited is None:
        return None
    edited += b" " * (-len(edited) % 8)
    return struct.pack("<Q", len(edited)) + edited + body, op


def _streamed(seed: float) -> Callable[[bytes], bytes]:
    """A raw edit: one entry rewritten as streamed (bit 3, zero CRC and sizes locally, a data descriptor after its
    data), the descriptor honest (16 or 24 bytes, with or without its signature) or lying (CRC, size)."""

    def edit(data: bytes) -> bytes:
        try:
            return stream(data)
        except (struct.error, UnicodeDecodeError, KeyError, OverflowError, ValueError, IndexError):
            return data  # an earlier raw edit broke the layout: nothing to stream

    def stream(data: bytes) -> bytes:
        local = random.Random(seed)
        layout = load_make_hostile().Layout(data)
        mh = load_make_hostile()
        names = sorted((n for n in layout.local if n != spec.INDEX_NAME), key=layout.local.get)
        if not names:
            return data
        # Mostly the entry before the index (nothing after it but the index moves, so the archive can still load).
        name = names[-1] if local.random() < 0.6 else local.choice(names)
        blob = bytearray(data)
        at, central, size = layout.local[name], layout.central[name], layout.size(name)
        end = layout.data_offset(name) + size
        crc = struct.unpack_from("<I", blob, central + 16)[0]
        form, lie = local.choice(["signed32", "signed64", "bare32"]), local.choice([None, None, "crc", "size"])
        struct.pack_into("<H", blob, at + 6, struct.unpack_from("<H", blob, at + 6)[0] | spec.FLAG_DATA_DESCRIPTOR)
        struct.pack_into("<III", blob, at + 14, 0, 0, 0)
        struct.pack_into("<H", blob, central + 8, struct.unpack_from("<H", blob, central + 8)[0] | spec.FLAG_DATA_DESCRIPTOR)
        crc ^= 1 if lie == "crc" else 0
        told = size + (1 if lie == "size" else 0)
        descriptor = {"signed32": struct.pack("<IIII", spec.SIG_DATA_DESCRIPTOR, crc, told, told),
                      "signed64": struct.pack("<IIQQ", spec.SIG_DATA_DESCRIPTOR, crc, told, told),
                      "bare32": struct.pack("<III", crc, told, told)}[form]
        blob[end:end] = descriptor
        mh._fix_offsets(blob, end, len(descriptor))
        return bytes(blob)

    return edit


def m_encoding(rng, draft, ctx):
    """Bytes as other writers produce them: a JSON entry with a BOM, in UTF-16/32, with ``-0``, a lone surrogate
    or NUL; a safetensors header likewise; or an entry streamed behind a data descriptor."""
    roll = rng.random()
    if roll < 0.25:
        seed = rng.random()
        draft.raw_edits.append(_streamed(seed))
        return f"streamed entry #{seed:.6f}"
    if roll < 0.5:
        names = sorted(n for n in draft.entries if n.endswith(".safetensors"))
        edit = _header_encoding_edit
    else:
        names = _json_entries(draft, lambda n: True)
        edit = _json_encoding_edit
        if rng.random() < 0.2:  # model_index.json: its bytes as written (other mutations may change the object)
            seed = rng.random()
            draft.model_index_edits.append(lambda data: (_json_encoding_edit(random.Random(seed), data) or (data,))[0])
            return f"{spec.MODEL_INDEX}: encoding #{seed:.6f}"
    if not names:
        return None
    name = rng.choice(names)
    done = edit(rng, draft.entries[name])
    if done is None:
        return None
    draft.entries[name], what = done
    return f"{name}: {what}"


# --- quantization states (bases with quantized components: make_bases(quant=True)) ---------------------------
QUANT_PARTS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".SCB", "_scale", "_zero_point",
               "_qdata", ".scale", ".zero_point", "._data", "._scale", ".weight")
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4}


def _tensors(data: bytes) -> tuple[dict[str, tuple[str, list[int], bytes]], dict] | None:
    """A safetensors file as {name: (dtype, shape, bytes)} and its __metadata__ (None: not parseable)."""
    parsed = _header(data)
    if parsed is None:
        return None
    header, body = parsed
    out: dict[str, tuple[str, list[int], bytes]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            a, b = info["data_offsets"]
            out[name] = (info["dtype"], list(info["shape"]), body[a:b])
        except (TypeError, KeyError, ValueError):
            return None
    return out, header.get("__metadata__") or {}


def _rebuild(tensors: dict[str, tuple[str, list[int], bytes]], metadata: dict) -> bytes:
    """A safetensors file written again from ``tensors`` (offsets laid out anew, no holes)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    body, at = [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        body.append(raw)
        at += len(raw)
    return _with_header(header, b"".join(body))


def _quant_state_edit(rng: random.Random, ctx: Context, tensors: dict, metadata: dict) -> str | None:
    """bitsandbytes' packed quant_state JSON, or torchao's per-tensor description: one JSON edit."""
    states = sorted(n for n in tensors if ".quant_state.bitsandbytes__" in n)
    described = sorted(k for k in metadata if k != "tensor_names" and str(metadata[k]).startswith("{"))
    if not states and not described:
        return None
    if states and (not described or rng.random() < 0.5):
        name = rng.choice(states)
        dtype, _shape, raw = tensors[name]
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
        obj, what = mutate_json(rng, obj, ctx)
        new = dumps(obj, rng)
        tensors[name] = (dtype, [len(new)], new)
        return f"quant_state {name}: {what}"
    key = rng.choice(described)
    try:
        obj = json.loads(metadata[key])
    except (ValueError, RecursionError):
        return None
    obj, what = mutate_json(rng, obj, ctx)
    metadata[key] = dumps(obj, rng).decode()
    return f"torchao description {key}: {what}"


def _quant_tensor_edit(rng: random.Random, tensors: dict) -> str | None:
    """A quantization part's shape, length or dtype (its bytes cut, repeated or kept to fit)."""
    names = sorted(n for n in tensors if n.endswith(QUANT_PARTS))
    if not names:
        return None
    name = rng.choice(names)
    dtype, shape, raw = tensors[name]
    op = rng.choice(["truncate", "one", "double", "dtype", "reshape", "empty"])
    width = _ST_BYTES.get(dtype, 1)
    if op == "truncate" and len(raw) > width:
        raw = raw[: rng.randrange(1, len(raw) // width) * width]
        shape = [len(raw) // width]
    elif op == "one":
        raw, shape = raw[:width], [1] * max(1, len(shape))
    elif op == "double":
        raw, shape = raw * 2, [2 * shape[0], *shape[1:]] if shape else [2]
    elif op == "dtype":
        new = rng.choice(sorted(_ST_BYTES))
        dtype, shape = new, [len(raw) // _ST_BYTES[new]]
        raw = raw[: shape[0] * _ST_BYTES[new]]
    elif op == "reshape":
        shape = _reshape(rng, _prod(shape), shape) if shape else [1]
    else:
        raw, shape = b"", [0]
    tensors[name] = (dtype, shape, raw)
    return f"{name}: {op} -> {dtype} {shape[:4]}"


def m_quant(rng, draft, ctx):
    """A quantization state: the config's quantization_config (SDNQ / bitsandbytes / torchao fields),
    quanto's qmap, bitsandbytes' quant_state JSON, torchao's descriptions, or a quantization tensor's header."""
    configs = [n for n in draft.entries if n.endswith("/config.json") and b"quantization_config" in draft.entries[n]]
    qmaps = [n for n in draft.entries if n.endswith("/quanto_qmap.json")]
    weights = [n for n in draft.entries if n.endswith(".safetensors") and n.split("/")[0] + "/config.json" in configs
               or n.endswith(".safetensors") and n.split("/")[0] + "/quanto_qmap.json" in qmaps]
    if not configs and not qmaps:
        return None
    op = rng.random()
    if op < 0.3 and configs:
        name = rng.choice(sorted(configs))
        try:
            obj = json.loads(draft.entries[name])
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("quantization_config"), dict):
            return None
        obj, what = mutate_json(rng, obj, ctx, under=("quantization_config",))
        draft.entries[name] = dumps(obj, rng)
        return f"{name}: {what}"
    if op < 0.4 and qmaps:
        return _mutate_json_entry(rng, draft, ctx, qmaps)
    if not weights:
        return None
    name = rng.choice(sorted(weights))
    parsed = _tensors(draft.entries[name])
    if parsed is None:
        return None
    tensors, metadata = parsed
    what = _quant_state_edit(rng, ctx, tensors, metadata) if op < 0.65 else _quant_tensor_edit(rng, tensors)
    if what is None:
        return None
    draft.entries[name] = _rebuild(tensors, metadata)
    return f"{name}: {what}"


MUTATIONS: dict[str, Mutation] = {"model_index": m_model_index, "component_class": m_component_class,
                                  "pipeline_class": m_pipeline_class, "config": m_config,
                                  "tokenizer_json": m_tokenizer_json, "tokenizer_bytes": m_tokenizer_bytes,
                                  "references": m_references, "index": m_index, "safetensors": m_safetensors,
                                  "entries": m_entries, "raw": m_raw, "quant": m_quant,
                                  "encoding": m_encoding}


# --- inputs ---------------------------------------------------------------------------------------------
class Input(NamedTuple):
    seed: int
    number: int
    base: str
    mutations: list[tuple[str, str]]  # (kind, what it did)
    data: bytes | None  # None: the writer refused the draft (a name DDUF forbids): nothing to run

    @property
    def kinds(self) -> list[str]:
        return [k for k, _ in self.mutations]


def generate(bases: list[Base], ctx: Context, seed: int, number: int, work: Path) -> Input:
    """Input ``number`` of run ``seed``: one to three mutations of a base, written with DDUFWriter under
    ``work``; the same numbers always give the same bytes."""
    rng = random.Random(f"dduf-fuzz-loader/{seed}/{number}")
    base = rng.choice(bases)
    draft = base.draft()
    done: list[tuple[str, str]] = []
    wanted = rng.choices([1, 2, 3], weights=[5, 3, 2])[0]
    kinds, weights = zip(*(QUANT_WEIGHTS if ctx.quant else WEIGHTS).items(), strict=True)
    for _ in range(wanted * 4):  # some mutations do not apply to every draft
        if len(done) == wanted:
            break
        kind = rng.choices(kinds, weights=weights)[0]
        what = MUTATIONS[kind](rng, draft, ctx)
        if what is not None:
            done.append((kind, what))
    return Input(seed, number, base.name, done, write_draft(draft, work / "input.dduf"))


def write_draft(draft: Draft, path: Path) -> bytes | None:
    mh = load_make_hostile()

    def index(built: dict) -> Any:
        for edit in draft.index_edits:
            built = edit(built)
        return built

    mi = draft.model_index
    text = json.dumps(mi)
    raw = dumps(mi, random.Random(text)) if DEEP in text or not isinstance(mi, dict) else None
    as_object = mi if isinstance(mi, dict) else {}
    if not isinstance(as_object.get(spec.REFERENCES_KEY, {}), dict):  # build_index expects an object there
        raw = raw or dumps(mi, random.Random(text))
        as_object = {k: v for k, v in as_object.items() if k != spec.REFERENCES_KEY}
    if draft.model_index_edits:
        raw = raw if raw is not None else json.dumps(mi, indent=2).encode()
        for edit in draft.model_index_edits:
            raw = edit(raw)
    try:
        mh.write_valid(path, draft.entries, as_object, model_index_bytes=raw, index=index)
    except DDUFPackError:
        return None
    data = path.read_bytes()
    for edit in draft.raw_edits:
        data = edit(data)
    return data


# --- running the commands on an input ---------------------------------------------------------------------
class InputTimeout(BaseException):
    """Raised by :func:`time_limit` (a BaseException: library code's ``except Exception`` cannot swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Interrupt the block after ``seconds`` (main thread only; a long C call is interrupted when it returns)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise InputTimeout(f"over {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Outcome(NamedTuple):
    target: str
    status: str  # "ok", "error" (a DDUFError: fine), "finding" (anything else), "timeout"
    label: str  # "ok", the DDUFError class (and rule codes / wrapped cause), or the finding
    seconds: float
    detail: str = ""  # traceback or output for findings

    @property
    def bad(self) -> bool:
        return self.status in ("finding", "timeout")


# A DDUFError that wraps a MemoryError is still a finding: the input made the loader try to allocate more
# than the machine has (memory per input must be bounded). A wrapped RecursionError is counted apart (its
# label says so) but passes: a reader that catches it and names the entry has done its job.
_BAD_CAUSES = (MemoryError,)


def _causes(e: BaseException) -> Iterator[BaseException]:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def classify(target: str, e: BaseException | None, seconds: float) -> Outcome:
    if e is None:
        return Outcome(target, "ok", "ok", seconds)
    if isinstance(e, InputTimeout):
        return Outcome(target, "timeout", "timeout", seconds, "".join(traceback.format_exception(e)))
    if isinstance(e, DDUFError):
        bad = next((c for c in _causes(e) if isinstance(c, _BAD_CAUSES)), None)
        if bad is not None:
            return Outcome(target, "finding", f"{type(e).__name__}<-{type(bad).__name__}", seconds,
                           "".join(traceback.format_exception(e)))
        label = type(e).__name__
        if isinstance(e, DDUFValidationError):
            label += ":" + ",".join(sorted(set(e.codes))[:3])
        elif e.__cause__ is not None:
            label += f"<-{type(e.__cause__).__name__}"
        elif any(isinstance(c, RecursionError) for c in _causes(e)):
            label += "<-RecursionError"
        return Outcome(target, "error", label, seconds)
    return Outcome(target, "finding", type(e).__name__, seconds, "".join(traceback.format_exception(e)))


def _control_characters(text: str) -> str | None:
    bad = sorted({c for c in text if (ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) < 0xA0})
    return ", ".join(repr(c) for c in bad[:5]) if bad else None


def _cli(argv: list[str], *, human: bool) -> Outcome:
    """Run ``dduf ARGV`` in-process; a finding if it prints control characters (human output) or invalid JSON."""
    from dduf_plus.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    text = out.getvalue() + err.getvalue()
    if human and (bad := _control_characters(text)):
        return Outcome(argv[0], "finding", "unescaped-control-characters", 0, f"{bad} in:\n{text[:2000]}")
    if not human and code == 0 and argv[0] in ("info", "refs") and out.getvalue():
        try:
            json.loads(out.getvalue())
        except (ValueError, RecursionError) as e:
            return Outcome(argv[0], "finding", "invalid-json-output", 0, f"{e}:\n{out.getvalue()[:2000]}")
    if code not in (0, 1, 2):
        return Outcome(argv[0], "finding", f"exit-{code}", 0, text[:2000])
    return Outcome(argv[0], "ok" if code == 0 else "error", f"exit {code}", 0)


def _open_archive(path: Path) -> None:
    from dduf_plus.format.describe import describe

    with DDUFArchive(path) as archive:
        _ = archive.references, archive.index
        for name in archive.components:
            archive.tensor_infos(name)
    json.dumps(describe(path))


def _load(path: Path) -> None:
    from dduf_plus import load_dduf

    load_dduf(path)


TARGETS: dict[str, Callable[[Path], Outcome | None]] = {
    "archive": _open_archive,
    "info": lambda p: _cli(["info", str(p)], human=True),
    "info-json": lambda p: _cli(["info", str(p), "--json"], human=False),
    "refs": lambda p: _cli(["refs", str(p)], human=True),
    "refs-json": lambda p: _cli(["refs", str(p), "--json"], human=False),
    "load": _load,
}


def run_targets(path: Path, *, targets: tuple[str, ...] = tuple(TARGETS), limit_s: float | None = 60.0) -> list[Outcome]:
    """Run each target on the archive at ``path``. ``load`` is skipped when the archive does not open (it
    opens it the same way first). Every outcome is classified; none raises."""
    outcomes: list[Outcome] = []
    for target in targets:
        if target == "load" and outcomes and outcomes[0].target == "archive" and outcomes[0].status == "error":
            continue
        outcomes.append(run_target(target, lambda target=target: TARGETS[target](path), limit_s))
    return outcomes


def run_target(target: str, call: Callable[[], Outcome | None], limit_s: float | None) -> Outcome:
    """``call()`` under the time limit, its outcome classified (an Outcome it returns is kept); never raises but
    KeyboardInterrupt. Every engine runs each of its targets through here."""
    started = time.perf_counter()
    error: BaseException | None = None
    extra: Outcome | None = None
    try:
        with time_limit(limit_s):
            extra = call()
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - classifying every exception is the point
        error = e
    seconds = time.perf_counter() - started
    return extra._replace(target=target, seconds=seconds) if extra is not None else classify(target, error, seconds)


# --- what must not change ---------------------------------------------------------------------------------------
def snapshot(*folders: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under ``folders``: the reference source and a canary must stay as they are."""
    out = {}
    for folder in folders:
        for root, dirs, files in os.walk(folder, followlinks=False):
            for name in dirs + files:
                p = Path(root, name)
                st = p.lstat()
                out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


def signature(o: Outcome) -> str:
    """target | label | innermost dduf_plus frame: what tells one bug from another."""
    frames = re.findall(r'File "[^"]*/(dduf_plus/[^"]+)", line \d+, in (\w+)', o.detail or "")
    return f"{o.target}|{o.label}|{frames[-1][0]}:{frames[-1][1]}" if frames else f"{o.target}|{o.label}|"


def tally(outcomes: list[list[Outcome]]) -> dict[str, Counter]:
    """{target: Counter(label)} over many inputs."""
    out: dict[str, Counter] = {}
    for per_input in outcomes:
        for o in per_input:
            out.setdefault(o.target, Counter())[o.label] += 1
    return out


# =================================================================================================================
# Single-file checkpoint headers (``dduf info CKPT --base BASE``, ``dduf pack CKPT --base BASE``): a separate engine
# from the archive mutations above. A clean tiny checkpoint's header is edited (shapes, dtypes, key names,
# ``__metadata__``), the data section laid out again to fit (usually: then the header checks pass and the
# conversion really runs) or not (the header checks must refuse it), and the single-file commands run on it.
# =================================================================================================================
SF_DTYPES = [d.safetensors for d in spec.DTYPES] + ["F8_E4M3FNUZ", "I4", "bogus", "", 1, None, ["F16"]]
SF_MARKERS = ["model.diffusion_model.input_blocks.0.0.weight",
              "model.diffusion_model.input_blocks.2.1.transformer_blocks.0.attn2.to_k.weight",
              "conditioner.embedders.1.model.transformer.resblocks.9.mlp.c_proj.bias",
              "conditioner.embedders.0.model.transformer.resblocks.9.mlp.c_proj.bias",
              "model.diffusion_model.joint_blocks.0.context_block.adaLN_modulation.1.bias",
              "model.diffusion_model.joint_blocks.37.x_block.mlp.fc1.weight", "model.diffusion_model.pos_embed",
              "double_blocks.0.img_attn.norm.key_norm.scale", "guidance_in.in_layer.bias", "img_in.weight",
              "text_encoders.clip_l.transformer.text_model.embeddings.position_embedding.weight",
              "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight",
              "cond_stage_model.model.text_projection", "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight",
              "edm_mean", "scaled_fp8", "x.scale_weight", "single_stream_modulation.lin.weight", "model_ema.decay"]
SF_PREFIXES = ["", "model.diffusion_model.", "first_stage_model.", "cond_stage_model.transformer.",
               "cond_stage_model.model.", "conditioner.embedders.0.transformer.", "text_encoders.clip_l.transformer.",
               "text_encoders.t5xxl.transformer.", "vae.", "model.diffusion_model.model.diffusion_model."]
SF_DIMS = [0, 1, 2, 3, 7, 77, 20_000, 75_000, 1 << 20, 1 << 31, 1 << 40, (1 << 62), -1]
SF_MAX_DATA = 8 << 20  # a mutant's data section is cut here (a shape asking for more is left inconsistent)
SF_WEIGHTS = {"sf_shape": 5, "sf_declared_empty": 3, "sf_dtype": 4, "sf_key": 4, "sf_metadata": 2, "sf_raw": 1,
              "sf_flood": 1}
_SF_BITS = {d.safetensors: d.bits for d in spec.DTYPES}


class SingleFileBase(NamedTuple):
    name: str
    base: Path  # BASE: the diffusers pipeline folder of the same family
    tensors: dict[str, list]  # name -> [dtype code, shape, data bytes] of a clean checkpoint
    metadata: dict[str, str] | None


@dataclass
class SingleFileDraft:
    tensors: dict[str, list]
    metadata: Any
    relayout: bool = True  # lay the data out again to fit each (edited) shape x dtype where it can
    raw_edits: list[Callable[[bytes], bytes]] = field(default_factory=list)


class SingleFileInput(NamedTuple):
    number: int
    base: str
    base_path: Path
    mutations: list[tuple[str, str]]
    data: bytes


def single_file_bases(work: Path, *, families: tuple[str, ...] = ("v1",)) -> list[SingleFileBase]:
    """Clean tiny checkpoints and their BASE folders: ``v1`` (tiny-sd, UNet changed so a pack stores it),
    ``sd3`` (tiny SD3.5, transformer and CLIP-L), ``flux`` (tiny FLUX.1 dev, ComfyUI's full layout)."""
    import torch
    from single_file_ckpt import (
        build_tiny_flux,
        build_tiny_sd3,
        checkpoint_from_pipeline,
        flux_checkpoint,
        raw_tensors,
        sd3_checkpoint_from_pipeline,
    )

    work.mkdir(parents=True, exist_ok=True)
    out: list[SingleFileBase] = []
    for family in families:
        if family == "v1":
            base = PIPELINES / "tiny-sd"
            state = checkpoint_from_pipeline(base, "v1", unet_delta=0.01)
        elif family == "sd3":
            base = build_tiny_sd3(work / "tiny-sd3", PIPELINES / "tiny-sd" / "tokenizer",
                                  PIPELINES / "tiny-dit" / "tokenizer")
            state = sd3_checkpoint_from_pipeline(base, transformer_delta=0.01, dtype=torch.float16,
                                                 components=("transformer", "text_encoder"))
        else:
            base = build_tiny_flux(work / "tiny-flux", PIPELINES / "tiny-sd" / "tokenizer",
                                   PIPELINES / "tiny-dit" / "tokenizer")
            state = flux_checkpoint(base, layout="comfy", transformer_delta=0.01, full=True, dtype=torch.bfloat16)
        tensors = {k: list(v) for k, v in raw_tensors(state).items()}
        out.append(SingleFileBase(family, base, tensors, {"format": "pt"}))
    return out


def _sf_numel(shape: Any) -> int | None:
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return None
    n = 1
    for d in shape:
        n *= d
    return n


def _sf_pick(rng: random.Random, draft: SingleFileDraft) -> str | None:
    return rng.choice(sorted(draft.tensors)) if draft.tensors else None


def m_sf_shape(rng: random.Random, draft: SingleFileDraft) -> str | None:
    """A dimension changed, added or dropped (the data relaid to fit when small enough)."""
    key = _sf_pick(rng, draft)
    if key is None:
        return None
    shape = list(draft.tensors[key][1])
    how = rng.choice(["set", "add", "drop", "swap", "scale"])
    if how == "set" and shape:
        shape[rng.randrange(len(shape))] = rng.choice(SF_DIMS)
    elif how == "add":
        shape.insert(rng.randrange(len(shape) + 1), rng.choice(SF_DIMS[:6]))
    elif how == "drop" and shape:
        shape.pop(rng.randrange(len(shape)))
    elif how == "swap" and len(shape) > 1:
        shape.reverse()
    elif shape:
        i = rng.randrange(len(shape))
        shape[i] = shape[i] * rng.choice([2, 3, 4, 1000])
    draft.tensors[key][1] = shape
    return f"{key}: shape {how} -> {shape}"[:200]


def m_sf_declared_empty(rng: random.Random, draft: SingleFileDraft) -> str | None:
    """The issue's kind: a 0 in the shape (no data) beside a number a converter sizes something by."""
    key = rng.choice([k for k in draft.tensors if "position" in k or "pos_embed" in k or "qkv" in k
                      or "in_proj" in k or "linear1" in k] or sorted(draft.tensors) or [""])
    if not key:
        return None
    big = rng.choice(SF_DIMS[4:-1])
    draft.tensors[key][1] = rng.choice([[0, big], [big, 0], [0], [0, big, big], [3 * big, 0]])
    return f"{key}: declared {draft.tensors[key][1]}"


def m_sf_dtype(rng: random.Random, draft: SingleFileDraft) -> str | None:
    key = _sf_pick(rng, draft)
    if key is None:
        return None
    keys = [key] if rng.random() < 0.7 else [k for k in draft.tensors if k.startswith(key.split(".")[0])]
    code = rng.choice(SF_DTYPES)
    for k in keys:
        draft.tensors[k][0] = code
    return f"{len(keys)} tensor(s) from {key}: dtype {code!r}"[:200]


def m_sf_key(rng: random.Random, draft: SingleFileDraft) -> str | None:
    """Key names: another family's marker added, a key dropped or renamed, a prefix swapped, odd characters."""
    key = _sf_pick(rng, draft)
    if key is None:
        return None
    how = rng.choice(["marker", "drop", "prefix", "index", "odd", "copy"])
    entry = draft.tensors.pop(key) if how in ("drop", "prefix", "index", "odd") else draft.tensors[key]
    if how == "marker":
        new = rng.choice(SF_MARKERS)
        draft.tensors[new] = [rng.choice(["F16", "F32", "BF16"]), rng.choice([[0], [9216], [1, 36864, 16], [16, 9, 3, 3],
                                                                              [1024, 16], list(entry[1])]), b""]
        return f"added marker {new} {draft.tensors[new][1]}"
    if how == "drop":
        return f"dropped {key}"
    if how == "prefix":
        first = next((p for p in sorted(SF_PREFIXES, key=len, reverse=True) if p and key.startswith(p)), "")
        new = rng.choice(SF_PREFIXES) + key[len(first):]
    elif how == "index":
        new = re.sub(r"\.(\d+)\.", lambda m: f".{rng.choice([0, 37, 99, 10**9, 2**63])}.", key, count=1)
    elif how == "odd":
        new = key + rng.choice(["\x00", "\x1b[2J", ".", "/../x", "\u202e", " ", ".weight"])
    else:
        new = key.replace("weight", "bias") if "weight" in key else key + "_copy"
    draft.tensors[new] = entry if how != "copy" else list(entry)
    return f"{how}: {key} -> {new!r}"[:200]


def m_sf_metadata(rng: random.Random, draft: SingleFileDraft) -> str | None:
    draft.metadata = rng.choice([None, {}, {"format": "pt"}, {"format": 1}, [], "x", {"a": {"b": "c"}},
                                 {"modelspec.architecture": "stable-diffusion-v1"}, {"k" * 1000: "v" * 100_000},
                                 {str(i): str(i) for i in range(5000)}, {"scaled_fp8": "true"}])
    return f"__metadata__ {str(draft.metadata)[:60]}"


def m_sf_raw(rng: random.Random, draft: SingleFileDraft) -> str | None:
    """A byte-level edit on the written file: the header checks must refuse it."""
    how = rng.choice(["truncate", "length", "flip", "keep-layout"])
    if how == "keep-layout":
        draft.relayout = False  # the shapes edited above keep the old spans: S005
        return "spans not relaid"
    if how == "truncate":
        draft.raw_edits.append(lambda b: b[: max(0, len(b) - rng.randrange(1, 64))])
    elif how == "length":
        value = rng.choice([0, 7, 1 << 30, 1 << 62])
        draft.raw_edits.append(lambda b: struct.pack("<Q", value) + b[8:])
    else:
        at = rng.randrange(8, 400)
        draft.raw_edits.append(lambda b: b[:at] + bytes([b[at] ^ 0x20]) + b[at + 1:] if len(b) > at else b)
    return f"raw {how}"


def m_sf_flood(rng: random.Random, draft: SingleFileDraft) -> str | None:
    """Counts: many (empty) keys under one component's prefix, numbered like blocks (converters loop over them)."""
    prefix = rng.choice(SF_PREFIXES)
    block = rng.choice(["input_blocks.{}.0.weight", "joint_blocks.{}.x_block.attn.qkv.weight",
                        "double_blocks.{}.img_attn.qkv.weight", "encoder.down.{}.block.0.conv1.weight",
                        "text_model.encoder.layers.{}.mlp.fc1.weight", "transformer.resblocks.{}.attn.in_proj_weight"])
    n = rng.choice([50, 500, 3000])
    for i in range(n):
        draft.tensors[prefix + block.format(rng.randrange(1 << 20) if rng.random() < 0.3 else i + 40)] = ["F16", [0], b""]
    return f"{n} keys {prefix}{block}"


SF_MUTATIONS: dict[str, Callable[[random.Random, SingleFileDraft], str | None]] = {
    "sf_flood": m_sf_flood,
    "sf_shape": m_sf_shape, "sf_declared_empty": m_sf_declared_empty, "sf_dtype": m_sf_dtype, "sf_key": m_sf_key,
    "sf_metadata": m_sf_metadata, "sf_raw": m_sf_raw}


def write_checkpoint(draft: SingleFileDraft) -> bytes:
    """The draft as safetensors bytes: each tensor's data resized to its (edited) shape x dtype where that is a
    plain size under :data:`SF_MAX_DATA` in all, else left as it was (the reader refuses the mismatch)."""
    header: dict[str, Any] = {} if draft.metadata is None else {"__metadata__": draft.metadata}
    blobs, at = [], 0
    for name in sorted(draft.tensors):
        code, shape, data = draft.tensors[name]
        numel = _sf_numel(shape)
        bits = _SF_BITS.get(code) if isinstance(code, str) else None
        if draft.relayout and numel is not None and bits is not None and numel * bits % 8 == 0:
            want = numel * bits // 8
            if at + want <= SF_MAX_DATA:
                data = (data * (want // max(len(data), 1) + 1))[:want] if data else bytes(want)
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    out = struct.pack("<Q", len(raw)) + raw + b"".join(blobs)
    for edit in draft.raw_edits:
        out = edit(out)
    return out


def generate_single_file(bases: list[SingleFileBase], seed: int, number: int) -> SingleFileInput:
    """Single-file input ``number`` of run ``seed``: one to three header mutations of a clean checkpoint."""
    rng = random.Random(f"dduf-fuzz-single-file/{seed}/{number}")
    base = rng.choice(bases)
    draft = SingleFileDraft({k: list(v) for k, v in base.tensors.items()}, base.metadata)
    kinds, weights = zip(*SF_WEIGHTS.items(), strict=True)
    done: list[tuple[str, str]] = []
    wanted = rng.choices([1, 2, 3], weights=[5, 3, 2])[0]
    for _ in range(wanted * 4):
        if len(done) == wanted:
            break
        kind = rng.choices(kinds, weights=weights)[0]
        what = SF_MUTATIONS[kind](rng, draft)
        if what is not None:
            done.append((kind, what))
    return SingleFileInput(number, base.name, base.base, done, write_checkpoint(draft))


def _sf_python(call: Callable[[], Any]) -> None:
    json.dumps(call(), default=str)


_MODEL_DIR_REFERENCES: dict[str, dict[str, dict[str, Any]]] = {}


def model_dir_references(base: Path, work: Path) -> dict[str, dict[str, Any]]:
    """BASE's weighted components as references recording their tensors, as ``dduf pack`` records them: what
    the model-folder search looks for in a (mutated) checkpoint put in an app's folder. A sharded component
    (tiny-sd's UNet) is merged into one file under ``work`` first (the search matches one-file components).
    Computed once per BASE."""
    import hashlib

    from safetensors.torch import load_file, save_file

    from dduf_plus.refs.tensor_digest import tensor_record

    if str(base) not in _MODEL_DIR_REFERENCES:
        out: dict[str, dict[str, Any]] = {}
        for folder in sorted(p for p in base.iterdir() if (p / "config.json").is_file()):
            weights = next((w for w in ("diffusion_pytorch_model.safetensors", "model.safetensors")
                            if (folder / w).is_file()), None)
            shards = sorted(folder.glob("*-of-*.safetensors"))
            if weights is None and shards:
                merged = work / f"merged-{os.getpid()}-{base.name}-{folder.name}"  # one per process (parallel workers)
                merged.mkdir(parents=True, exist_ok=True)
                shutil.copy(folder / "config.json", merged / "config.json")
                weights = shards[0].name.split("-0")[0] + ".safetensors"
                save_file({k: v for s in shards for k, v in load_file(s).items()}, merged / weights)
                folder = merged
            if weights is None:
                continue
            files = {f: {"sha256": hashlib.sha256((folder / f).read_bytes()).hexdigest(),
                         "size": (folder / f).stat().st_size} for f in (weights, "config.json")}
            if record := tensor_record(folder, files):
                out[folder.name.rsplit("-", 1)[-1]] = {"files": files, **record}
        _MODEL_DIR_REFERENCES[str(base)] = out
    return _MODEL_DIR_REFERENCES[str(base)]


def _sf_model_dirs(ckpt: Path, base: Path) -> Outcome | None:
    """The checkpoint in an app's model folder (a link to it), searched for each of BASE's components with the
    layout readers (header, conversion on meta tensors, ranges, hashing); a part found is loaded in place (its
    tensors viewed from the file). A search answers a match or a reason, never raises."""
    from dduf_plus.loading.files import FolderComponentFiles
    from dduf_plus.loading.in_place import MappedPartFiles
    from dduf_plus.packing.model_dir_layouts import install
    from dduf_plus.refs import model_dirs

    install()
    folder = ckpt.parent / f"{ckpt.stem}-models"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    os.symlink(ckpt, folder / "checkpoint.safetensors")
    for name, reference in model_dir_references(base, ckpt.parent).items():
        found = model_dirs.find_component(name, reference, [folder])
        if not isinstance(found, (str, model_dirs.Match)):
            return Outcome("sf-model-dirs", "finding", "not-a-match-or-reason", 0, repr(found)[:2000])
        if isinstance(found, model_dirs.Match) and found.in_place is not None:
            files = MappedPartFiles(FolderComponentFiles(found.files["config.json"].parent, name), name,
                                    found.in_place)
            files.tensors(files.weight_files())
    return None


def single_file_targets(ckpt: Path, base: Path, out: Path) -> dict[str, Callable[[], Outcome | None]]:
    """What runs on a checkpoint: ``describe_checkpoint`` and ``dduf info CKPT`` (header only), then
    ``plan_single_file`` / ``dduf info CKPT --base`` and ``dduf pack CKPT --base`` (conversion, comparison), and
    the model-folder search for BASE's components in it (``load_dduf(model_dirs=...)`` of a partial archive)."""
    from dduf_plus.packing.single_file import describe_checkpoint, plan_single_file

    return {
        "sf-describe": lambda: _sf_python(lambda: describe_checkpoint(ckpt)),
        "sf-info": lambda: _cli(["info", str(ckpt)], human=True),
        "sf-plan": lambda: _sf_python(lambda: plan_single_file(ckpt, str(base))),
        "sf-info-base": lambda: _cli(["info", str(ckpt), "--base", str(base)], human=True),
        "sf-pack": lambda: _cli(["pack", str(ckpt), "--base", str(base), "-o", str(out), "-q"], human=True),
        "sf-model-dirs": lambda: _sf_model_dirs(ckpt, base),
    }


def run_single_file_targets(ckpt: Path, base: Path, out: Path, *, limit_s: float | None = 60.0) -> list[Outcome]:
    """Run every single-file target on ``ckpt`` against ``base``; each outcome classified, none raises. The
    conversion targets are skipped when the header-only one refused the file (they read the same header)."""
    outcomes: list[Outcome] = []
    for target, run in single_file_targets(ckpt, base, out).items():
        if target not in ("sf-describe", "sf-info", "sf-model-dirs") and outcomes and outcomes[0].status == "error":
            continue
        outcomes.append(run_target(target, run, limit_s))
        if out.exists():
            out.unlink()
    return outcomes
