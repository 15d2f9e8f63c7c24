"""Pause Python's cyclic garbage collector while a component is being built.

Building a model allocates tens of thousands of small objects (modules, parameters, dicts) and frees almost
none of them: nothing for the cyclic collector to find. Yet those allocations trip its thresholds, and in a
process that has just imported torch, diffusers and transformers (a million-odd long-lived objects) the first
full collection they trigger takes 0.2-0.3 s here: about as long as building the whole SD-1.5-shaped
pipeline. Reference counting still frees everything as usual while paused; only the cycle search waits.

The pause covers the construction of one component at a time (never a network wait, so cyclic garbage from
a remote fetch is not kept longer), nests, is shared by concurrent loads in threads, and leaves the collector
disabled when the application had disabled it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_resume = False  # whether the collector was enabled when the outermost pause began


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Within the block, no automatic cyclic collection; on leaving the outermost block it is as before."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
