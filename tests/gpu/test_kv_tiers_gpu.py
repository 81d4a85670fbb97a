"""The worker's KV tier copies on CUDA (copy stream, pinned slots) against plain indexing."""

from __future__ import annotations

import pytest
import torch

from llmesh.kv_store import open_kv_store
from services.step import KVTransfers, StoreLoad, StorePut
from worker_svc.kv_cache import KVCacheSpec, allocate_kv_cache
from worker_svc.kv_tiers import WorkerKVTiers

pytestmark = pytest.mark.gpu


def make_tiers(store=None, chunk_blocks: int = 0) -> WorkerKVTiers:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    caches = allocate_kv_cache(spec, 64, "cuda")
    for c in caches:
        c.normal_()
    return WorkerKVTiers(
        caches, spec, b"f" * 32, num_host_blocks=32, store=store, chunk_blocks=chunk_blocks, put_bytes=1 << 20
    )


def blocks_of(tiers: WorkerKVTiers, ids: list[int]) -> torch.Tensor:
    """[n, layers, 2, ...] by plain indexing: the twin of the tier's gather."""
    return torch.stack([torch.stack([c[0, b], c[1, b]]) for b in ids for c in tiers.kv_caches]).view(
        len(ids), len(tiers.kv_caches), 2, *tiers.kv_caches[0].shape[2:]
    )


def test_save_then_overwrite_then_load_round_trips_exactly() -> None:
    tiers = make_tiers()
    saved_ids, slots = [3, 4, 5, 9, 20], [7, 8, 9, 2, 30]  # runs and single slots
    want = blocks_of(tiers, saved_ids).clone()
    tiers.apply(KVTransfers(save_block_ids=saved_ids, save_host_slots=slots), lambda s, b: 0)
    for c in tiers.kv_caches:  # the next forward overwrites the blocks at once
        c[:, saved_ids] = 0
    targets = [40, 41, 42, 50, 51]
    tiers.apply(KVTransfers(load_host_slots=slots, load_block_ids=targets), lambda s, b: 0)
    # The load ran on its own stream, layer by layer: one event per layer for the forward.
    events = tiers.take_layer_events()
    assert events is not None and len(events) == len(tiers.kv_caches)
    tiers.wait_for_loads(events)  # the current stream now follows every layer of it
    assert torch.equal(blocks_of(tiers, targets), want)
    assert tiers.take_layer_events() is None


def test_store_put_then_load_round_trips_exactly() -> None:
    store = open_kv_store("memory:100000000")
    tiers = make_tiers(store, chunk_blocks=4)
    ids = [1, 2, 3, 4, 10, 11, 12, 13]
    want = blocks_of(tiers, ids).clone()
    kv = KVTransfers(store_puts=[StorePut(b"a" * 32, ids[:4]), StorePut(b"b" * 32, ids[4:])])
    tiers.apply(kv, lambda s, b: 0)
    for c in tiers.kv_caches:
        c[:, ids] = 0
    tiers.flush()
    # Both chunks went through slots of the pinned pool, given back once sent.
    assert tiers.staging.pool is not None and tiers.staging.pool.is_pinned()
    assert tiers.staging.pending_bytes == 0 and len(tiers.staging._free) == tiers.staging.num_slots
    targets = [30, 31, 32, 33, -1, 35, 36, 37]
    load = StoreLoad("s", [b"a" * 32, b"b" * 32], targets)
    failed = tiers.apply(KVTransfers(store_loads=[load]), lambda s, b: 0)
    assert failed == {}
    got = blocks_of(tiers, [t for t in targets if t >= 0])
    assert torch.equal(got, torch.cat([want[:4], want[5:]]))
    # A chain whose last chunk is missing: the loaded ones land, the rest is left to compute.
    missing = StoreLoad("m", [b"a" * 32, b"z" * 32], [40, 41, 42, 43, 44, 45, 46, 47])
    failed = tiers.apply(KVTransfers(store_loads=[missing]), lambda s, b: {44: 4}[b])
    assert failed == {"m": 4}
    assert torch.equal(blocks_of(tiers, [40, 41, 42, 43]), want[:4])


def put_then_load(tiers, first: bytes, second: bytes):
    """Put blocks as two chunks keyed `first`/`second`, zero them, load both into other blocks:
    (failed loads, the loaded blocks, the blocks as they were put)."""
    ids = [1, 2, 3, 4, 10, 11, 12, 13]
    want = blocks_of(tiers, ids).clone()
    keys = [first * 32, second * 32]
    puts = [StorePut(keys[0], ids[:4]), StorePut(keys[1], ids[4:])]
    tiers.apply(KVTransfers(store_puts=puts), lambda s, b: 0)
    tiers.flush()
    for c in tiers.kv_caches:
        c[:, ids] = 0
    targets = [30, 31, 32, 33, 34, 35, 36, 37]
    failed = tiers.apply(KVTransfers(store_loads=[StoreLoad("s", keys, targets)]), lambda s, b: 0)
    return failed, blocks_of(tiers, targets), want


def test_store_put_then_load_through_page_locked_shared_memory(tmp_path) -> None:
    """A real store service on loopback: chunks go through the client's segments, which the tiers
    page-lock (cudaHostRegister), and come back exactly."""
    from kvstore_svc.client import KVStoreClient
    from tests.integration.test_kvstore import StoreProcess

    store = StoreProcess(tmp_path, "--memory-bytes", "256MiB", "--no-memory-arena")  # gets: GetShared
    client = KVStoreClient(store.address, timeout_s=30, shared_memory="on", segment_bytes=8 << 20)
    try:
        tiers = make_tiers(client, chunk_blocks=4)
        failed, loaded, want = put_then_load(tiers, b"c", b"d")
        assert failed == {} and client.shared is not None and client.shared.bytes_in > 0
        assert torch.equal(loaded, want)
        tiers.close()
    finally:
        client.close()
        store.stop()


def test_store_load_in_place_from_the_page_locked_arena(tmp_path) -> None:
    """A real store service on loopback with its memory tier in an arena: the tiers page-lock
    the read-only mapping (cudaHostRegister, read-only flag) and chunks come back exactly."""
    from kvstore_svc.client import KVStoreClient
    from tests.integration.test_kvstore import StoreProcess

    store = StoreProcess(tmp_path, "--memory-bytes", "256MiB")
    client = KVStoreClient(store.address, timeout_s=30, shared_memory="on", segment_bytes=8 << 20)
    try:
        tiers = make_tiers(client, chunk_blocks=4)
        failed, loaded, want = put_then_load(tiers, b"e", b"f")
        assert failed == {} and client.in_place is not None and client.in_place.bytes_in > 0
        assert client.in_place._map is not None and client.in_place._map.page_locked
        assert torch.equal(loaded, want)
        tiers.close()
    finally:
        client.close()  # unmaps (and unregisters) the arena
        store.stop()


def test_saves_and_host_loads_never_synchronize_the_host() -> None:
    """A save (gathers behind the last forward) and a host load (a GiB behind which the forward's
    launches queue) must not wait for the device: index uploads are non-blocking."""
    tiers = make_tiers()
    want = blocks_of(tiers, [3, 4, 5]).clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tiers.apply(KVTransfers(save_block_ids=[3, 4, 5], save_host_slots=[0, 1, 5]), lambda s, b: 0)
        tiers.apply(KVTransfers(load_host_slots=[0, 1, 5], load_block_ids=[40, 41, 42]), lambda s, b: 0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(blocks_of(tiers, [40, 41, 42]), want)
    assert tiers.counters.host_load_seconds > 0


def test_the_device_digest_is_its_twin_at_an_8b_chunk() -> None:
    """One 256-token chunk of Llama-3.1-8B (32 MiB of bf16) and a padded odd size, GPU vs float64."""
    from kernels.kv_digest import digest_key, kv_digest, kv_digest_batch, kv_digest_reference

    key, on_gpu = digest_key(b"gpu test secret"), digest_key(b"gpu test secret", "cuda")
    chunk = torch.randn(16, 32, 2, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(kv_digest(chunk, on_gpu).cpu(), kv_digest_reference(chunk, key))
    odd = torch.randint(0, 256, (3 * 65536 + 77,), device="cuda", dtype=torch.uint8)
    assert torch.equal(kv_digest(odd, on_gpu).cpu(), kv_digest_reference(odd, key))
    two = torch.stack([chunk, chunk + 1])
    assert torch.equal(kv_digest_batch(two, on_gpu)[1].cpu(), kv_digest_reference(chunk + 1, key))


def test_a_tampered_chunk_is_never_scattered_on_the_device() -> None:
    """The batched CUDA load: chunk a verifies, chunk b (altered payload, valid checksum) does not."""
    import dataclasses

    from services.kv_entry import checksum

    store = open_kv_store("memory:100000000")
    tiers = make_tiers(store, chunk_blocks=4)
    ids = [1, 2, 3, 4, 10, 11, 12, 13]
    want = blocks_of(tiers, ids[:4]).clone()
    tiers.apply(
        KVTransfers(store_puts=[StorePut(b"a" * 32, ids[:4]), StorePut(b"b" * 32, ids[4:])]), lambda s, b: 0
    )
    tiers.flush()
    fp = tiers.store_fingerprint
    ((_, header, payload),) = store.get(fp, [b"b" * 32])
    altered = bytearray(payload)
    altered[100] ^= 0x40
    store.put(fp, [(b"c" * 32, dataclasses.replace(header, checksum=checksum(altered)), bytes(altered))])
    targets = [40, 41, 42, 43, 50, 51, 52, 53]
    before = blocks_of(tiers, targets[4:]).clone()
    load = StoreLoad("s", [b"a" * 32, b"c" * 32], targets)
    failed = tiers.apply(KVTransfers(store_loads=[load]), lambda s, b: targets.index(b))
    assert failed == {"s": 4}
    assert tiers.counters.store_verify_failures == 1
    assert torch.equal(blocks_of(tiers, targets[:4]), want)
    assert torch.equal(blocks_of(tiers, targets[4:]), before)
