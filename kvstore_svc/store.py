"""The tiered KV store's core: memory -> disk -> Redis, no transport (the servicer adapts gRPC to it).

Reads try the tiers fastest first and copy a hit into the faster tiers it
missed (promotion). Writes go to memory and, by default, through to disk and
Redis before the put returns (write-through); with write-behind a background
queue writes the slower tiers. Every entry is validated on the way in
(`put` raises CorruptEntry), and copies read back from disk or Redis are
validated again (a corrupt one is deleted and counts as a miss): a cache may
lose entries, it must never serve wrong ones.

Thread-safe: the servicer calls it from a thread pool, since disk and Redis block.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore_svc import shm
from kvstore_svc.config import KVStoreConfig
from kvstore_svc.tiers.arena import ArenaMemoryTier
from kvstore_svc.tiers.base import EntryKey, Tier, TierStats
from kvstore_svc.tiers.disk import DiskTier
from kvstore_svc.tiers.memory import MemoryTier
from kvstore_svc.tiers.redis_tier import RedisTier
from kvstore_svc.write_behind import WriteBehind
from services.kv_entry import (
    MAX_FINGERPRINT_BYTES,
    CorruptEntry,
    EntryHeader,
    check_payload,
    decode_entry,
    encode_entry,
)

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 64
MAX_KEYS_PER_REQUEST = 16384


def check_keys(fingerprint: bytes, keys: Sequence[bytes]) -> None:
    """Raise ValueError unless the fingerprint and every key are 1..64 bytes and keys are few enough."""
    if not 1 <= len(fingerprint) <= MAX_FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be 1..{MAX_FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    if len(keys) > MAX_KEYS_PER_REQUEST:
        raise ValueError(f"at most {MAX_KEYS_PER_REQUEST} keys per request, got {len(keys)}")
    for i, key in enumerate(keys):
        check_key(key, f"key {i}")


def check_key(key: bytes, what: str = "key") -> None:
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"{what} must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")


@dataclass
class StoreStats:
    """Counters of the store (llmesh.v1.StatsResponse)."""

    tiers: list[TierStats] = field(default_factory=list)
    lookups: int = 0
    lookup_keys: int = 0
    lookup_hits: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    invalid_entries: int = 0
    write_behind_dropped: int = 0
    write_behind_pending_bytes: int = 0
    redis_errors: int = 0
    redis_circuit_open: bool = False
    # The arena (memory tier in shared memory): in-place reads and their leases.
    arena: str = ""
    arena_bytes: int = 0
    inplace_bytes_out: int = 0
    leases: int = 0
    lease_expiries: int = 0
    active_leases: int = 0
    leased_bytes: int = 0


@dataclass(frozen=True)
class InPlaceEntry:
    """An entry whose payload lies at [offset, offset + header.payload_length) of the arena."""

    key: bytes
    header: EntryHeader
    offset: int


@dataclass(frozen=True)
class InPlaceGrant:
    """What GetInPlace answers: leased entries of the leading keys (kvstore.proto GetInPlaceResponse)."""

    arena: str
    arena_bytes: int
    lease_id: int  # 0 with no entries
    lease_timeout_s: float
    entries: list[InPlaceEntry]
    more: bool  # stopped before a present entry it could not lease, not at a miss


def memory_tier(config: KVStoreConfig) -> MemoryTier | ArenaMemoryTier | None:
    """The config's memory tier: in a shared memory arena when the store shares memory (its
    default) and /dev/shm takes it; else in this process's heap."""
    if not config.memory_bytes:
        return None
    if config.shared_memory and config.memory_arena and shm.available():
        try:
            return ArenaMemoryTier(config.memory_bytes, lease_timeout_s=config.lease_timeout_s)
        except OSError as e:  # e.g. a container's 64 MiB /dev/shm: no in-place reads, same store
            log.warning(
                "cannot place the memory tier in shared memory; keeping it in the heap",
                extra={"memory_bytes": config.memory_bytes, "error": str(e)},
            )
    return MemoryTier(config.memory_bytes)


class TieredKVStore:
    def __init__(
        self,
        *,
        memory: MemoryTier | ArenaMemoryTier | None = None,
        disk: DiskTier | None = None,
        redis: RedisTier | None = None,
        write_behind_bytes: int = 0,
        max_entry_bytes: int = 64 << 20,
    ) -> None:
        """Tiers left None are off. write_behind_bytes > 0 turns write-behind on with that queue bound."""
        if memory is None and disk is None and redis is None:
            raise ValueError("a store needs at least one tier")
        self.memory, self.disk, self.redis = memory, disk, redis
        self.tiers: list[Tier] = [t for t in (memory, disk, redis) if t is not None]
        self._slower: list[Tier] = [t for t in (disk, redis) if t is not None]
        self.max_entry_bytes = max_entry_bytes
        self._write_behind = (
            WriteBehind(self._write_slower, write_behind_bytes)
            if write_behind_bytes and self._slower
            else None
        )
        self._lock = threading.Lock()
        self._stats = StoreStats()

    @classmethod
    def from_config(cls, config: KVStoreConfig) -> TieredKVStore:
        """The tiers the config names (the disk tier scans its directory: call it off the event loop)."""
        return cls(
            memory=memory_tier(config),
            disk=DiskTier(config.disk_dir, config.disk_bytes) if config.disk_dir else None,
            redis=RedisTier(
                config.redis_url,
                timeout_s=config.redis_timeout_s,
                retry_after_s=config.redis_retry_after_s,
                ttl_s=config.redis_ttl_s,
            )
            if config.redis_url
            else None,
            write_behind_bytes=config.write_behind_bytes if config.write_behind else 0,
            max_entry_bytes=config.max_entry_bytes,
        )

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + n)

    # -- reads -------------------------------------------------------------------

    def _held_locally(self, key: EntryKey) -> bool:
        if self.memory is not None and self.memory.contains(key):
            return True
        if self._write_behind is not None and self._write_behind.pending(key) is not None:
            return True
        return self.disk is not None and self.disk.contains(key)

    def lookup(self, fingerprint: bytes, keys: Sequence[bytes]) -> int:
        """How many leading keys are present in some tier (indexes only; one Redis round trip at most)."""
        check_keys(fingerprint, keys)
        eks = [EntryKey(fingerprint, k) for k in keys]
        n = 0
        while n < len(eks) and self._held_locally(eks[n]):
            n += 1
        if n < len(eks) and self.redis is not None:
            rest = eks[n:]
            for ek, remote in zip(rest, self.redis.contains_many(rest), strict=True):
                if not (remote or self._held_locally(ek)):
                    break
                n += 1
        self._count(lookups=1, lookup_keys=len(keys), lookup_hits=n)
        return n

    def get(self, fingerprint: bytes, key: bytes) -> tuple[EntryHeader, memoryview] | None:
        """(header, payload) of one entry, or None: absent, or every copy found was corrupt."""
        check_keys(fingerprint, [key])
        ek = EntryKey(fingerprint, key)
        found = self._read(ek)
        if found is not None:
            self._count(bytes_out=found[0].payload_length)
        return found

    def get_run(
        self, fingerprint: bytes, keys: Sequence[bytes], max_bytes: int
    ) -> tuple[list[tuple[bytes, EntryHeader, memoryview]], bool]:
        """Entries of the leading keys, in order, and whether a miss ended the run.

        Stops early (without a miss) once `max_bytes` of payload are gathered, so
        that a caller streaming a long chain holds a bounded amount at a time;
        at least one entry is returned when the first key is present.
        """
        check_keys(fingerprint, keys)
        out: list[tuple[bytes, EntryHeader, memoryview]] = []
        total = 0
        for key in keys:
            if total >= max_bytes:
                return out, False
            found = self._read(EntryKey(fingerprint, key))
            if found is None:
                self._count(bytes_out=total)
                return out, True
            out.append((key, *found))
            total += found[0].payload_length
        self._count(bytes_out=total)
        return out, False

    def _read(self, ek: EntryKey) -> tuple[EntryHeader, memoryview] | None:
        if self.memory is not None:
            # Checked on the way in, and memory does not rot: sizes only, no payload hash.
            found = self.memory.get_entry(ek)
            if found is not None:
                return found
        return self._read_slower(ek)

    def _read_slower(self, ek: EntryKey) -> tuple[EntryHeader, memoryview] | None:
        if self._write_behind is not None:
            blob = self._write_behind.pending(ek)
            if blob is not None:
                return decode_entry(blob, verify_checksum=False)
        for i, tier in enumerate(self._slower):
            blob = tier.get(ek)
            if blob is None:
                continue
            try:
                header, payload = decode_entry(blob)
                if header.fingerprint != ek.fingerprint:
                    raise CorruptEntry("stored under another fingerprint")
            except CorruptEntry as e:
                log.warning(
                    "corrupt stored entry", extra={"tier": tier.name, "key": ek.hex(), "reason": str(e)}
                )
                tier.note_corrupt(ek)
                continue  # a slower tier may still hold a good copy
            self._promote(ek, blob, self._slower[:i])
            return header, payload
        return None

    def _promote(self, ek: EntryKey, blob: bytes, faster: Sequence[Tier]) -> None:
        if self.memory is not None:
            self.memory.put(ek, blob)
        for tier in faster:  # Redis -> disk
            tier.put(ek, blob)

    # -- writes ------------------------------------------------------------------

    def put(self, fingerprint: bytes, key: bytes, blob: bytes, *, verify_checksum: bool = True) -> bool:
        """Validate and store one entry blob; False when no tier could keep it.

        Raises CorruptEntry (the entry is not stored) for a blob that fails
        decode_entry, names another fingerprint or exceeds max_entry_bytes;
        ValueError for a malformed fingerprint or key.
        """
        check_keys(fingerprint, [key])
        try:
            # verify_checksum=False only for a blob this process just encoded (an in-process store).
            header, _ = decode_entry(blob, verify_checksum=verify_checksum)
            if header.fingerprint != fingerprint:
                raise CorruptEntry(
                    f"header fingerprint {header.fingerprint.hex()[:16]}... differs from the request's"
                )
            if header.payload_length > self.max_entry_bytes:
                raise CorruptEntry(
                    f"payload of {header.payload_length} bytes exceeds --max-entry-bytes "
                    f"{self.max_entry_bytes}"
                )
        except CorruptEntry:
            self._count(invalid_entries=1)
            raise
        self._count(bytes_in=header.payload_length)
        ek = EntryKey(fingerprint, key)
        if self.memory is not None and self.memory.contains(ek):
            # Written through when it first came; re-sending it to Redis would only cost bandwidth.
            self.memory.put(ek, blob)  # refreshes its recency
            return True
        stored = self.memory is not None and self.memory.put(ek, blob)
        if self._write_behind is not None:
            stored = self._write_behind.offer(ek, blob) or stored
        else:
            for tier in self._slower:
                stored = tier.put(ek, blob) or stored
        return stored

    def put_payload(self, fingerprint: bytes, key: bytes, header: EntryHeader, payload: memoryview) -> bool:
        """Store an entry whose payload lies in a buffer another process may still write (a
        client's shared memory segment): copied once, into the arena slot itself when the memory
        tier is an arena, and checked on that copy (a client rewriting its segment meanwhile spoils
        only its own put). Raises and returns as `put`; `header` is already validated."""
        check_keys(fingerprint, [key])
        try:
            if header.fingerprint != fingerprint:
                raise CorruptEntry("header fingerprint differs from the request's")
            if header.payload_length > self.max_entry_bytes:
                raise CorruptEntry(
                    f"payload of {header.payload_length} bytes exceeds --max-entry-bytes "
                    f"{self.max_entry_bytes}"
                )
            if len(payload) != header.payload_length:
                raise CorruptEntry(f"payload is {len(payload)} bytes, header says {header.payload_length}")
        except CorruptEntry:
            self._count(invalid_entries=1)
            raise
        ek = EntryKey(fingerprint, key)
        arena = self.memory if isinstance(self.memory, ArenaMemoryTier) else None
        slot = None
        if arena is not None and not arena.contains(ek):
            slot = arena.reserve(ek, header)
        if slot is None:  # no arena, already held, or no room in it: a private blob as Put makes
            return self.put(fingerprint, key, encode_entry(header, payload, verify=False))
        assert arena is not None
        blob = None
        try:
            copy = arena.view(slot)
            copy[:] = payload  # the one copy
            check_payload(header, copy)
            if self._slower:  # while the slot is still ours alone
                blob = encode_entry(header, copy, verify=False)
        except BaseException as e:
            arena.abort(slot)
            if isinstance(e, CorruptEntry):
                self._count(invalid_entries=1)
            raise
        arena.commit(slot)
        self._count(bytes_in=header.payload_length)
        if blob is not None:
            if self._write_behind is not None:
                self._write_behind.offer(ek, blob)
            else:
                self._write_slower(ek, blob)
        return True

    def _write_slower(self, ek: EntryKey, blob: bytes) -> None:
        for tier in self._slower:
            tier.put(ek, blob)

    def delete(self, fingerprint: bytes, keys: Sequence[bytes]) -> int:
        """Remove entries from every tier; how many were found in some tier."""
        check_keys(fingerprint, keys)
        removed = 0
        for key in keys:
            ek = EntryKey(fingerprint, key)
            found = self._write_behind is not None and self._write_behind.pending(ek) is not None
            if self._write_behind is not None:
                self._write_behind.discard(ek)
            for tier in self.tiers:
                found = tier.delete(ek) or found
            removed += found
        return removed

    # -- in-place reads (the memory tier is an arena) ------------------------------

    @property
    def arena(self) -> ArenaMemoryTier | None:
        return self.memory if isinstance(self.memory, ArenaMemoryTier) else None

    def lease_in_place(self, fingerprint: bytes, keys: Sequence[bytes]) -> InPlaceGrant:
        """Lease the arena slots of the leading present keys (an entry only in a slower tier is
        promoted into the arena first). ValueError for bad keys; RuntimeError without an arena."""
        check_keys(fingerprint, keys)
        arena = self.arena
        if arena is None:
            raise RuntimeError("this store keeps no arena")
        if not keys:  # a client mapping the arena ahead of its first read: no lease
            return InPlaceGrant(arena.arena.name, arena.capacity_bytes, 0, arena.lease_timeout_s, [], False)
        lease_id = arena.open_lease()
        entries: list[InPlaceEntry] = []
        more = lease_id is None  # MAX_LEASES outstanding: the client reads another way
        for key in [] if lease_id is None else keys:
            ek = EntryKey(fingerprint, key)
            got = arena.pin(lease_id, ek)  # type: ignore[arg-type]
            if got is None and self._read_slower(ek) is not None:  # promoted into the arena
                got = arena.pin(lease_id, ek)  # type: ignore[arg-type]
                if got is None:
                    got = False  # held elsewhere but no room in the arena
            if got is None:
                break  # a miss ends the chain
            if got is False:
                more = True
                break
            entries.append(InPlaceEntry(key, got.header, got.offset))
        if lease_id is not None and not entries:
            arena.release(lease_id)
            lease_id = None
        out_bytes = sum(e.header.payload_length for e in entries)
        self._count(bytes_out=out_bytes, inplace_bytes_out=out_bytes)
        return InPlaceGrant(
            arena.arena.name, arena.capacity_bytes, lease_id or 0, arena.lease_timeout_s, entries, more
        )

    def release_in_place(self, lease_id: int) -> bool:
        """End a lease of lease_in_place; False when unknown or expired (or no arena)."""
        arena = self.arena
        return arena is not None and arena.release(lease_id)

    # -- the rest ----------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for write-behind to drain (True at once with write-through)."""
        return self._write_behind.flush(timeout) if self._write_behind is not None else True

    def stats(self) -> StoreStats:
        with self._lock:
            out = StoreStats(**{k: v for k, v in vars(self._stats).items() if k != "tiers"})
        out.tiers = [t.stats() for t in self.tiers]
        if self._write_behind is not None:
            out.write_behind_dropped = self._write_behind.dropped
            out.write_behind_pending_bytes = self._write_behind.pending_bytes
        if (arena := self.arena) is not None:
            out.arena, out.arena_bytes = arena.arena.name, arena.capacity_bytes
            out.leases, out.lease_expiries = arena.lease_count, arena.lease_expiries
            out.active_leases, out.leased_bytes = arena.active_leases, arena.leased_bytes
        if self.redis is not None:
            out.redis_errors = out.tiers[-1].errors
            out.redis_circuit_open = self.redis.breaker.is_open
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Finish write-behind (up to `timeout`), then release the tiers."""
        if self._write_behind is not None:
            self._write_behind.close(timeout)
        for tier in self.tiers:
            tier.close()
