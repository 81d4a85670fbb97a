"""The router's prefix index and each shard's event feed: in order, out of order, lost and resynced;
and the scheduler's side, the pool's KV event log (netting, workers leaving, slow subscribers)."""

from __future__ import annotations

import asyncio

from router_svc.index import Batch, PrefixIndex, ShardFeed
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.kv_events import MAX_QUEUED_BATCHES, KVEventLog
from services.prefix_hash import extend_block_keys, short_key


def test_overlap_counts_each_shard_s_leading_blocks():
    index = PrefixIndex()
    a, b, c = index.bit("a"), index.bit("b"), index.bit("c")
    index.apply("a", [1, 2, 3], [])
    index.apply("b", [1, 2], [])
    index.apply("c", [2, 3], [])  # not the first block: no leading run
    assert index.overlap([1, 2, 3, 4], a | b | c) == {a: 3, b: 2}
    assert index.overlap([1, 2, 3], a) == {a: 3}
    index.apply("a", [], [2])
    assert index.overlap([1, 2, 3], a | b) == {a: 1, b: 2}


def test_a_dropped_shard_frees_its_bit_and_keys():
    index = PrefixIndex()
    index.apply("a", [1, 2], [])
    index.apply("b", [2], [])
    bit = index.bit("a")
    index.drop_shard("a")
    assert index.keys == {2: index.bit("b")}
    assert index.bit("new") == bit  # reused


def feed(max_reorder: int = 0) -> tuple[PrefixIndex, ShardFeed]:
    index = PrefixIndex()
    f = ShardFeed(index, "s", max_reorder)
    assert f.receive(Batch("e1", 1, snapshot=True, stored=[1, 2]))
    return index, f


def test_events_in_order():
    index, f = feed()
    assert f.receive(Batch("e1", 2, stored=[3]))
    assert f.receive(Batch("e1", 3, removed=[1]))
    assert f.receive(Batch("e1", 3, removed=[2]))  # a duplicate: ignored
    assert set(index.keys) == {2, 3}


def test_events_out_of_order_wait_for_the_gap_to_fill():
    index, f = feed(max_reorder=4)
    assert f.receive(Batch("e1", 3, removed=[3]))  # ahead: held
    assert 3 not in index.keys
    assert f.receive(Batch("e1", 2, stored=[3]))  # fills the gap: 2 then 3 applied
    assert set(index.keys) == {1, 2} and f.expected == 4


def test_lost_events_ask_for_a_resync_and_the_snapshot_restores_the_truth():
    index, f = feed(max_reorder=0)
    assert not f.receive(Batch("e1", 3, stored=[9]))  # 2 was lost
    assert not f.synced and f.num_resyncs == 1
    assert not f.receive(Batch("e1", 4, stored=[9]))  # nothing applies until a snapshot
    assert f.receive(Batch("e1", 1, snapshot=True, stored=[2, 9]))
    assert set(index.keys) == {2, 9}
    assert f.receive(Batch("e1", 2, removed=[9]))
    assert set(index.keys) == {2}


def test_a_new_epoch_is_a_restarted_shard():
    index, f = feed()
    assert not f.receive(Batch("e2", 2, stored=[5]))
    assert f.receive(Batch("e2", 1, snapshot=True, stored=[]))
    assert index.keys == {}


def test_the_reorder_buffer_is_bounded():
    _, f = feed(max_reorder=2)
    assert f.receive(Batch("e1", 4))
    assert f.receive(Batch("e1", 5))
    assert not f.receive(Batch("e1", 6))


async def test_the_pool_publishes_a_key_once_while_any_worker_holds_it():
    log = KVEventLog("s", flush_interval_s=0.005)
    sub, snapshot = log.subscribe()
    assert snapshot == []
    w0, w1 = log.worker("w0", 4, b"fp"), log.worker("w1", 4, b"fp")
    w0.stored(b"k" * 32)
    w1.stored(b"k" * 32)
    w0.stored(b"j" * 32)
    w0.removed(b"j" * 32)  # netted within the batch: never published
    await asyncio.sleep(0)
    assert sub.queue.empty()  # changes gather for flush_interval_s, then go out as one batch
    await asyncio.sleep(0.02)
    batch = sub.queue.get_nowait()
    assert batch.stored == [short_key(b"k" * 32)] and batch.removed == []
    w0.removed(b"k" * 32)
    log.flush()
    assert sub.queue.empty()  # w1 still holds it
    log.worker_gone("w1")
    log.flush()
    assert sub.queue.get_nowait().removed == [short_key(b"k" * 32)]
    assert log.holders == {}


def test_a_slow_subscriber_loses_batches_not_memory():
    log = KVEventLog("s")
    sub, _ = log.subscribe()
    w = log.worker("w", 4, b"fp")
    for i in range(MAX_QUEUED_BATCHES + 5):
        w.stored(i.to_bytes(8, "big") * 4)
        log.flush()
    assert sub.lost and sub.queue.qsize() == MAX_QUEUED_BATCHES and log.num_lost == 5


def test_the_block_manager_reports_stored_and_evicted_keys_exactly():
    log = KVEventLog("s")
    sub, _ = log.subscribe()
    blocks = BlockManager(4, 2, b"fp")
    blocks.listener = log.worker("w", 2, b"fp")
    prompt = [1, 2, 3, 4, 5, 6]
    assert blocks.allocate("a", prompt, 0, 6) is not None
    keys = [short_key(k) for k in extend_block_keys([], prompt, 2, b"fp")]
    assert set(log.holders) == set(keys)
    blocks.free_seq("a")  # cached blocks stay held while free
    assert set(log.holders) == set(keys)
    assert blocks.allocate("b", [9, 9, 8, 8, 7, 7, 6, 6], 0, 8) is not None  # evicts all three
    other = [short_key(k) for k in extend_block_keys([], [9, 9, 8, 8, 7, 7, 6, 6], 2, b"fp")]
    assert set(log.holders) == set(other)
    log.flush()
    batch = sub.queue.get_nowait()
    assert set(batch.stored) == set(other) and batch.removed == []  # keys were netted in one batch
