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

Inside the span the run's own long-lived objects (its requests, their token lists) still
build up, and a full collection walked them 7-8 times a ShareGPT run, 12-16 ms each: waits of
the GPU of the same length (`sharegpt_profile.py`'s collections line). So the span also raises
the full collection's threshold (`_SPAN_THRESHOLD2`) and puts it back at the end: young
collections run as before, cycles that reach the oldest generation during the call wait for
the first full collection after it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # calls inside the frozen span (several threads may generate at once)
_saved_thresholds: tuple[int, int, int] | None = None
# Middle-generation collections before a full one, inside a span (CPython's default: 10).
# A ShareGPT run of 1,036 steps met ~95 middle collections: no full walk in ~10^7 steps.
_SPAN_THRESHOLD2 = 1 << 20


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze what exists now for the cycle collector, and hold off its full collections,
    until the outermost such span ends."""
    global _depth, _saved_thresholds
    with _lock:
        if _depth == 0:
            gc.freeze()
            _saved_thresholds = gc.get_threshold()
            t0, t1, _ = _saved_thresholds
            gc.set_threshold(t0, t1, _SPAN_THRESHOLD2)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if _saved_thresholds is not None:
                    gc.set_threshold(*_saved_thresholds)
                    _saved_thresholds = None
                gc.unfreeze()
