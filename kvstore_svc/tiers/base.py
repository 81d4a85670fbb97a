"""What every tier shares: the key of an entry, its counters, and the small interface the store calls.

A tier stores opaque blobs (services.kv_entry's format) under an `EntryKey`;
it never parses them. Validation is the store's job, so that a tier is only
about where bytes live, how many fit and which go first.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple, Protocol


class EntryKey(NamedTuple):
    """(fingerprint, block key): the fingerprint is part of the key space, so models never collide."""

    fingerprint: bytes
    key: bytes

    def hex(self) -> str:
        return f"{self.fingerprint.hex()}:{self.key.hex()}"


@dataclass
class TierStats:
    """Counters of one tier (llmesh.v1.TierStats); `entries`/`bytes` are what it holds now."""

    name: str
    entries: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    puts: int = 0
    errors: int = 0
    corrupt: int = 0


class Counters:
    """Monotonic counters a tier bumps from any thread (a lock: `+=` on an attribute is not atomic)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {f.name: 0 for f in fields(TierStats) if f.type in ("int", int)}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def snapshot(self, name: str, **now: int) -> TierStats:
        with self._lock:
            values = dict(self._values)
        values.update(now)
        return TierStats(name=name, **values)


class Tier(Protocol):
    """The store's view of a tier. No method raises for a miss or a failing backend."""

    name: str

    def get(self, key: EntryKey) -> bytes | None:
        """The blob, or None (absent, or the backend failed)."""
        ...

    def put(self, key: EntryKey, blob: bytes) -> bool:
        """Store (or keep, if present); False when the tier could not (too big, backend failed)."""
        ...

    def contains(self, key: EntryKey) -> bool: ...

    def contains_many(self, keys: Sequence[EntryKey]) -> list[bool]:
        """contains() of each key; a remote tier answers in one round trip."""
        ...

    def delete(self, key: EntryKey) -> bool:
        """Remove; True if it was there."""
        ...

    def note_corrupt(self, key: EntryKey) -> None:
        """The store found this tier's copy corrupt: count it and delete it."""
        ...

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...
