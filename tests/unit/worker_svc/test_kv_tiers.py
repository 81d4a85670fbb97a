"""The worker's KV tiers on the CPU: loads from the store, partial chunks, the store client's preparation."""

from __future__ import annotations

import threading

import torch

from llmesh.kv_store import open_kv_store
from services.step import KVTransfers, StoreLoad, StorePut
from worker_svc.kv_cache import KVCacheSpec, allocate_kv_cache
from worker_svc.kv_tiers import WorkerKVTiers

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)


def tiers_with(store) -> WorkerKVTiers:
    caches = allocate_kv_cache(SPEC, 16, "cpu")
    for c in caches:
        c.normal_()
    return WorkerKVTiers(caches, SPEC, b"f" * 32, 0, store, chunk_blocks=2)


def test_a_store_load_fills_only_the_blocks_asked_for_and_stops_at_a_miss() -> None:
    tiers = tiers_with(open_kv_store("memory:1000000"))
    want = [torch.stack([c[:, b] for c in tiers.kv_caches]).clone() for b in (1, 2, 3, 4)]
    puts = [StorePut(b"a" * 32, [1, 2]), StorePut(b"b" * 32, [3, 4])]
    tiers.apply(KVTransfers(store_puts=puts), lambda s, b: 0)
    tiers.flush()
    # The second block is already in the GPU cache (-1: skipped); chunk "c" was never put (a miss).
    load = StoreLoad("s", [b"a" * 32, b"b" * 32, b"c" * 32], [8, -1, 10, 11, 12, 13])
    failed = tiers.apply(KVTransfers(store_loads=[load]), lambda seq, block: {12: 4}[block])
    assert failed == {"s": 4}  # computed from the missing chunk's first block on
    for target, w in zip([8, 10, 11], [want[0], want[2], want[3]], strict=True):
        assert torch.equal(torch.stack([c[:, target] for c in tiers.kv_caches]), w)
    assert tiers.counters.store_loaded_blocks == 3


def test_wait_prepared_waits_for_the_store_clients_preparation() -> None:
    release = threading.Event()

    class SlowToPrepare:
        def prepare(self, fingerprint: bytes) -> None:
            release.wait(5)

        def put(self, fingerprint, entries):
            return len(entries)

        def get(self, fingerprint, keys):
            return []

    tiers = tiers_with(SlowToPrepare())
    assert tiers.wait_prepared(timeout_s=0.05) is False
    release.set()
    assert tiers.wait_prepared() is True
    assert tiers_with(None).wait_prepared() is True  # nothing to prepare


def test_close_waits_for_the_sender_before_the_store_client_goes() -> None:
    """The caller closes the store client (unmapping the memory puts read) right after close():
    a sender still putting then crashed the process (SIGSEGV in benchmarks/kv_store.py)."""
    started, release = threading.Event(), threading.Event()
    sent = []

    class SlowStore:
        def put(self, fingerprint, entries):
            started.set()
            release.wait(5)
            sent.extend(entries)
            return len(entries)

        def get(self, fingerprint, keys):
            return []

    tiers = tiers_with(SlowStore())
    tiers.apply(KVTransfers(store_puts=[StorePut(b"a" * 32, [1, 2])]), lambda s, b: 0)
    assert started.wait(5)
    threading.Timer(0.2, release.set).start()
    tiers.close()
    assert len(sent) == 1 and not tiers._sender.is_alive()
