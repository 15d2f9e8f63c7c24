"""Components model_index.json names but ``save_pretrained`` did not write, as diffusers' ``from_pretrained``
treats them (docs/loading.md, "Pipeline kinds"): ``dduf pack`` stores what the folder holds and says why
such a component has no folder, instead of refusing the folder diffusers loads."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..torchkit.backend_import import offline_imports

logger = logging.getLogger(__name__)


@offline_imports  # imports diffusers (only when a folder lacks a component): no Hub request
def why_not_saved(model_index: Mapping[str, Any], name: str) -> str | None:
    """Why diffusers loads the pipeline although component ``name`` has no folder, or None when it would not.

    diffusers' ``save_pretrained`` saves only the pipeline's required components and its
    ``_optional_components``; an ``__init__`` argument with a default (LongCat audio's ``scheduler=None``) is
    named in model_index.json but not written, and ``from_pretrained`` passes model_index.json's value to
    ``__init__`` instead of loading it (the pipeline then makes its default). Any other component without a
    folder fails there (diffusers loads it from the pipeline folder's root), so it is refused here too."""
    try:
        import diffusers
        from diffusers.pipelines.pipeline_utils import DiffusionPipeline
    except ImportError:  # pragma: no cover - diffusers is a dependency
        return None
    class_name = model_index.get("_class_name")
    cls = getattr(diffusers, class_name, None) if isinstance(class_name, str) and class_name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, DiffusionPipeline)):
        return None
    _expected, optional = DiffusionPipeline._get_signature_keys(cls)
    if name not in optional or name in getattr(cls, "_optional_components", ()):
        return None
    return (f"an argument of {cls.__name__} with a default: diffusers' save_pretrained does not write it, and "
            "from_pretrained passes model_index.json's value to the pipeline instead of loading a folder (the "
            "pipeline makes its default); load_dduf does the same")


__all__ = ["why_not_saved"]
