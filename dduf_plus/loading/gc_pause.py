"""Pause Python's cyclic garbage collector while a load imports its libraries.

A process's first load imports torch, diffusers, transformers and the pipeline's model modules: half a million
tracked objects, next to none of them garbage. Those allocations trip the collector's thresholds again and
again, and each full collection walks everything imported so far: about 1 s of a 7 s first load here. Paused
while the imports run, the collector walks the heap once afterwards (when the next allocations trip it, inside
the same load) instead of many times over a growing heap. Reference counting frees as usual meanwhile.

Paused: the import steps (resolving the dtype request, which imports torch; planning, which imports the
pipeline's module; resolving each component's class) and building a local pipeline's models, whose ~100,000
new objects all live on: paused, they are walked once when the collector resumes (the pipeline's assembly
right after allocates and trips it, inside the same load) instead of by ~50 young and 4 middle-generation
collections, about a third less collector time (3 ms of a warm SD-1.5-shaped load, measured with
``gc.callbacks``; nothing moves past the load). No pause spans a network wait: a remote build, which waits
for bytes between components, is not paused.
Pauses nest and leave the collector disabled when the application had disabled it.

**Only in a process with one thread.** The collector's switch is one for the whole process: another thread
would see ``gc.isenabled()`` False meanwhile, and its own ``gc.disable()`` during the load would be undone when
the pause ends. So a pause begins only when the loading thread is the process's only Python thread
(``threading.active_count() == 1``: a script's or a CLI's first load, where the imports happen); with other
threads alive a load leaves the collector alone (the first load then pays the collections, about 1 s).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_resume = False  # whether the collector was enabled when the outermost pause began


def other_threads_alive() -> bool:
    """Whether another Python thread runs in this process (one that could see the collector's switch)."""
    return threading.active_count() > 1


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Within the block, no automatic cyclic collection (where this is the process's only thread, see the
    module); on leaving the outermost block it is as before."""
    global _depth, _resume
    with _lock:
        pausing = _depth > 0 or not other_threads_alive()  # nested, or no other thread to observe it
        if pausing and _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += pausing
    try:
        yield
    finally:
        with _lock:
            _depth -= pausing
            if pausing and _depth == 0 and _resume:
                gc.enable()
