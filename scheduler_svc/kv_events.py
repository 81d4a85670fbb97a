"""KV events: the block keys this scheduler's pool starts and stops holding, for the routers.

The scheduler decides every allocation and eviction of its workers' GPU caches (block_manager.py),
so what it publishes here is exact, not sampled. Keys are counted over the pool: a key is
"stored" when its first copy appears on any worker and "removed" when its last copy goes (evicted,
forgotten, or its worker left), which is all a router needs to pick a shard (within the shard, the
scheduler's own router picks the worker).

Changes made within `flush_interval_s` (10 ms: a few planner steps) are netted and sent as one
batch; each subscriber (a router's Subscribe stream) gets them through a bounded queue. A
subscriber that falls behind loses batches and sees a gap in the sequence numbers, upon which it
subscribes again and starts from a snapshot: memory here stays bounded whatever a router does.

Transport-free: the servicer (kv_events_servicer.py) turns batches into protobuf.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from services.prefix_hash import short_key
from services.shard_load import ShardLoad

# Batches a subscriber may have queued before it counts as behind (and loses them).
MAX_QUEUED_BATCHES = 1024
# How often the load is recomputed at most (it walks every request of the pool).
LOAD_REFRESH_S = 0.01
# How long changes gather before they go out as one batch. A batch per loop turn was a batch per
# planner step (~200-500 a second per shard at 256 streams), each built here, relayed by an API
# process and parsed by every router; 10 ms is a few steps' keys in one message (a key stored and
# evicted within it is never sent), and as stale as the load reports a router books against.
FLUSH_INTERVAL_S = 0.01


@dataclass
class Batch:
    stored: list[int]
    removed: list[int]


CLOSED = Batch([], [])  # the last item of a subscriber's queue when the scheduler drains


@dataclass(eq=False)
class Subscription:
    """One subscriber's queue of batches; `lost` once one was dropped (the next one skips a number)."""

    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(MAX_QUEUED_BATCHES))
    lost: bool = False
    sequence: int = 0


class WorkerKeys:
    """The block manager's listener for one worker: its keys, counted into the pool's."""

    def __init__(self, log: KVEventLog) -> None:
        self._log = log
        self.keys: set[int] = set()
        self.gone = False

    def stored(self, key: bytes) -> None:
        k = short_key(key)
        if not self.gone and k not in self.keys:
            self.keys.add(k)
            self._log._inc(k)

    def removed(self, key: bytes) -> None:
        k = short_key(key)
        if not self.gone and k in self.keys:
            self.keys.discard(k)
            self._log._dec(k)


class KVEventLog:
    def __init__(
        self,
        shard_id: str = "",
        load: Callable[[], ShardLoad] | None = None,
        flush_interval_s: float = FLUSH_INTERVAL_S,
    ) -> None:
        self.shard_id = shard_id
        self.flush_interval_s = flush_interval_s  # 0: at the end of the loop's turn
        self.epoch = uuid.uuid4().hex  # this process: a restarted shard is told apart by it
        self.holders: dict[int, int] = {}  # key -> workers of the pool holding it
        self.block_size = 0
        self.fingerprint = b""
        self._workers: dict[str, WorkerKeys] = {}
        self._changes: dict[int, bool] = {}  # net change since the last batch: True stored, False removed
        self._flush_scheduled = False
        self.subscriptions: set[Subscription] = set()
        self._load_fn = load
        self._load = ShardLoad()
        self._load_at = 0.0
        self.num_events = 0  # keys stored + removed, published (netted within a batch)
        self.num_batches = 0
        self.num_lost = 0  # batches a slow subscriber lost

    # ----- the pool's workers -----
    def worker(self, worker_id: str, block_size: int, fingerprint: bytes) -> WorkerKeys:
        """The listener of a joining worker's block manager."""
        self.worker_gone(worker_id)
        self.block_size, self.fingerprint = block_size, fingerprint
        keys = self._workers[worker_id] = WorkerKeys(self)
        return keys

    def worker_gone(self, worker_id: str) -> None:
        """A worker left (or restarted empty): its copies of every key are gone."""
        keys = self._workers.pop(worker_id, None)
        if keys is None:
            return
        keys.gone = True
        for k in keys.keys:
            self._dec(k)
        keys.keys.clear()

    def _inc(self, k: int) -> None:
        n = self.holders.get(k, 0)
        self.holders[k] = n + 1
        if n == 0:
            self._change(k, True)

    def _dec(self, k: int) -> None:
        n = self.holders.get(k, 0)
        if n <= 1:
            self.holders.pop(k, None)
            if n == 1:
                self._change(k, False)
        else:
            self.holders[k] = n - 1

    def _change(self, k: int, stored: bool) -> None:
        if not self.subscriptions:  # nobody listens: a subscriber starts from a snapshot anyway
            return
        if self._changes.get(k) is (not stored):  # undone within the batch: no net change
            del self._changes[k]
        else:
            self._changes[k] = stored
        if not self._flush_scheduled:
            try:
                loop = asyncio.get_running_loop()
                if self.flush_interval_s > 0:
                    loop.call_later(self.flush_interval_s, self.flush)
                else:
                    loop.call_soon(self.flush)
                self._flush_scheduled = True
            except RuntimeError:  # no loop (a test driving the planner synchronously)
                pass

    # ----- publishing -----
    def flush(self) -> None:
        """Hand the changes so far to every subscriber as one batch."""
        self._flush_scheduled = False
        if not self._changes:
            return
        changes, self._changes = self._changes, {}
        if not self.subscriptions:
            return
        batch = Batch([k for k, s in changes.items() if s], [k for k, s in changes.items() if not s])
        self.num_events += len(changes)
        self.num_batches += 1
        for sub in self.subscriptions:
            if sub.queue.full():
                sub.lost = True
                self.num_lost += 1
            else:
                sub.queue.put_nowait(batch)

    def subscribe(self) -> tuple[Subscription, list[int]]:
        """A new subscriber and the snapshot it starts from (every key held now)."""
        self.flush()  # pending changes belong before the snapshot, for the subscribers before it
        sub = Subscription()
        self.subscriptions.add(sub)
        return sub, list(self.holders)

    def close(self) -> None:
        """End every subscriber's stream (the scheduler drains): each gets CLOSED after its batches."""
        for sub in self.subscriptions:
            if not sub.queue.full():
                sub.queue.put_nowait(CLOSED)
            else:
                sub.lost = True

    def unsubscribe(self, sub: Subscription) -> None:
        self.subscriptions.discard(sub)

    def load(self) -> ShardLoad:
        now = time.monotonic()
        if self._load_fn is not None and now - self._load_at >= LOAD_REFRESH_S:
            self._load = self._load_fn()
            self._load_at = now
        return self._load
