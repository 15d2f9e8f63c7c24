"""Class names in model_index.json checked at pack time, cheaply and without importing torch.

A typo (``UNet2DConditionModle``) packs into a valid archive that no loader can build; ``dduf pack`` says
so as a warning (the archive is still valid DDUF, and a newer library, or a custom one, may have the class).
Importing diffusers imports torch and importing transformers scans ~2,600 files (seconds on a busy machine),
so names are first looked up in the libraries' source text: diffusers' top-level ``__init__.py`` lists every
class it exports; transformers' ``__init__.py`` and ``models/auto/*.py`` name the common ones, and the model
folder a class name starts with (``clip`` for ``CLIPTextModelWithProjection``) the rest. Only a name found in
none of these (a typo, a rare class) imports ``transformers`` (its lazy table, no torch) before it is reported.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..format.structure import component_specs

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
    """What one installed library is known to export, looked up from cheapest to dearest."""

    def __init__(self, name: str, root: Path):
        self.name, self.root = name, root
        first = [root / "__init__.py"]
        if name == "transformers":
            first += sorted((root / "models" / "auto").glob("*.py"))
        self.known = _names_in([p for p in first if p.is_file()])
        self._full: set[str] | None = None

    def has(self, cls: str) -> bool:
        if self._listed(cls, self.known):
            return True
        if self.name != "transformers":
            return False
        compact = cls.lower()
        folders = [d for d in (self.root / "models").iterdir() if d.is_dir() and compact.startswith(d.name.replace("_", ""))]
        self.known |= _names_in([p for d in folders for p in sorted(d.glob("*.py"))])
        return self._listed(cls, self.known) or self._listed(cls, self.full())

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


def unknown_class_problems(model_index: Mapping[str, Any]) -> list[str]:
    """One line per class model_index.json names that its library (installed here) does not have."""
    wanted: list[tuple[str, str, str]] = []  # (what, library, class)
    pipeline = model_index.get("_class_name")
    if isinstance(pipeline, str):
        wanted.append(("pipeline class", "diffusers", pipeline))
    for name, (library, cls) in sorted(component_specs(model_index).items()):
        if library in CHECKED and isinstance(cls, str):
            wanted.append((f"component {name!r}", library, cls))
    libraries: dict[str, _Library | None] = {}
    problems: list[str] = []
    for what, library, cls in wanted:
        if library not in libraries:
            root = _package_root(library)
            libraries[library] = _Library(library, root) if root is not None else None
        lib = libraries[library]
        if lib is None or lib.has(cls):
            continue  # not installed here: nothing to check against
        close = lib.closest(cls)
        hint = f" (did you mean {close}?)" if close else ""
        problems.append(f"model_index.json: {what} is {library}.{cls}, which {library} does not have{hint}; "
                        "no loader can build it")
    return problems


def warn_unknown_classes(model_index: Mapping[str, Any]) -> list[str]:
    """:func:`unknown_class_problems`, logged as warnings; a broken install never stops a pack."""
    try:
        problems = unknown_class_problems(model_index)
    except Exception as e:  # (OSError, a library's import failing...): no check then
        logger.debug("class name check skipped: %s", e)
        return []
    for line in problems:
        logger.warning("%s", line)
    return problems
