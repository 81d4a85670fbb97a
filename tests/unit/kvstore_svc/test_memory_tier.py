"""The memory tier: a byte budget, least recently used out first."""

from __future__ import annotations

from kvstore_svc.tiers.base import EntryKey
from kvstore_svc.tiers.memory import MemoryTier


def k(i: int, fp: bytes = b"fp") -> EntryKey:
    return EntryKey(fp, bytes([i]))


def test_budget_evicts_least_recently_used_first():
    tier = MemoryTier(300)
    for i in range(3):
        assert tier.put(k(i), bytes(100))
    assert tier.get(k(0)) is not None  # 0 is now the most recent: 1 goes first
    assert tier.put(k(3), bytes(100))
    assert tier.contains_many([k(0), k(1), k(2), k(3)]) == [True, False, True, True]
    s = tier.stats()
    assert (s.entries, s.bytes, s.capacity_bytes, s.evictions, s.puts) == (3, 300, 300, 1, 4)


def test_a_big_entry_evicts_as_many_as_it_needs():
    tier = MemoryTier(300)
    for i in range(3):
        tier.put(k(i), bytes(100))
    assert tier.put(k(9), bytes(250))  # 300 - 250: all three must go
    assert tier.contains_many([k(0), k(1), k(2), k(9)]) == [False, False, False, True]
    assert tier.stats().bytes == 250 and tier.stats().evictions == 3


def test_an_entry_larger_than_the_budget_is_refused_and_evicts_nothing():
    tier = MemoryTier(300)
    tier.put(k(0), bytes(100))
    assert not tier.put(k(1), bytes(301))
    assert tier.contains(k(0)) and not tier.contains(k(1))


def test_fingerprints_are_separate_key_spaces():
    tier = MemoryTier(1000)
    tier.put(k(1, b"a"), b"A" * 10)
    tier.put(k(1, b"b"), b"B" * 10)
    assert tier.get(k(1, b"a")) == b"A" * 10 and tier.get(k(1, b"b")) == b"B" * 10


def test_hits_misses_delete_and_repeated_puts():
    tier = MemoryTier(1000)
    assert tier.get(k(1)) is None
    tier.put(k(1), b"x" * 10)
    assert tier.put(k(1), b"x" * 10)  # already there: no double accounting
    assert tier.get(k(1)) == b"x" * 10
    assert tier.delete(k(1)) and not tier.delete(k(1))
    s = tier.stats()
    assert (s.hits, s.misses, s.entries, s.bytes, s.puts) == (1, 1, 0, 0, 1)
