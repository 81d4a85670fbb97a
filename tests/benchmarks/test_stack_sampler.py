"""`benchmarks/stack_sampler.py`: where a busy thread stood, and parked threads left out."""

from __future__ import annotations

import threading
import time

from benchmarks.stack_sampler import StackSampler


def _spin(until: float) -> None:
    while time.perf_counter() < until:
        sum(range(100))


def test_samples_show_where_a_busy_thread_stood() -> None:
    sampler = StackSampler(interval_s=0.001, depth=3)
    parked = threading.Event()
    idle = threading.Thread(target=parked.wait, name="parked", daemon=True)
    idle.start()
    sampler.start()
    t0 = time.perf_counter()
    busy = threading.Thread(target=_spin, args=(t0 + 0.1,), name="busy")
    busy.start()
    busy.join()
    t1 = time.perf_counter()
    sampler.stop()
    parked.set()
    top = sampler.during([(t0, t1)], top=10)
    assert any(thread == "busy" and "_spin" in sig for thread, sig, _ in top), top
    assert not any(thread == "parked" for thread, _, _ in top)  # waiting on an Event: left out
    assert sampler.during([(t1 + 10, t1 + 11)]) == []
    n, longest = sampler.gaps(over_s=0.005)
    assert n >= 0 and longest >= 0.0
