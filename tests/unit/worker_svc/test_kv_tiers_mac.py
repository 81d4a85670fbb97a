"""Store entries the worker did not sign are misses: altered, forged, swapped, unsigned, or signed
under another mesh's secret. Each is counted, and none of its bytes reaches the cache."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from llmesh.kv_store import open_kv_store
from services.kv_entry import checksum
from services.kv_mac import KVMac
from services.step import KVTransfers, StoreLoad, StorePut
from worker_svc.kv_cache import KVCacheSpec, allocate_kv_cache
from worker_svc.kv_tiers import WorkerKVTiers

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
MESH = KVMac("the mesh secret of this test")
A, B = b"a" * 32, b"b" * 32


def tiers_with(store, mac: KVMac = MESH) -> WorkerKVTiers:
    caches = allocate_kv_cache(SPEC, 16, "cpu")
    for c in caches:
        c.normal_()
    return WorkerKVTiers(caches, SPEC, b"f" * 32, 0, store, chunk_blocks=2, mac=mac)


@pytest.fixture
def signed():
    """A store holding chunks A and B as a worker of the mesh put them."""
    store = open_kv_store("memory:1000000")
    writer = tiers_with(store)
    writer.apply(KVTransfers(store_puts=[StorePut(A, [1, 2]), StorePut(B, [3, 4])]), lambda s, b: 0)
    writer.flush()
    fp = writer.store_fingerprint
    (_, header_a, payload_a), (_, header_b, payload_b) = store.get(fp, [A, B])
    return store, fp, (header_a, bytes(payload_a)), (header_b, bytes(payload_b))


def _load(store, key: bytes, mac: KVMac = MESH) -> tuple[WorkerKVTiers, dict, torch.Tensor]:
    reader = tiers_with(store, mac)
    before = torch.stack([c[:, 8:10] for c in reader.kv_caches]).clone()
    failed = reader.apply(KVTransfers(store_loads=[StoreLoad("s", [key], [8, 9])]), lambda s, b: b - 8)
    return reader, failed, before


def _cache_unchanged(reader: WorkerKVTiers, before: torch.Tensor) -> bool:
    return torch.equal(torch.stack([c[:, 8:10] for c in reader.kv_caches]), before)


def test_a_signed_chunk_loads(signed) -> None:
    store, _, _, _ = signed
    reader, failed, _ = _load(store, A)
    assert failed == {} and reader.counters.store_loaded_blocks == 2
    assert reader.counters.store_verify_failures == 0


def _tampered(case: str, a, b):
    """(key to load, header, payload) of one attack on entry A."""
    (header_a, payload_a), (header_b, payload_b) = a, b
    if case == "altered":  # another payload with a valid checksum, A's MAC kept
        noise = np.random.default_rng(1).standard_normal(len(payload_a) // 4, dtype=np.float32).tobytes()
        return b"x" * 32, dataclasses.replace(header_a, checksum=checksum(noise)), noise
    if case == "one bit":
        flipped = bytearray(payload_a)
        flipped[-1] ^= 1
        return b"x" * 32, dataclasses.replace(header_a, checksum=checksum(flipped)), bytes(flipped)
    if case == "swapped":  # B's valid entry stored under another key
        return b"x" * 32, header_b, payload_b
    if case == "unsigned":
        return b"x" * 32, dataclasses.replace(header_a, mac=b""), payload_a
    if case == "forged tag":
        return b"x" * 32, dataclasses.replace(header_a, mac=bytes(32)), payload_a
    if case == "header changed":  # same bytes, other token count: the header is covered too
        return b"x" * 32, dataclasses.replace(header_a, num_tokens=header_a.num_tokens + 1), payload_a
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case", ["altered", "one bit", "swapped", "unsigned", "forged tag", "header changed"]
)
def test_a_tampered_entry_is_a_counted_miss_and_never_reaches_the_cache(signed, case) -> None:
    store, fp, a, b = signed
    key, header, payload = _tampered(case, a, b)
    assert store.put(fp, [(key, header, payload)]) == 1  # the store takes it: it cannot tell
    reader, failed, before = _load(store, key)
    assert failed == {"s": 0}  # computed instead, from its first block
    assert reader.counters.store_verify_failures == 1
    assert reader.counters.store_loaded_blocks == 0
    assert _cache_unchanged(reader, before)


def test_another_meshs_secret_cannot_write_entries_this_mesh_accepts(signed) -> None:
    store, _, _, _ = signed
    stranger = tiers_with(store, KVMac("a secret of another mesh"))
    stranger.apply(KVTransfers(store_puts=[StorePut(b"y" * 32, [5, 6])]), lambda s, b: 0)
    stranger.flush()
    reader, failed, before = _load(store, b"y" * 32)
    assert failed == {"s": 0} and reader.counters.store_verify_failures == 1
    assert _cache_unchanged(reader, before)
    # ...nor read this mesh's: its own check refuses them just the same.
    outsider, failed, _ = _load(store, A, KVMac("a secret of another mesh"))
    assert failed == {"s": 0} and outsider.counters.store_verify_failures == 1
