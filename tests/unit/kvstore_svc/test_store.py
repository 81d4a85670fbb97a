"""TieredKVStore: validation on ingest, write-through / write-behind, promotion, chains across tiers."""

from __future__ import annotations

import threading

import pytest

from kvstore_svc.store import TieredKVStore
from kvstore_svc.tiers.base import EntryKey
from kvstore_svc.tiers.disk import DiskTier
from kvstore_svc.tiers.memory import MemoryTier
from kvstore_svc.tiers.redis_tier import RedisTier, redis_key
from services.kv_entry import CorruptEntry, encode_entry, make_header
from tests.helpers.kv_entries import FP, LAYOUT, OTHER_FP, blob, entry, key, payload


@pytest.fixture
def three_tiers(tmp_path, redis_server):
    store = TieredKVStore(
        memory=MemoryTier(1 << 20),
        disk=DiskTier(tmp_path / "disk", 1 << 20),
        redis=RedisTier(redis_server.url, timeout_s=0.2, retry_after_s=0.3),
    )
    yield store
    store.close()


def test_write_through_lands_in_every_tier(three_tiers, redis_server):
    k, b = blob(1)
    assert three_tiers.put(FP, k, b)
    ek = EntryKey(FP, k)
    assert three_tiers.memory.get(ek) == b and three_tiers.disk.get(ek) == b
    assert redis_server.client().get(redis_key(ek)) == b
    header, data = three_tiers.get(FP, k)
    assert bytes(data) == entry(1)[2] and header == entry(1)[1]


def test_reads_promote_hits_to_the_faster_tiers(three_tiers):
    k, b = blob(1)
    ek = EntryKey(FP, k)
    three_tiers.redis.put(ek, b)  # only in Redis, as if another store had written it
    assert three_tiers.get(FP, k) is not None
    assert three_tiers.memory.contains(ek) and three_tiers.disk.contains(ek)
    three_tiers.memory.delete(ek)
    assert three_tiers.get(FP, k) is not None  # from disk now
    assert three_tiers.memory.contains(ek)
    hits = {t.name: t.hits for t in three_tiers.stats().tiers}
    assert hits == {"memory": 0, "disk": 1, "redis": 1}


def test_lookup_counts_the_leading_run_across_tiers(three_tiers):
    blobs = [blob(i) for i in range(6)]
    three_tiers.memory.put(EntryKey(FP, blobs[0][0]), blobs[0][1])
    three_tiers.disk.put(EntryKey(FP, blobs[1][0]), blobs[1][1])
    three_tiers.redis.put(EntryKey(FP, blobs[2][0]), blobs[2][1])
    three_tiers.memory.put(EntryKey(FP, blobs[3][0]), blobs[3][1])
    three_tiers.redis.put(EntryKey(FP, blobs[5][0]), blobs[5][1])  # after the gap: not counted
    keys = [k for k, _ in blobs]
    assert three_tiers.lookup(FP, keys) == 4
    assert three_tiers.lookup(FP, keys[1:]) == 3
    assert three_tiers.lookup(OTHER_FP, keys) == 0  # fingerprints never collide
    assert three_tiers.lookup(FP, []) == 0
    s = three_tiers.stats()
    assert (s.lookups, s.lookup_keys, s.lookup_hits) == (4, 17, 7)


def test_fingerprints_never_collide(tmp_path):
    store = TieredKVStore(memory=MemoryTier(1 << 20))
    shared_key = key(1)
    _, h1, p1 = entry(1)
    p2 = payload(4096, seed=99)
    h2 = make_header(OTHER_FP, "float32", (1, 2, 512), LAYOUT, 16, p2)
    store.put(FP, shared_key, encode_entry(h1, p1))
    store.put(OTHER_FP, shared_key, encode_entry(h2, p2))
    assert bytes(store.get(FP, shared_key)[1]) == p1 and bytes(store.get(OTHER_FP, shared_key)[1]) == p2


@pytest.mark.parametrize("problem", ["checksum", "fingerprint", "oversized", "garbage"])
def test_invalid_entries_are_refused_and_leave_the_store_unchanged(problem):
    store = TieredKVStore(memory=MemoryTier(1 << 20), max_entry_bytes=8192)
    k, header, data = entry(1)
    if problem == "checksum":
        b = bytearray(encode_entry(header, data))
        b[-1] ^= 1
        b = bytes(b)
    elif problem == "fingerprint":
        b = encode_entry(make_header(OTHER_FP, "float32", header.shape, LAYOUT, 16, data), data)
    elif problem == "oversized":
        k, b = blob(1, nbytes=16384)
    else:
        b = b"LMKV" + bytes(100)
    with pytest.raises(CorruptEntry):
        store.put(FP, k, b)
    assert store.lookup(FP, [k]) == 0
    assert store.stats().invalid_entries == 1 and store.stats().bytes_in == 0


def test_malformed_keys_are_value_errors():
    store = TieredKVStore(memory=MemoryTier(1000))
    with pytest.raises(ValueError, match="fingerprint"):
        store.lookup(b"", [b"k"])
    with pytest.raises(ValueError, match="key 1"):
        store.lookup(FP, [b"k", b""])


def test_a_corrupt_copy_in_redis_is_a_miss_and_is_deleted(three_tiers, redis_server):
    k, b = blob(1)
    ek = EntryKey(FP, k)
    three_tiers.redis.put(ek, b[:-1] + bytes([b[-1] ^ 1]))
    assert three_tiers.get(FP, k) is None
    assert redis_server.client().exists(redis_key(ek)) == 0
    assert not three_tiers.memory.contains(ek)  # nothing corrupt was promoted
    assert three_tiers.stats().tiers[2].corrupt == 1


def test_an_entry_too_big_for_memory_still_reaches_disk(tmp_path):
    store = TieredKVStore(memory=MemoryTier(1000), disk=DiskTier(tmp_path, 1 << 20))
    k, b = blob(1)
    assert store.put(FP, k, b)
    assert not store.memory.contains(EntryKey(FP, k)) and store.get(FP, k) is not None


def test_no_tier_able_to_keep_an_entry_says_so():
    store = TieredKVStore(memory=MemoryTier(1000))
    k, b = blob(1)
    assert not store.put(FP, k, b)


def test_delete_removes_from_every_tier(three_tiers):
    k, b = blob(1)
    three_tiers.put(FP, k, b)
    assert three_tiers.delete(FP, [k, key(2)]) == 1
    assert three_tiers.lookup(FP, [k]) == 0


def test_write_behind_acknowledges_from_memory_and_writes_later(tmp_path):
    gate = threading.Event()
    disk = DiskTier(tmp_path, 1 << 20)
    real_put = disk.put

    def slow_put(ek, b):
        gate.wait(5)
        return real_put(ek, b)

    disk.put = slow_put  # type: ignore[method-assign]
    store = TieredKVStore(memory=MemoryTier(5000), disk=disk, write_behind_bytes=10_000)
    blobs = [blob(i) for i in range(4)]
    for k, b in blobs:
        assert store.put(FP, k, b)  # returns while the disk write waits
    assert not disk.contains(EntryKey(FP, blobs[0][0]))
    # 4 KiB entries: the queue (10 000 bytes) holds two; the third is dropped, counted.
    s = store.stats()
    assert s.write_behind_dropped >= 1 and s.write_behind_pending_bytes > 0
    store.memory.delete(EntryKey(FP, blobs[0][0]))
    assert store.get(FP, blobs[0][0]) is not None  # read from the queue itself
    gate.set()
    assert store.flush(5)
    assert disk.contains(EntryKey(FP, blobs[0][0])) and store.stats().write_behind_pending_bytes == 0
    store.close()


def test_close_finishes_write_behind(tmp_path):
    store = TieredKVStore(
        memory=MemoryTier(1 << 20), disk=DiskTier(tmp_path, 1 << 20), write_behind_bytes=1 << 20
    )
    keys = []
    for i in range(5):
        k, b = blob(i)
        store.put(FP, k, b)
        keys.append(k)
    store.close()
    again = TieredKVStore(disk=DiskTier(tmp_path, 1 << 20))
    assert again.lookup(FP, keys) == 5


def test_get_run_stops_at_a_miss_or_at_its_byte_bound():
    store = TieredKVStore(memory=MemoryTier(1 << 20))
    blobs = [blob(i) for i in range(5)]
    for k, b in blobs[:4]:
        store.put(FP, k, b)
    keys = [k for k, _ in blobs]
    run, missed = store.get_run(FP, keys, max_bytes=1 << 20)
    assert [k for k, _, _ in run] == keys[:4] and missed
    run, missed = store.get_run(FP, keys, max_bytes=5000)  # 4096-byte payloads: two, then stop
    assert [k for k, _, _ in run] == keys[:2] and not missed
    assert bytes(run[1][2]) == entry(1)[2]
    assert store.get_run(FP, keys[4:], 1 << 20) == ([], True)
