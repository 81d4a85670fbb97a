"""The memory tier in the arena: LRU eviction that skips leased entries, leases and their expiry."""

from __future__ import annotations

import pytest

from kvstore_svc.store import TieredKVStore
from kvstore_svc.tiers.arena import ArenaMemoryTier
from kvstore_svc.tiers.base import EntryKey
from services.kv_entry import CorruptEntry, encode_entry
from tests.helpers.clock import Clock
from tests.helpers.kv_entries import FP, OTHER_FP, entry

KiB = 1 << 10


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def tier(tmp_path, clock):
    t = ArenaMemoryTier(64 * KiB, root=str(tmp_path), lease_timeout_s=10.0, clock=clock)
    yield t
    t.close()


def ek(i: int) -> EntryKey:
    return EntryKey(FP, entry(i, 16)[0])


def put(tier: ArenaMemoryTier, i: int, nbytes: int = 16 * KiB) -> bool:
    k, h, p = entry(i, nbytes)
    return tier.put_entry(EntryKey(FP, k), h, p)


def test_entries_round_trip_and_lie_where_the_index_says(tier):
    k, h, p = entry(0, 16 * KiB)
    assert tier.put_entry(EntryKey(FP, k), h, p)
    header, payload = tier.get_entry(EntryKey(FP, k))
    assert header == h and bytes(payload) == p
    assert tier.get(EntryKey(FP, k)) == encode_entry(h, p)  # the blob form, for the store
    lease = tier.open_lease()
    slot = tier.pin(lease, EntryKey(FP, k))
    assert bytes(tier.arena.view[slot.offset : slot.offset + len(p)]) == p
    assert tier.release(lease)


def test_a_full_arena_evicts_the_least_recently_used(tier):
    for i in range(4):
        assert put(tier, i)
    tier.get_entry(ek(0))  # 0 is recent now: 1 goes first
    assert put(tier, 4)
    assert tier.contains_many([ek(i) for i in range(5)]) == [True, False, True, True, True]
    assert tier.stats().evictions == 1


def test_eviction_skips_leased_entries(tier):
    for i in range(4):
        put(tier, i)
    lease = tier.open_lease()
    assert tier.pin(lease, ek(0)) and tier.pin(lease, ek(1))
    tier.get_entry(ek(2))
    tier.get_entry(ek(3))  # recency: 0, 1 (leased), 2, 3
    assert put(tier, 4)  # 0 and 1 are the oldest but leased: 2 goes
    assert tier.contains_many([ek(i) for i in range(5)]) == [True, True, False, True, True]
    tier.release(lease)
    assert put(tier, 5)  # no longer leased: 0 goes now
    assert not tier.contains(ek(0))


def test_a_put_larger_than_any_free_run_evicts_until_one_fits(tier):
    for i in range(8):
        put(tier, i, 8 * KiB)
    assert tier.free_bytes == 0
    assert put(tier, 20, 24 * KiB)  # needs three adjacent 8 KiB slots: the three oldest go
    assert tier.contains_many([ek(i) for i in range(8)]) == [False] * 3 + [True] * 5


def test_no_room_while_everything_is_leased_rejects_the_put(tmp_path, clock):
    t = ArenaMemoryTier(64 * KiB, root=str(tmp_path), max_leased_fraction=1.0, clock=clock)
    try:
        for i in range(4):
            put(t, i)
        lease = t.open_lease()
        assert all(t.pin(lease, ek(i)) for i in range(4))
        assert not put(t, 9)  # nothing may be evicted
        assert not put(t, 10, 128 * KiB)  # larger than the arena
        t.release(lease)
        assert put(t, 9)
    finally:
        t.close()


def test_leases_pin_at_most_their_share_of_the_arena(tier):
    for i in range(4):
        put(tier, i)  # 16 KiB each; leases may pin 32 KiB
    lease = tier.open_lease()
    assert tier.pin(lease, ek(0)) and tier.pin(lease, ek(1))
    assert tier.pin(lease, ek(2)) is False  # present, but over the cap
    assert tier.pin(lease, ek(7)) is None  # absent
    assert tier.leased_bytes == 32 * KiB
    tier.release(lease)
    assert tier.leased_bytes == 0


def test_an_entry_deleted_while_leased_keeps_its_bytes_until_released(tier):
    k, h, p = entry(0, 16 * KiB)
    tier.put_entry(EntryKey(FP, k), h, p)
    lease = tier.open_lease()
    slot = tier.pin(lease, EntryKey(FP, k))
    assert tier.delete(EntryKey(FP, k)) and not tier.contains(EntryKey(FP, k))
    for i in range(1, 7):
        assert put(tier, i)  # fills the other three slots, then evicts round them
    assert bytes(tier.arena.view[slot.offset : slot.offset + len(p)]) == p  # never reused
    assert tier.free_bytes == 0 and tier.stats().entries == 3
    tier.release(lease)
    assert tier.free_bytes == 16 * KiB  # freed at the last release


def test_an_unreleased_lease_expires_and_counts(tier, clock):
    for i in range(4):
        put(tier, i)
    lease = tier.open_lease()
    tier.pin(lease, ek(0))
    clock.now += 9.9
    assert tier.active_leases == 1
    clock.now += 0.2  # its holder died: past the timeout
    assert tier.active_leases == 0 and tier.lease_expiries == 1 and tier.leased_bytes == 0
    assert not tier.release(lease)  # too late: not an error, just False
    assert tier.pin(lease, ek(1)) is False  # an expired lease takes no more entries
    for i in range(4, 8):
        assert put(tier, i)  # 0 is evictable again
    assert not tier.contains(ek(0))


def test_lease_ids_are_unguessable_and_unknown_ones_are_refused(tier):
    ids = {tier.open_lease() for _ in range(50)}
    assert len(ids) == 50 and 0 not in ids
    assert not tier.release(12345)


def test_reserve_commit_abort(tier):
    k, h, p = entry(0, 16 * KiB)
    slot = tier.reserve(EntryKey(FP, k), h)
    tier.view(slot)[:] = p
    assert not tier.contains(EntryKey(FP, k))  # not readable before commit
    tier.commit(slot)
    assert bytes(tier.get_entry(EntryKey(FP, k))[1]) == p
    free = tier.free_bytes
    slot = tier.reserve(ek(1), entry(1, 16 * KiB)[1])
    tier.abort(slot)
    assert tier.free_bytes == free


# -- the store over the arena: leases of the leading keys, checks on put ----------------


@pytest.fixture
def store(tmp_path, clock):
    s = TieredKVStore(memory=ArenaMemoryTier(256 * KiB, root=str(tmp_path), clock=clock))
    yield s
    s.close()


def test_a_lease_covers_the_leading_present_keys(store):
    ents = [entry(i, 16 * KiB) for i in range(4)]
    for k, h, p in ents[:3]:
        assert store.put_payload(FP, k, h, memoryview(p))
    grant = store.lease_in_place(FP, [k for k, _, _ in ents])
    assert [e.key for e in grant.entries] == [k for k, _, _ in ents[:3]] and not grant.more
    view = store.arena.arena.view
    for e, (_, h, p) in zip(grant.entries, ents, strict=False):
        assert e.header == h and bytes(view[e.offset : e.offset + len(p)]) == p
    assert grant.arena == store.arena.arena.name and grant.lease_id
    stats = store.stats()
    assert stats.active_leases == 1 and stats.leased_bytes == 48 * KiB and stats.inplace_bytes_out == 48 * KiB
    assert store.release_in_place(grant.lease_id) and not store.release_in_place(grant.lease_id)
    empty = store.lease_in_place(FP, [ents[3][0]])
    assert empty.entries == [] and empty.lease_id == 0 and store.stats().active_leases == 0


def test_a_lease_stops_with_more_at_the_cap(store):
    ents = [entry(i, 48 * KiB) for i in range(4)]  # 192 KiB; leases may pin 128 KiB
    for k, h, p in ents:
        store.put_payload(FP, k, h, memoryview(p))
    grant = store.lease_in_place(FP, [k for k, _, _ in ents])
    assert len(grant.entries) == 2 and grant.more
    store.release_in_place(grant.lease_id)


def test_put_payload_checks_the_arena_copy_and_keeps_nothing_bad(store):
    k, h, p = entry(0, 16 * KiB)
    bad = bytearray(p)
    bad[5] ^= 1
    free = store.arena.free_bytes
    with pytest.raises(CorruptEntry, match="checksum"):
        store.put_payload(FP, k, h, memoryview(bad))
    with pytest.raises(CorruptEntry, match="fingerprint"):
        store.put_payload(OTHER_FP, k, h, memoryview(p))
    assert store.arena.free_bytes == free and store.lookup(FP, [k]) == 0
    assert store.stats().invalid_entries == 2


@pytest.mark.parametrize("keys", [[b""], [b"x" * 65], [b"k"] * 16385])
def test_bad_keys_are_value_errors(store, keys):
    with pytest.raises(ValueError):
        store.lease_in_place(FP, keys)
