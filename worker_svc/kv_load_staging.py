"""Host memory that store loads over the bulk path land in, on their way to the GPU cache.

The bulk path (kvstore_svc/bulk.py) receives each entry's payload straight into a buffer the
caller gives. On CUDA that buffer is a slice of one pinned tensor of chunk-sized slots: the
kernel's socket reads write the bytes where the DMA to the device (queued as each chunk is whole)
reads them, with no copy in Python, no join and no pageable bounce (a pageable source makes the
driver copy through its own pinned buffer at a few GB/s). Pinning is slow (~0.3 s a GiB on an
H100 host), so the tensor is made once, ahead of the first load (`reserve`, on the worker's
preparation thread), and reused.

A load larger than the staging goes in rounds: each round waits for the upload out of the
slots before it writes them again (`take` after `uploaded`).
"""

from __future__ import annotations

import logging
import math
import threading

import torch

log = logging.getLogger(__name__)


class LoadStaging:
    def __init__(
        self, chunk_shape: tuple[int, ...], dtype: torch.dtype, max_bytes: int, pinned: bool = True
    ) -> None:
        """`pinned` False: pageable slots (a diagnostic, worker_svc/kv_diagnostics: slower uploads)."""
        self.chunk_shape = chunk_shape
        self.pinned = pinned
        self.dtype = dtype
        self.chunk_bytes = math.prod(chunk_shape) * dtype.itemsize
        self.max_chunks = max(1, max_bytes // self.chunk_bytes) if self.chunk_bytes else 0
        self.pool: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._upload: torch.cuda.Event | None = None  # the last copy out of the pool

    def reserve(self) -> None:
        """Allocate the pinned slots now (once); a failure leaves loads to allocate them."""
        with self._lock:
            if self.pool is not None or not self.max_chunks:
                return
            try:
                self.pool = torch.empty(
                    (self.max_chunks, *self.chunk_shape), dtype=self.dtype, pin_memory=self.pinned
                )
            except RuntimeError as e:  # no pinned memory to be had: pageable (slower uploads)
                log.warning("kv load staging not pinned", extra={"chunks": self.max_chunks, "error": str(e)})
                self.pool = torch.empty((self.max_chunks, *self.chunk_shape), dtype=self.dtype)

    def take(self) -> torch.Tensor:
        """The slots, [max_chunks, *chunk_shape], once the last upload out of them has finished."""
        self.reserve()
        if self._upload is not None:
            self._upload.synchronize()
            self._upload = None
        assert self.pool is not None
        return self.pool

    def uploaded(self, event: torch.cuda.Event) -> None:
        """The copy out of the slots just queued: the next `take` waits for it."""
        self._upload = event
