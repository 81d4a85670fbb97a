"""The put staging memory: slots taken and given back, full means dropped, bytes bounded."""

from __future__ import annotations

import torch

from worker_svc.kv_put_staging import PutStaging


def test_cpu_staging_bounds_the_bytes_in_flight_and_keeps_no_pool() -> None:
    staging = PutStaging((4, 2, 8), torch.float32, total_bytes=2 * 4 * 2 * 8 * 4, pinned=False)
    assert staging.num_slots == 0 and staging.chunk_bytes == 256
    assert staging.take((4, 2, 8)) == (-1, None)
    assert staging.take((2, 2, 8)) == (-1, None)  # half a chunk: half the bytes
    assert staging.take((4, 2, 8)) is None  # 1.5 chunks in flight: no room for a whole one
    assert staging.take((2, 2, 8)) == (-1, None)
    staging.give_back(-1, (4, 2, 8))
    staging.give_back(-1, (2, 2, 8))
    staging.give_back(-1, (2, 2, 8))
    assert staging.pending_bytes == 0 and staging.take((4, 2, 8)) == (-1, None)


def test_a_store_put_that_finds_no_room_is_dropped_and_counted() -> None:
    from llmesh.kv_store import open_kv_store
    from services.step import KVTransfers, StorePut
    from worker_svc.kv_cache import KVCacheSpec, allocate_kv_cache
    from worker_svc.kv_tiers import WorkerKVTiers

    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
    chunk_bytes = 2 * spec.bytes_per_block
    store = open_kv_store("memory:1000000")
    tiers = WorkerKVTiers(
        allocate_kv_cache(spec, 16, "cpu"), spec, b"f" * 32, 0, store, chunk_blocks=2, put_bytes=chunk_bytes
    )
    tiers._puts.put(None)  # stop the sender: the first put stays in flight
    tiers._sender.join()
    puts = [StorePut(b"a" * 32, [1, 2]), StorePut(b"b" * 32, [3, 4])]
    tiers.apply(KVTransfers(store_puts=puts), lambda s, b: 0)
    assert tiers.counters.store_put_dropped == 1 and tiers.staging.pending_bytes == chunk_bytes
