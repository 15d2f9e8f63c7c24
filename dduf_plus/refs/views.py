"""Folders that show the loader exactly a component's recorded files: symlinks under dduf_plus' cache, so no
unverified variant or extra file beside them is ever read (:mod:`.resolve` uses them for every located
component that is not an archive)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from ..storage.confined import Confined, plain_name
from . import cache as _cache


def visible_files(folder: Path) -> set[str]:
    try:
        return {e.name for e in os.scandir(folder) if not e.name.startswith(".") and e.is_file()}
    except OSError:
        return set()


def view_folder(component: str, files: Mapping[str, Path]) -> Path:
    """A folder named ``component`` holding exactly ``files`` (symlinks), under dduf_plus' cache: the
    loader then sees the recorded files and nothing else (no unverified variant or extra file). Every
    name is checked to be plain and every write stays inside the cache (:mod:`dduf_plus.storage.confined`)."""
    targets = {f: os.path.realpath(p) for f, p in sorted(files.items())}
    digest = hashlib.sha256(json.dumps(targets, sort_keys=True).encode()).hexdigest()[:24]
    cache = Confined(_cache.dduf_cache_dir())
    views = cache.mkdir(cache.path("views"))
    final = cache.path("views", digest, component)
    if final.is_dir() and not final.is_symlink() and visible_files(final) == set(targets) \
            and all(os.path.realpath(final / plain_name(f, "file name")) == t for f, t in targets.items()):
        return final
    with cache.temp_dir(views, prefix=".view.") as tmp:
        cache.mkdir(tmp / component)
        for f, t in targets.items():
            cache.symlink(t, cache.path("views", tmp.name, component, f))
        cache.remove_tree(final.parent)  # a stale or partial view we made earlier (inside the cache only)
        try:
            cache.replace(tmp, final.parent)
        except OSError:  # another process made it meanwhile
            if not final.is_dir():
                raise
    return final
