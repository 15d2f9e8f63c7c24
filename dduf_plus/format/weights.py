"""Weight-file naming, as diffusers and transformers spell it: variants (``model.fp16.safetensors``),
shards (``model-00001-of-00002.safetensors``) and shard indexes (``model.safetensors.index.json``).

One place decides which files of a component make up the weights for a given variant, what a saved weight file
is named (:func:`weights_name`), and which suffixes are checkpoints of any format (:data:`WEIGHT_SUFFIXES`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, NamedTuple

# stem[.variant][-NNNNN-of-NNNNN].safetensors   (diffusers also writes stem.variant-NNNNN-of-NNNNN)
_WEIGHT = re.compile(r"^(?P<stem>[^.]+?)(?:\.(?P<variant>[A-Za-z0-9_]+))?(?P<shard>-\d{5}-of-\d{5})?\.safetensors$")
# stem.safetensors.index[.variant].json     (older: stem.safetensors.index.json only)
_INDEX = re.compile(r"^(?P<stem>[^.]+?)(?:\.(?P<variant1>[A-Za-z0-9_]+))?\.safetensors\.index(?:\.(?P<variant>[A-Za-z0-9_]+))?\.json$")


# The file stems diffusers' and transformers' save_pretrained write (diffusers.utils.constants.SAFETENSORS_WEIGHTS_NAME,
# transformers.utils.SAFE_WEIGHTS_NAME).
DIFFUSERS_STEM = "diffusion_pytorch_model"
TRANSFORMERS_STEM = "model"
# Checkpoint files of any format: never read whole as if they were configs or tokenizer files.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".msgpack", ".h5", ".npz")


def weights_name(library: str | None = "diffusers", variant: str | None = None) -> str:
    """The single-file weights name ``library``'s ``save_pretrained`` writes for ``variant``.

        >>> weights_name(), weights_name("transformers", "fp16")
        ('diffusion_pytorch_model.safetensors', 'model.fp16.safetensors')
    """
    stem = TRANSFORMERS_STEM if library == "transformers" else DIFFUSERS_STEM
    return f"{stem}.{variant}.safetensors" if variant else f"{stem}.safetensors"


class WeightFile(NamedTuple):
    name: str  # file name inside the component folder
    stem: str
    variant: str | None
    sharded: bool
    is_index: bool


def classify(filename: str) -> WeightFile | None:
    """Describe a weight or shard-index file name; None for anything else."""
    m = _INDEX.match(filename)
    if m:
        return WeightFile(filename, m["stem"], m["variant"] or m["variant1"], True, True)
    m = _WEIGHT.match(filename)
    if m:
        return WeightFile(filename, m["stem"], m["variant"], bool(m["shard"]), False)
    return None


def variants(filenames: Iterable[str]) -> set[str]:
    return {w.variant for f in filenames if (w := classify(f)) and w.variant}


def select_weights(filenames: Iterable[str], variant: str | None = None) -> list[str]:
    """The weight files (safetensors and shard indexes) a loader uses for ``variant``.

    Like diffusers: the variant's files when the component has them, else the default ones; a component
    that only has variant files is served from them even without ``variant`` (nothing else exists)."""
    weights = [w for f in filenames if (w := classify(f))]
    chosen = [w for w in weights if w.variant == variant] if variant else []
    if not chosen:
        chosen = [w for w in weights if w.variant is None]
    if not chosen:
        present = sorted({w.variant for w in weights if w.variant})
        chosen = [w for w in weights if w.variant == present[0]] if len(present) == 1 else []
    return sorted(w.name for w in chosen)


def tensor_files(selected: Iterable[str]) -> list[str]:
    return [f for f in selected if f.endswith(".safetensors")]


def shard_map(index: Any) -> dict[str, str] | None:
    """A parsed shard index's ``weight_map`` ({tensor: shard file}) when it is one (an object of strings), else
    None: what every reader of a shard index (validate's D011, the loader, a reference's digest) takes from it."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return None
    return weight_map

