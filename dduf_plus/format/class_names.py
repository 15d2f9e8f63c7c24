"""Class names in model_index.json checked against the installed libraries, cheaply and without importing torch.

A typo (``UNet2DConditionModle``) makes an archive every ZIP and DDUF reader accepts and no loader can build:
``dduf validate`` and ``load_dduf`` refuse it (D017, an error, with the closest name), ``dduf pack`` says so
before it packs (:mod:`dduf_plus.packing.class_names`) and then refuses to write it. D016 lives here too: a
component the class name and config files say is a model, stored without weights. Only diffusers and transformers are checked, and only when installed
here: a class of another library, or of a library this machine lacks, is nothing to check against.
Importing diffusers imports torch and importing transformers scans ~2,600 files (seconds on a busy machine),
so names are first looked up in the libraries' source text: diffusers' top-level ``__init__.py`` lists every
class it exports; transformers' ``__init__.py`` and ``models/auto/*.py`` name the common ones, and the model
folder a class name starts with (``clip`` for ``CLIPTextModelWithProjection``) the rest. Only a name found in
none of these (a typo, a rare class) imports ``transformers`` (its lazy table, no torch) before it is reported.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
import logging
import re
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from .findings import Finding, finding
from .structure import component_specs

logger = logging.getLogger(__name__)

_QUOTED = re.compile(r"[\"']([A-Za-z_][A-Za-z0-9_]*)[\"']")
_DEFINED = re.compile(r"^(?:class\s+([A-Za-z_][A-Za-z0-9_]*)|([A-Za-z_][A-Za-z0-9_]*)\s*=)", re.M)
CHECKED = ("diffusers", "transformers")


def _package_root(library: str) -> Path | None:
    found = importlib.util.find_spec(library)
    return Path(found.origin).parent if found is not None and found.origin else None


def _names_in(paths: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        names.update(_QUOTED.findall(text))
        names.update(a or b for a, b in _DEFINED.findall(text))
    return names


class _Library:
    """What one installed library is known to export, looked up from cheapest to dearest: its top-level
    ``__init__.py`` (diffusers lists every class there), then for transformers the model folder the class name
    starts with (``clip`` for ``CLIPTextModelWithProjection``), then ``models/auto/*.py``, last its lazy table."""

    def __init__(self, name: str, root: Path):
        self.name, self.root = name, root
        self.known = _names_in([root / "__init__.py"] if (root / "__init__.py").is_file() else [])
        self._auto_read = name != "transformers"
        self._full: set[str] | None = None

    def has(self, cls: str) -> bool:
        if self._listed(cls, self.known):
            return True
        if self.name != "transformers":
            return False
        compact = cls.lower()
        folders = [d for d in (self.root / "models").iterdir() if d.is_dir() and compact.startswith(d.name.replace("_", ""))]
        self.known |= _names_in([p for d in folders for p in sorted(d.glob("*.py"))])
        if self._listed(cls, self.known):
            return True
        if not self._auto_read:
            self._auto_read = True
            self.known |= _names_in(sorted((self.root / "models" / "auto").glob("*.py")))
            if self._listed(cls, self.known):
                return True
        return self._listed(cls, self.full())

    def full(self) -> set[str]:
        """transformers' lazy import table (``import transformers`` does not import torch)."""
        if self._full is None:
            import transformers

            self._full = set(getattr(transformers, "_class_to_module", None) or ()) | set(dir(transformers))
        return self._full

    @staticmethod
    def _listed(cls: str, known: set[str]) -> bool:
        # transformers 5 serves every *TokenizerFast / *ImageProcessorFast name as its base class
        return cls in known or any(cls.endswith(s) and cls[: -len("Fast")] in known
                                   for s in ("TokenizerFast", "ProcessorFast"))

    def closest(self, cls: str) -> str | None:
        pool = self.known | (self._full or set())
        found = difflib.get_close_matches(cls, sorted(pool), n=1, cutoff=0.8)
        return found[0] if found else None


_LIBRARIES: dict[str, _Library | None] = {}  # per process: a server reads each library's source once
# validate runs on many threads (validate_many, dduf serve): a lookup grows a library's name set, so every
# lookup holds the lock (after the first, each is a few set look-ups)
_LIBRARIES_LOCK = threading.RLock()


def forget_libraries() -> None:
    """Drop what was read of the libraries (after installing or upgrading one in a running server)."""
    with _LIBRARIES_LOCK:
        _LIBRARIES.clear()


def _library(name: str) -> _Library | None:
    with _LIBRARIES_LOCK:
        if name not in _LIBRARIES:
            root = _package_root(name)
            _LIBRARIES[name] = _Library(name, root) if root is not None else None
        return _LIBRARIES[name]


class UnknownClass(NamedTuple):
    """A class model_index.json names that its library (installed here) does not have."""

    component: str | None  # None: the pipeline class (``_class_name``)
    library: str
    class_name: str
    closest: str | None  # difflib's closest name the library has, if any is close

    def message(self) -> str:
        what = "the pipeline class" if self.component is None else f"component {self.component!r}"
        hint = f" (did you mean {self.closest}?)" if self.closest else ""
        return (f"model_index.json: {what} is {self.library}.{self.class_name}, which {self.library} "
                f"{_version(self.library)} does not have{hint}; no loader can build it")


def _version(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - found by find_spec, not installed
        return "(installed here)"


_REMAPPED = re.compile(r"[\"']([A-Za-z_][A-Za-z0-9_]*)[\"']\s*:\s*\{\s*[\"']new_class[\"']\s*:\s*[\"']([A-Za-z_][A-Za-z0-9_]*)")


def _renamed_transformers_classes() -> dict[str, str]:
    """Old transformers class names diffusers' loader maps to new ones (``CLIPFeatureExtractor`` ->
    ``CLIPImageProcessor``: diffusers.utils.deprecation_utils), read from its source like the rest."""
    root = _package_root("diffusers")
    path = root / "utils" / "deprecation_utils.py" if root is not None else None
    if path is None or not path.is_file():
        return {}
    return dict(_REMAPPED.findall(path.read_text(encoding="utf-8", errors="replace")))


def unknown_classes(model_index: Mapping[str, Any], *, include_pipeline: bool = True) -> list[UnknownClass]:
    """Every class model_index.json names (each component's; the pipeline's with ``include_pipeline``) that
    its library, installed here, does not have. Reads the libraries' source text (milliseconds); imports transformers (its lazy table, no
    torch) only for a name found nowhere else."""
    wanted: list[tuple[str | None, str, str]] = []  # (component, library, class)
    pipeline = model_index.get("_class_name")
    if include_pipeline and isinstance(pipeline, str):
        wanted.append((None, "diffusers", pipeline.removeprefix("Flax")))
    for name, (library, cls) in sorted(component_specs(model_index).items()):
        if library in CHECKED and isinstance(cls, str):
            wanted.append((name, library, cls))
    renamed: dict[str, str] | None = None
    found: list[UnknownClass] = []
    with _LIBRARIES_LOCK:
        for component, library, cls in wanted:
            lib = _library(library)
            if lib is None or lib.has(cls):
                continue  # not installed here: nothing to check against
            if library == "transformers":
                renamed = _renamed_transformers_classes() if renamed is None else renamed
                if cls in renamed and lib.has(renamed[cls]):
                    continue
            found.append(UnknownClass(component, library, cls, lib.closest(cls)))
    return found


def unknown_class_problems(model_index: Mapping[str, Any]) -> list[str]:
    """One line per class model_index.json names that its library (installed here) does not have."""
    return [u.message() for u in unknown_classes(model_index)]


def class_findings(model_index: Mapping[str, Any]) -> list[Finding]:
    """D017 for each component class its library does not have (the entry is the component). The pipeline
    class is ``dduf pack``'s warning only: test and example archives name made-up pipelines, and the loader
    says itself (no rule code) when it cannot find one. A library that cannot be read (a broken install)
    checks nothing."""
    try:
        found = unknown_classes(model_index, include_pipeline=False)
    except (OSError, ImportError) as e:
        logger.debug("class name check skipped: %s", e)
        return []
    return [finding("D017", u.component or "model_index.json", u.message()) for u in found]


# --- D016: a model component stored without weights -----------------------------------------------------
# Class-name endings of the weightless kinds the loader builds from a config or small files alone (diffusers
# schedulers, guiders and image processors; transformers tokenizers, feature extractors, image processors
# and processors), and the config files only those kinds have: neither needs weights.
WEIGHTLESS_CLASS_SUFFIXES = ("Scheduler", "Tokenizer", "TokenizerFast", "FeatureExtractor", "Processor",
                             "ProcessorFast", "Guidance", "Guider")
WEIGHTLESS_CONFIGS = ("scheduler_config.json", "tokenizer_config.json", "preprocessor_config.json",
                      "guider_config.json")


def is_model_component(class_name: str | None, files: Iterable[str]) -> bool:
    """Whether a stored component is a model (its loader needs weights): a ``config.json`` and no config of a
    weightless kind, and a class name (when known) that is not one of the weightless kinds."""
    names = set(files)
    if "config.json" not in names or names & set(WEIGHTLESS_CONFIGS):
        return False
    return not (isinstance(class_name, str) and class_name.endswith(WEIGHTLESS_CLASS_SUFFIXES))


def missing_weight_findings(components: Iterable[Any]) -> list[Finding]:
    """D016 for each stored model component (:func:`is_model_component`) whose folder holds a config and no
    ``.safetensors`` file. ``components``: :class:`~dduf_plus.format.archive.Component` records; referenced
    and null components are left out (they are stored elsewhere, or not at all)."""
    out: list[Finding] = []
    for c in components:
        if c.library is None or c.external is not None or not c.files:
            continue
        if is_model_component(c.class_name, c.files) and not any(f.endswith(".safetensors") for f in c.files):
            out.append(finding("D016", c.name, f"{c.library}.{c.class_name} is a model, but its folder holds "
                               f"no .safetensors weights (has: {', '.join(c.files)}); no loader can build it"))
    return out
