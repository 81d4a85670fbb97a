"""The memory tier in the store's shared memory arena: payloads where same-host workers read them.

Same contract as `MemoryTier` (a byte budget, least recently used evicted first, entries
checked once on the way in and trusted after), but each payload lies in one slot of an
`ArenaFile` and its header in this process's index, so that a worker can be told "key k is
at [offset, offset + n) of arena A" and copy it from its own read-only mapping.

Leases keep those bytes still while a worker reads them: a leased slot is never evicted and
its space never reused (an entry deleted or evicted while leased leaves the index at once,
its space is freed at the last release). A lease not released within `lease_timeout_s` (its
worker died or hung) expires and counts in `lease_expiries`. Leases may pin at most
`max_leased_fraction` of the arena, so that puts always find room.

Writers reserve a slot, fill it, then commit it (`reserve` / `commit` / `abort`): the
PutShared path copies a worker's segment straight into the slot and checks it there.

Thread-safe: one lock over the index, the allocator and the leases, never held during a copy.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore_svc.arena import ArenaFile, FreeSpace
from kvstore_svc.shm import SHM_DIR, align
from kvstore_svc.tiers.base import Counters, EntryKey, TierStats
from services.kv_entry import EntryHeader, decode_entry, encode_entry

DEFAULT_LEASE_TIMEOUT_S = 10.0
MAX_LEASES = 4096


@dataclass(eq=False)
class Slot:
    """A payload's place in the arena. `pins`: leases (or copies) reading it now."""

    key: EntryKey
    header: EntryHeader
    offset: int
    pins: int = 0
    dead: bool = False  # left the index while pinned: its space is freed at the last unpin

    @property
    def size(self) -> int:  # the run it occupies
        return align(self.header.payload_length)


@dataclass(eq=False)
class _Lease:
    id: int
    deadline: float
    slots: list[Slot] = field(default_factory=list)


class ArenaMemoryTier:
    name = "memory"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        root: str = SHM_DIR,
        lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
        max_leased_fraction: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """OSError when the arena cannot be made (e.g. /dev/shm is smaller than `capacity_bytes`)."""
        if lease_timeout_s <= 0:
            raise ValueError(f"lease_timeout_s must be > 0, got {lease_timeout_s}")
        self.arena = ArenaFile(capacity_bytes, root)
        self.capacity_bytes = self.arena.size
        self.lease_timeout_s = lease_timeout_s
        self.max_leased_bytes = int(self.capacity_bytes * max_leased_fraction)
        self._clock = clock
        self._free = FreeSpace(self.capacity_bytes)
        self._index: OrderedDict[EntryKey, Slot] = OrderedDict()  # least recently used first
        self._leases: OrderedDict[int, _Lease] = OrderedDict()  # by deadline (one timeout for all)
        self._used = 0  # bytes of indexed slots
        self._leased_bytes = 0  # bytes of slots with pins > 0
        self._lock = threading.Lock()
        self._counters = Counters()
        self.lease_count = 0
        self.lease_expiries = 0

    # -- reads -----------------------------------------------------------------

    def get_entry(self, key: EntryKey) -> tuple[EntryHeader, memoryview] | None:
        """(header, a private copy of the payload): the slot may be reused once this returns."""
        with self._lock:
            slot = self._index.get(key)
            if slot is not None:
                self._index.move_to_end(key)
                self._pin(slot)
        self._counters.add("hits" if slot is not None else "misses")
        if slot is None:
            return None
        try:
            n = slot.header.payload_length
            return slot.header, memoryview(bytes(self.arena.view[slot.offset : slot.offset + n]))
        finally:
            with self._lock:
                self._unpin(slot)

    def get(self, key: EntryKey) -> bytes | None:
        found = self.get_entry(key)
        return None if found is None else encode_entry(found[0], found[1], verify=False)

    def contains(self, key: EntryKey) -> bool:
        with self._lock:
            return key in self._index

    def contains_many(self, keys: Sequence[EntryKey]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    # -- writes ----------------------------------------------------------------

    def reserve(self, key: EntryKey, header: EntryHeader) -> Slot | None:
        """A slot for the payload (evicting unleased entries, least recently used first), or
        None: larger than the arena, or leased entries leave no room. Fill it through
        `view(slot)`, then `commit` or `abort` it."""
        n = header.payload_length
        if align(n) > self.capacity_bytes:
            return None
        evicted = 0
        with self._lock:
            self._expire()
            offset = self._free.alloc(n)
            while offset is None:
                victim = next((s for s in self._index.values() if not s.pins), None)
                if victim is None:
                    break  # everything left is leased
                self._drop(victim)
                evicted += 1
                offset = self._free.alloc(n)
            slot = None if offset is None else Slot(key, header, offset, pins=1)  # pinned until commit
        if evicted:
            self._counters.add("evictions", evicted)
        if slot is not None and not self.arena.commit(slot.offset + slot.size):
            self.abort(slot)  # /dev/shm is full: no SIGBUS, a put the tier cannot keep
            self._counters.add("errors")
            return None
        return slot

    def view(self, slot: Slot) -> memoryview:
        """The slot's bytes, writable (only between reserve and commit)."""
        return self.arena.view[slot.offset : slot.offset + slot.header.payload_length]

    def commit(self, slot: Slot) -> None:
        """Index a filled slot (if the key came meanwhile, the slot is given back: same bytes)."""
        with self._lock:
            slot.pins = 0
            if slot.key in self._index:
                self._index.move_to_end(slot.key)
                self._free.free(slot.offset, slot.size)
                return
            self._index[slot.key] = slot
            self._used += slot.size
        self._counters.add("puts")

    def abort(self, slot: Slot) -> None:
        with self._lock:
            slot.pins = 0
            self._free.free(slot.offset, slot.size)

    def put_entry(self, key: EntryKey, header: EntryHeader, payload: memoryview | bytes) -> bool:
        """Copy a checked payload into the arena; False when it cannot be placed."""
        if self.contains(key):
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
                    return True
        slot = self.reserve(key, header)
        if slot is None:
            return False
        try:
            self.view(slot)[:] = payload
        except BaseException:
            self.abort(slot)
            raise
        self.commit(slot)
        return True

    def put(self, key: EntryKey, blob: bytes) -> bool:
        header, payload = decode_entry(blob, verify_checksum=False)  # checked by the store already
        return self.put_entry(key, header, payload)

    def delete(self, key: EntryKey) -> bool:
        with self._lock:
            slot = self._index.get(key)
            if slot is not None:
                self._drop(slot)
        return slot is not None

    def note_corrupt(self, key: EntryKey) -> None:
        self._counters.add("corrupt")
        self.delete(key)

    # -- leases ----------------------------------------------------------------

    def open_lease(self) -> int | None:
        """A new, empty lease's id (random, never 0), or None when MAX_LEASES are outstanding."""
        with self._lock:
            self._expire()
            if len(self._leases) >= MAX_LEASES:
                return None
            lease_id = 0
            while lease_id == 0 or lease_id in self._leases:
                lease_id = secrets.randbits(63)
            self._leases[lease_id] = _Lease(lease_id, self._clock() + self.lease_timeout_s)
            self.lease_count += 1
            return lease_id

    def pin(self, lease_id: int, key: EntryKey) -> Slot | None | bool:
        """Add `key`'s slot to the lease: the slot; None if the key is not here; False if it is
        but the lease is gone (expired) or leases already hold max_leased_bytes."""
        with self._lock:
            lease = self._leases.get(lease_id)
            slot = self._index.get(key)
            if slot is None:
                self._counters.add("misses")
                return None
            if lease is None or (not slot.pins and self._leased_bytes + slot.size > self.max_leased_bytes):
                return False
            self._index.move_to_end(key)  # a read: recent (and away from the eviction end)
            self._pin(slot)
            lease.slots.append(slot)
        self._counters.add("hits")
        return slot

    def release(self, lease_id: int) -> bool:
        """End a lease; False when it is unknown or already expired."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                for slot in lease.slots:
                    self._unpin(slot)
            self._expire()
        return lease is not None

    def _expire(self) -> None:
        """Under the lock: end leases past their deadline (their holder died or hung)."""
        now = self._clock()
        while self._leases:
            lease = next(iter(self._leases.values()))
            if lease.deadline > now:
                return
            del self._leases[lease.id]
            for slot in lease.slots:
                self._unpin(slot)
            self.lease_expiries += 1

    def _pin(self, slot: Slot) -> None:
        if slot.pins == 0:
            self._leased_bytes += slot.size
        slot.pins += 1

    def _unpin(self, slot: Slot) -> None:
        slot.pins -= 1
        if slot.pins == 0:
            self._leased_bytes -= slot.size
            if slot.dead:
                self._free.free(slot.offset, slot.size)

    def _drop(self, slot: Slot) -> None:
        """Under the lock: take a slot out of the index; its space is free now or at its last unpin."""
        del self._index[slot.key]
        self._used -= slot.size
        if slot.pins:
            slot.dead = True
        else:
            self._free.free(slot.offset, slot.size)

    # -- the rest --------------------------------------------------------------

    @property
    def leased_bytes(self) -> int:
        with self._lock:
            return self._leased_bytes

    @property
    def active_leases(self) -> int:
        with self._lock:
            self._expire()
            return len(self._leases)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free.free_bytes

    def stats(self) -> TierStats:
        with self._lock:
            entries, used = len(self._index), self._used
        return self._counters.snapshot(
            self.name, entries=entries, bytes=used, capacity_bytes=self.capacity_bytes
        )

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._leases.clear()
            self._used = self._leased_bytes = 0
        self.arena.close()
