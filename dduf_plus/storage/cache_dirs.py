"""Every folder dduf_plus caches into, in one place.

    $DDUF_PLUS_CACHE            (default: huggingface_hub's cache home + /dduf_plus: $HF_HOME/dduf_plus,
      files/                      else $XDG_CACHE_HOME/huggingface/dduf_plus, else ~/.cache/huggingface/dduf_plus)
      zst/                      decompressed .dduf.zst archives, by content (format.zst_cache)
      refs/                     verified hashes, views of Hub-cache blobs (refs.cache)
      remote/                   archives fetched from URLs, by content (remote)
    files/                      small files the loader hands to tokenizers (loading.files)

The Hugging Face Hub cache itself (``hf_hub_cache``) is huggingface_hub's: $HF_HUB_CACHE, else $HF_HOME/hub.
Computed like huggingface_hub does, without importing it (the format layer starts fast)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "DDUF_PLUS_CACHE"
KINDS = ("files", "zst", "refs", "remote")


def _expand(path: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(path)))


def hf_home() -> Path:
    """huggingface_hub's cache home: ``$HF_HOME``, else ``$XDG_CACHE_HOME/huggingface``, else ``~/.cache/huggingface``."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return _expand(home)


def hf_hub_cache() -> Path:
    """The Hub cache (``$HF_HUB_CACHE`` or the legacy ``$HUGGINGFACE_HUB_CACHE``, else ``hf_home()/hub``)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return _expand(explicit) if explicit else hf_home() / "hub"


def cache_root() -> Path:
    """dduf_plus's own cache root: ``$DDUF_PLUS_CACHE``, else ``hf_home()/dduf_plus``."""
    explicit = os.environ.get(CACHE_ENV)
    return _expand(explicit) if explicit else hf_home() / "dduf_plus"


def cache_dir(kind: str) -> Path:
    """The folder of one cache (``"files"``, ``"zst"``, ``"refs"``, ``"remote"``) under :func:`cache_root`."""
    if kind not in KINDS:
        raise ValueError(f"unknown cache {kind!r}; one of {', '.join(KINDS)}")
    return cache_root() / kind
