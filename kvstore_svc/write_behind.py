"""Write-behind: puts return once the entry is in memory; a thread writes it to the slower tiers.

The queue is bounded in bytes, not entries: what it pins is memory. When it is
full a new write is dropped (counted), never waited for: the entry is still in
memory, and a KV cache may lose entries. Entries queued or being written are
readable through `pending()`, so a read never misses an entry that is only
waiting for its turn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvstore_svc.tiers.base import EntryKey

log = logging.getLogger(__name__)


class WriteBehind:
    def __init__(self, sink: Callable[[EntryKey, bytes], None], capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._sink = sink
        self._queue: OrderedDict[EntryKey, bytes] = OrderedDict()
        self._inflight: tuple[EntryKey, bytes] | None = None
        self._bytes = 0  # queued + in flight
        self._cond = threading.Condition()
        self._closing = False
        self.dropped = 0
        self.written = 0
        self._thread = threading.Thread(target=self._run, name="kv-write-behind", daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        with self._cond:
            return self._bytes

    def offer(self, key: EntryKey, blob: bytes) -> bool:
        """Queue a write; False (and counted) when the queue is full or closing."""
        with self._cond:
            if key in self._queue or (self._inflight is not None and self._inflight[0] == key):
                return True
            if self._closing or self._bytes + len(blob) > self.capacity_bytes:
                self.dropped += 1
                return False
            self._queue[key] = blob
            self._bytes += len(blob)
            self._cond.notify_all()
        return True

    def pending(self, key: EntryKey) -> bytes | None:
        with self._cond:
            if self._inflight is not None and self._inflight[0] == key:
                return self._inflight[1]
            return self._queue.get(key)

    def discard(self, key: EntryKey) -> None:
        """Forget a queued write (the entry was deleted); one in flight completes."""
        with self._cond:
            blob = self._queue.pop(key, None)
            if blob is not None:
                self._bytes -= len(blob)
                self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return  # closing and drained
                self._inflight = self._queue.popitem(last=False)
            key, blob = self._inflight
            try:
                self._sink(key, blob)
            except Exception:  # a sink bug must not kill the thread that every later write needs
                log.exception("write-behind sink failed", extra={"key": key.hex()})
            with self._cond:
                self._inflight = None
                self._bytes -= len(blob)
                self.written += 1
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._bytes:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued writes (up to `timeout`), then stop the thread; later offers are dropped."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("write-behind did not finish in time", extra={"pending_bytes": self.pending_bytes})
