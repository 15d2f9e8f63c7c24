"""``dduf pack``'s warning for class names its libraries do not have (the check itself:
:mod:`dduf_plus.format.class_names`, where ``dduf validate`` reports the same as D017)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..format.class_names import unknown_class_problems

logger = logging.getLogger(__name__)

__all__ = ["unknown_class_problems", "warn_unknown_classes"]


def warn_unknown_classes(model_index: Mapping[str, Any]) -> list[str]:
    """:func:`~dduf_plus.format.class_names.unknown_class_problems`, logged as warnings; a broken install
    never stops a pack."""
    try:
        problems = unknown_class_problems(model_index)
    except Exception as e:  # (OSError, a library's import failing...): no check then
        logger.debug("class name check skipped: %s", e)
        return []
    for line in problems:
        logger.warning("%s", line)
    return problems
