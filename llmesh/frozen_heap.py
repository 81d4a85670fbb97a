"""Keep the cycle collector off the objects that were there before a `generate` began.

A process that imported torch and built a model holds a few hundred thousand long-lived objects
(modules, functions, the model's parameters and their owners). Each full collection walks all
of them while holding the GIL: in the offline engine that stops the planner's loop and the step
thread together, and the GPU runs dry. A ShareGPT-shaped run of 1,000 requests met 3-4 of them
per 20 s run, 100-170 ms each (0.3-0.6 s of idle GPU; `benchmarks/sharegpt_profile.py`, H100).
The worker and scheduler services freeze their heap once, after start; the offline `LLM` lives
in the caller's process, whose objects are not ours to freeze for good, so the heap is frozen
for the length of a call only: `gc.freeze()` and `gc.unfreeze()` move whole generations (no
walk), objects made during the call are collected as usual, and cyclic garbage that existed
at entry waits until the call returns.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # calls inside the frozen span (several threads may generate at once)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze what exists now for the cycle collector until the outermost such span ends."""
    global _depth
    with _lock:
        if _depth == 0:
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
