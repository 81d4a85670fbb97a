"""The router's global prefix index: block key -> the shards whose pools hold that block.

Fed by the shards' KV events (router.proto KVEvents): each shard's scheduler mirrors its
workers' caches exactly, so the index knows, per shard, which leading blocks of a prompt are
already cached there. A key is the first 8 bytes of the 32-byte content key
(services/prefix_hash.short_key); the shards are bits of one int per key (a small int object is
shared for up to 8 shards), so an entry costs a dict slot and an int.

`ShardFeed` keeps one shard's event stream in order: batches carry consecutive sequence numbers
within an epoch (a shard process); a duplicate is ignored, a batch ahead of the next expected one
waits in a small reorder buffer (transports that reorder), and a gap that does not fill (or any
gap on an ordered transport, `max_reorder=0`) or a new epoch asks for a resync: the router
subscribes again and the shard's next snapshot replaces what the index held of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


class PrefixIndex:
    def __init__(self) -> None:
        self.keys: dict[int, int] = {}  # key -> bit mask of shard slots holding it
        self._bits: dict[str, int] = {}  # shard id -> its bit
        self._free: list[int] = []
        self._next_bit = 0
        self.num_events = 0  # keys stored + removed, applied

    # ----- shards -----
    def bit(self, shard_id: str) -> int:
        """The shard's bit (a new one for a new shard; freed bits are reused)."""
        bit = self._bits.get(shard_id)
        if bit is None:
            if self._free:
                bit = self._free.pop()
            else:
                bit = 1 << self._next_bit
                self._next_bit += 1
            self._bits[shard_id] = bit
        return bit

    def drop_shard(self, shard_id: str) -> None:
        """Forget everything a shard held, and free its bit."""
        bit = self._bits.pop(shard_id, None)
        if bit is not None:
            self._clear(bit)
            self._free.append(bit)

    def _clear(self, bit: int) -> None:
        keys = self.keys
        for k in [k for k, m in keys.items() if m & bit]:  # one pass; resyncs and leaves are rare
            m = keys[k] & ~bit
            if m:
                keys[k] = m
            else:
                del keys[k]

    # ----- events -----
    def reset(self, shard_id: str, keys: Iterable[int]) -> None:
        """A snapshot: the shard holds exactly `keys` now."""
        bit = self.bit(shard_id)
        self._clear(bit)
        self.apply(shard_id, keys, ())

    def apply(self, shard_id: str, stored: Iterable[int], removed: Iterable[int]) -> None:
        bit = self.bit(shard_id)
        index = self.keys
        n = 0
        for k in removed:
            m = index.get(k, 0) & ~bit
            if m:
                index[k] = m
            else:
                index.pop(k, None)
            n += 1
        for k in stored:
            index[k] = index.get(k, 0) | bit
            n += 1
        self.num_events += n

    # ----- queries -----
    def overlap(self, keys: list[int], candidates: int) -> dict[int, int]:
        """For each shard bit of `candidates`: how many leading `keys` it holds (only non-zero ones)."""
        index = self.keys
        active = candidates
        found: dict[int, int] = {}
        for i, k in enumerate(keys):
            held = active & index.get(k, 0)
            dropped = active & ~held
            while dropped and i:
                low = dropped & -dropped
                found[low] = i
                dropped ^= low
            active = held
            if not active:
                return found
        while active:
            low = active & -active
            found[low] = len(keys)
            active ^= low
        return found

    def shard_bit(self, shard_id: str) -> int | None:
        return self._bits.get(shard_id)


@dataclass
class Batch:
    """One batch of a shard's events (router.proto KVEventBatch, as plain values)."""

    epoch: str
    sequence: int
    snapshot: bool = False
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


class ShardFeed:
    """One shard's events applied to the index in sequence order; `receive` says when to resync."""

    def __init__(self, index: PrefixIndex, shard_id: str, max_reorder: int = 0) -> None:
        self.index = index
        self.shard_id = shard_id
        self.max_reorder = max_reorder
        self.epoch = ""
        self.expected = 0  # the next sequence number to apply; 0: no snapshot yet
        self.pending: dict[int, Batch] = {}
        self.num_resyncs = 0

    @property
    def synced(self) -> bool:
        return self.expected > 0

    def receive(self, batch: Batch) -> bool:
        """Apply (or hold) a batch; False when the feed is out of sync and needs a fresh snapshot."""
        if batch.snapshot:
            self.index.reset(self.shard_id, batch.stored)
            self.epoch, self.expected = batch.epoch, batch.sequence + 1
            self.pending = {
                s: b for s, b in self.pending.items() if s > batch.sequence and b.epoch == batch.epoch
            }
            self._drain()
            return True
        if not self.synced or batch.epoch != self.epoch:
            return self._lost()
        if batch.sequence < self.expected:
            return True  # a duplicate: applied already
        if batch.sequence > self.expected:
            if len(self.pending) >= self.max_reorder:
                return self._lost()
            self.pending[batch.sequence] = batch
            return True
        self.index.apply(self.shard_id, batch.stored, batch.removed)
        self.expected += 1
        self._drain()
        return True

    def _drain(self) -> None:
        while self.expected in self.pending:
            b = self.pending.pop(self.expected)
            self.index.apply(self.shard_id, b.stored, b.removed)
            self.expected += 1

    def _lost(self) -> bool:
        """Out of sync: stop applying until the next snapshot (what the index holds stays as a hint)."""
        self.expected = 0
        self.pending.clear()
        self.num_resyncs += 1
        return False
