"""Host memory for KV chunks on their way to the KV store.

A put copies a chunk from the GPU cache to host memory before the step goes on (a later forward
may overwrite its blocks) and a background thread sends it from there. On CUDA that memory is
one pinned tensor of chunk-sized slots, allocated once when the worker starts: a put is then a
slot taken from a free list and one DMA into it. Allocating pinned memory per put, as before,
cost the step thread milliseconds per 32 MiB chunk (an 8k-token prompt of an 8B model puts
1 GiB) and halved decode throughput with the store on.

When every slot is taken (the store is slower than the prompts arrive) a put is dropped: a later
request computes that chunk instead of loading it, nothing else is lost. On the CPU the chunk the
gather made is sent as it is; only the bytes in flight are bounded.
"""

from __future__ import annotations

import logging
import math
import threading

import torch

log = logging.getLogger(__name__)


class PutStaging:
    def __init__(
        self, chunk_shape: tuple[int, ...], dtype: torch.dtype, total_bytes: int, pinned: bool
    ) -> None:
        self.chunk_shape = chunk_shape
        self.chunk_bytes = math.prod(chunk_shape) * dtype.itemsize
        self.total_bytes = total_bytes
        self.pending_bytes = 0  # bytes handed out and not yet given back
        self._lock = threading.Lock()
        self.pool: torch.Tensor | None = None
        num_slots = total_bytes // self.chunk_bytes if pinned and self.chunk_bytes else 0
        if num_slots:
            try:
                self.pool = torch.empty((num_slots, *chunk_shape), dtype=dtype, pin_memory=True)
            except RuntimeError as e:  # no pinned memory to be had: fresh buffers per put
                log.warning("kv store put staging not pinned", extra={"bytes": total_bytes, "error": str(e)})
        self._free = list(range(self.pool.shape[0])) if self.pool is not None else []

    @property
    def num_slots(self) -> int:
        return 0 if self.pool is None else self.pool.shape[0]

    def take(self, shape: tuple[int, ...]) -> tuple[int, torch.Tensor | None] | None:
        """Room for a chunk of `shape`: (slot, its pinned buffer), (-1, None) where the caller
        keeps its own copy (CPU, or a shape other than a chunk's), or None when full (drop it)."""
        nbytes = self.nbytes(shape)
        with self._lock:
            if self.pending_bytes + nbytes > self.total_bytes:
                return None
            if self.pool is not None and tuple(shape) == self.chunk_shape:
                if not self._free:
                    return None
                slot = self._free.pop()
                self.pending_bytes += nbytes
                return slot, self.pool[slot]
            self.pending_bytes += nbytes
            return -1, None

    def nbytes(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * self.chunk_bytes // math.prod(self.chunk_shape)

    def give_back(self, slot: int, shape: tuple[int, ...]) -> None:
        with self._lock:
            self.pending_bytes -= self.nbytes(shape)
            if slot >= 0:
                self._free.append(slot)
