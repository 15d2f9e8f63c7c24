"""How big a model may be built: bounded by the weights the archive stores for it.

The budget itself lives on the packing floor (:mod:`dduf_plus.torchkit.meta_model`), because
``dduf pack --dtype`` builds models from untrusted configs too and packing sits below loading; this module
is the loader's name for it. Every path that builds a model runs under it: plain diffusers and transformers
models (``models.py``), quanto components (``quanto_qmap.json`` or a ``quantization_config``: ``quant.py``,
through ``meta_model``) and the conversion skeleton of ``dduf pack --dtype``."""

from __future__ import annotations

from ..torchkit.meta_model import (  # noqa: F401 (re-exported)
    ELEMENT_FACTOR,
    ELEMENT_SLACK,
    MODULE_FACTOR,
    MODULE_SLACK,
    ConstructionBudgetError,
    StoredTensors,
    construction_budget,
    stored_elements,
)

__all__ = ["ELEMENT_FACTOR", "ELEMENT_SLACK", "MODULE_FACTOR", "MODULE_SLACK", "ConstructionBudgetError",
           "StoredTensors", "construction_budget", "stored_elements"]
