"""Class names in model_index.json checked at pack time, without importing torch.

A typo (``UNet2DConditionModle``) packs into a valid archive that no loader can build; ``dduf pack`` says
so as a warning (the archive is still valid DDUF, and a newer library, or a custom one, may have the class).
diffusers' classes are read from its top-level ``__init__.py`` as text (importing diffusers imports torch,
seconds); transformers' from its lazy import table (``import transformers`` does not import torch), in a
thread that overlaps the writing."""

from __future__ import annotations

import difflib
import importlib.util
import logging
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..format.structure import component_specs

logger = logging.getLogger(__name__)

_QUOTED = re.compile(r"\"([A-Za-z_][A-Za-z0-9_]*)\"")
CHECKED = ("diffusers", "transformers")


def known_classes(library: str) -> set[str] | None:
    """Class names ``library`` exports, or None when it is not installed (nothing to check against)."""
    with _LOCK:  # one import at a time from here
        return _known_classes(library)


_LOCK = threading.Lock()


def _known_classes(library: str) -> set[str] | None:
    found = importlib.util.find_spec(library)
    if found is None or found.origin is None:
        return None
    if library == "diffusers":
        return set(_QUOTED.findall(Path(found.origin).read_text(encoding="utf-8", errors="replace")))
    if library == "transformers":
        import transformers  # lazy module: the table of names, no torch

        table = getattr(transformers, "_class_to_module", None)
        return set(table or ()) | set(dir(transformers))
    return None


def _is_known(cls: str, known: set[str]) -> bool:
    if cls in known:
        return True
    # transformers 5 serves every *TokenizerFast / *ImageProcessorFast name as its base class
    return any(cls.endswith(s) and cls[: -len("Fast")] in known for s in ("TokenizerFast", "ProcessorFast"))


def unknown_class_problems(model_index: Mapping[str, Any]) -> list[str]:
    """One line per class model_index.json names that its library (installed here) does not have."""
    wanted: list[tuple[str, str, str]] = []  # (what, library, class)
    pipeline = model_index.get("_class_name")
    if isinstance(pipeline, str):
        wanted.append(("pipeline class", "diffusers", pipeline))
    for name, (library, cls) in sorted(component_specs(model_index).items()):
        if library in CHECKED and isinstance(cls, str):
            wanted.append((f"component {name!r}", library, cls))
    problems: list[str] = []
    tables: dict[str, set[str] | None] = {}
    for what, library, cls in wanted:
        if library not in tables:
            try:
                tables[library] = known_classes(library)
            except Exception as e:  # a broken install must not stop a pack: no check then
                logger.debug("cannot list %s classes: %s", library, e)
                tables[library] = None
        known = tables[library]
        if known is None or _is_known(cls, known):
            continue
        close = difflib.get_close_matches(cls, sorted(known), n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        problems.append(f"model_index.json: {what} is {library}.{cls}, which {library} does not have{hint}; "
                        "no loader can build it")
    return problems


class ClassCheck:
    """:func:`unknown_class_problems`, in a thread when ``background`` (the caller imports no library meanwhile:
    a module imported by two threads at once can be seen half-initialised); :meth:`report` logs its warnings,
    waiting at most ``timeout`` seconds (a warning is not worth holding a pack). Call :meth:`report` on every
    path (``finally``), so no import outlives the pack."""

    def __init__(self, model_index: Mapping[str, Any], *, background: bool = True):
        self._problems: list[str] = []
        self._thread = threading.Thread(target=self._run, args=(dict(model_index),), daemon=True,
                                        name="dduf-class-check")
        if background:
            self._thread.start()
        else:
            self._run(dict(model_index))

    def _run(self, model_index: dict[str, Any]) -> None:
        try:
            self._problems = unknown_class_problems(model_index)
        except Exception as e:  # never fail a pack over a warning
            logger.debug("class name check failed: %s", e)

    def report(self, timeout: float = 10.0) -> list[str]:
        if self._thread.ident is not None:
            self._thread.join(timeout)
        problems = [] if self._thread.is_alive() else list(self._problems)
        for line in problems:
            logger.warning("%s", line)
        return problems
