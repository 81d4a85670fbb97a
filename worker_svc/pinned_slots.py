"""Page-locked host buffers that kernels read or write directly (`kernels.triton.pinned_io`).

torch's page-locked allocator knows when a buffer's copies are done (it records an event for
each `copy_`), but not when a kernel is: a buffer handed back to it while a kernel still stores
into it could go to another tensor. So the buffers a kernel touches come from here and come back
here, each with the event that marks the last GPU work on it. A buffer goes out again only once
that event has fired and its holder let go of it (its `Slot` garbage-collected).
Buffers come in power-of-two sizes from 4 KiB; a step of decode takes two (its inputs, its
ids), and they circle back within a step or two. The pool keeps every buffer it made: page-
locking a new one may wait for the device, so that happens once a size, while the engine warms.
"""

from __future__ import annotations

import threading
import weakref

import torch

_MIN_BYTES = 4096


class Slot:
    """A page-locked byte buffer lent by `PinnedSlots`. `record()` after the launch that reads or
    writes it; it goes back to the pool when this object is dropped. Views of `buffer` must not
    outlive it."""

    def __init__(self, pool: PinnedSlots, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self._last_use = _LastUse()
        weakref.finalize(self, pool._give_back, buffer, self._last_use)  # holds no reference to self

    def record(self) -> torch.cuda.Event | None:
        """Mark the GPU work queued so far (on the current stream) as the buffer's last use
        (None for a buffer that is not page-locked: the interpreter's launches are done once
        they return)."""
        if not self.buffer.is_pinned():
            return None
        event = torch.cuda.Event()
        event.record()
        self._last_use.event = event
        return event


class _LastUse:
    """The event of a slot's last GPU use (None: none queued), shared with its finalizer."""

    event: torch.cuda.Event | None = None


class PinnedSlots:
    """A pool of page-locked host buffers for kernels to read or write (thread-safe)."""

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin  # False: ordinary host memory, for the interpreter's launches (CPU tests)
        self._free: dict[int, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Slot:
        """A buffer of at least `nbytes` that no GPU work or holder still uses."""
        size = max(_MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())
        with self._lock:
            free = self._free.setdefault(size, [])
            for i, (buffer, event) in enumerate(free):
                if event is None or event.query():
                    del free[i]
                    return Slot(self, buffer)
        return Slot(self, torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))

    def _give_back(self, buffer: torch.Tensor, last_use: _LastUse) -> None:
        with self._lock:
            self._free.setdefault(buffer.numel(), []).append((buffer, last_use.event))
