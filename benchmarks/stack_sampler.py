"""Where a process's threads are, sampled every millisecond: what a slow host span was doing.

`sharegpt_profile.py`'s `-stacks` passes run one beside the engine, then ask what the step
thread (and every other thread) was doing during the launches that made the GPU wait. The
sampler is a Python thread: it takes a sample when it gets the GIL, so a thread that holds the
GIL for long shows up as gaps, and every sample of another thread shows where that thread stood
(running, or waiting for the GIL or a lock).
"""

from __future__ import annotations

import collections
import itertools
import sys
import threading
import time
from types import FrameType

# Frames from these files are the interesting ones: the engine's own code, not the stdlib's.
_OURS = ("llmesh/", "worker_svc/", "scheduler_svc/", "kernels/", "services/")
# Innermost frames of a parked thread.
_IDLE = tuple(f"{m}.py:" for m in ("threading", "selectors", "queue"))


def _signature(frame: FrameType | None, depth: int) -> str:
    """The innermost `depth` frames as `file:line func`, innermost first, stdlib frames folded
    into the first of ours below them."""
    parts: list[str] = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        path = code.co_filename
        if not parts or any(p in path for p in _OURS):
            name = "/".join(path.rsplit("/", 2)[-2:])
            parts.append(f"{name}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(parts)


class StackSampler:
    """Samples every thread's stack each `interval_s` into (time, thread name, signature)."""

    def __init__(self, interval_s: float = 0.001, depth: int = 5) -> None:
        self.interval_s = interval_s
        self.depth = depth
        self.samples: list[tuple[float, str, str]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            t = time.perf_counter()
            names = {th.ident: th.name for th in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self.samples.append((t, names.get(ident, str(ident)), _signature(frame, self.depth)))

    def gaps(self, over_s: float = 0.005) -> tuple[int, float]:
        """How many times the sampler itself waited more than `over_s` past its interval (another
        thread held the GIL that long), and the longest wait, in seconds."""
        times = sorted({t for t, _, _ in self.samples})
        waits = [b - a - self.interval_s for a, b in itertools.pairwise(times)]
        long = [w for w in waits if w > over_s]
        return len(long), max(long, default=0.0)

    def during(self, windows: list[tuple[float, float]], top: int = 12) -> list[tuple[str, str, int]]:
        """The most frequent (thread, signature) in the given (start, end) perf_counter windows."""
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        windows = sorted(windows)
        for t, thread, sig in self.samples:
            if sig.split(" ", 1)[0].rsplit("/", 1)[-1].startswith(_IDLE):  # a parked thread
                continue
            if any(a <= t <= b for a, b in windows):
                counts[(thread, sig)] += 1
        return [(th, sig, n) for (th, sig), n in counts.most_common(top)]
