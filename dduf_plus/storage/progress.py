"""Progress bars: huggingface_hub's tqdm on a terminal, nothing otherwise."""

from __future__ import annotations

import sys
from typing import Any


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, quiet: bool) -> Any:
    """huggingface_hub's tqdm (honours HF_HUB_DISABLE_PROGRESS_BARS), silent off a TTY or when quiet
    (then not even imported: ~50 ms of a scripted pack)."""
    if quiet or not sys.stderr.isatty():
        return _NoProgress()
    from huggingface_hub.utils import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc,
                disable=quiet or not sys.stderr.isatty())
