"""The memory tier: blobs in a dict, least recently used evicted first, within a byte budget.

Every operation is O(1) (an OrderedDict: move_to_end on a hit, popitem(last=False)
to evict) under one lock, held only for dict operations, never for I/O.
Blobs were validated when they came in, and memory does not rot, so reads are
trusted (the store skips the payload checksum for this tier).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvstore_svc.tiers.base import Counters, EntryKey, TierStats
from services.kv_entry import EntryHeader, decode_entry


class MemoryTier:
    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[EntryKey, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._counters = Counters()

    def get(self, key: EntryKey) -> bytes | None:
        with self._lock:
            blob = self._entries.get(key)
            if blob is not None:
                self._entries.move_to_end(key)
        self._counters.add("hits" if blob is not None else "misses")
        return blob

    def get_entry(self, key: EntryKey) -> tuple[EntryHeader, memoryview] | None:
        """(header, payload view into the blob): checked on the way in, sizes only here."""
        blob = self.get(key)
        return None if blob is None else decode_entry(blob, verify_checksum=False)

    def put(self, key: EntryKey, blob: bytes) -> bool:
        size = len(blob)
        if size > self.capacity_bytes:
            return False  # would evict everything and still not fit
        evicted = 0
        with self._lock:
            if key in self._entries:  # content-addressed: the same key holds the same bytes
                self._entries.move_to_end(key)
                return True
            while self._used + size > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self._used -= len(old)
                evicted += 1
            self._entries[key] = blob
            self._used += size
        self._counters.add("puts")
        if evicted:
            self._counters.add("evictions", evicted)
        return True

    def contains(self, key: EntryKey) -> bool:
        with self._lock:
            return key in self._entries

    def contains_many(self, keys: Sequence[EntryKey]) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def delete(self, key: EntryKey) -> bool:
        with self._lock:
            blob = self._entries.pop(key, None)
            if blob is not None:
                self._used -= len(blob)
        return blob is not None

    def note_corrupt(self, key: EntryKey) -> None:
        self._counters.add("corrupt")
        self.delete(key)

    def stats(self) -> TierStats:
        with self._lock:
            entries, used = len(self._entries), self._used
        return self._counters.snapshot(
            self.name, entries=entries, bytes=used, capacity_bytes=self.capacity_bytes
        )

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used = 0
