"""External component references of partial archives: SPEC parsing, resolution on this machine (local
paths, the Hugging Face cache by repo or by content, Hub downloads) and content verification.

Torch-free; ``dduf refs`` and ``dduf complete`` use it without importing the loader."""

from __future__ import annotations

from .cache import add_to_hf_cache, hf_hub_cache, verified_hashes
from .resolve import (
    Located,
    Spec,
    check_references,
    locate_component,
    parse_ref_args,
    parse_spec,
)

__all__ = [
    "Located",
    "Spec",
    "add_to_hf_cache",
    "check_references",
    "hf_hub_cache",
    "locate_component",
    "parse_ref_args",
    "parse_spec",
    "verified_hashes",
]
