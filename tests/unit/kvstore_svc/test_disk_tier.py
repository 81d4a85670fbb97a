"""The disk tier: files named by hex key, atomic writes, LRU within a budget, kept across restarts."""

from __future__ import annotations

import os

import pytest

from kvstore_svc.store import TieredKVStore
from kvstore_svc.tiers.base import EntryKey
from kvstore_svc.tiers.disk import DiskTier
from tests.helpers.kv_entries import FP, blob


def k(i: int) -> EntryKey:
    return EntryKey(FP, bytes([i]) * 32)


def test_entries_are_files_named_by_hex_key(tmp_path):
    tier = DiskTier(tmp_path, 10_000)
    assert tier.put(k(1), b"hello")
    path = tmp_path / FP.hex() / f"{(bytes([1]) * 32).hex()}.kv"
    assert path.read_bytes() == b"hello"
    assert tier.get(k(1)) == b"hello"
    assert not list(tmp_path.rglob("*.tmp"))  # written to a temp file, renamed into place


def test_only_the_stores_user_reads_the_folders_and_files(tmp_path):
    """KV bytes reveal prompts and file names (chunk keys) say which were sent."""
    root = tmp_path / "kv"
    tier = DiskTier(root, 10_000)
    assert tier.put(k(1), b"hello")
    assert root.stat().st_mode & 0o777 == 0o700
    assert (root / FP.hex()).stat().st_mode & 0o777 == 0o700
    assert next((root / FP.hex()).glob("*.kv")).stat().st_mode & 0o777 == 0o600


def test_budget_evicts_least_recently_used_and_deletes_their_files(tmp_path):
    tier = DiskTier(tmp_path, 300)
    for i in range(3):
        tier.put(k(i), bytes(100))
    tier.get(k(0))
    tier.put(k(3), bytes(100))
    assert tier.contains_many([k(0), k(1), k(2), k(3)]) == [True, False, True, True]
    assert len(list(tmp_path.rglob("*.kv"))) == 3
    assert not tier.put(k(4), bytes(301))
    s = tier.stats()
    assert (s.entries, s.bytes, s.evictions) == (3, 300, 1)


def test_a_restart_finds_every_entry_in_recency_order(tmp_path):
    tier = DiskTier(tmp_path, 300)
    for i in range(3):
        tier.put(k(i), bytes(100))
    # Recency across a restart comes from mtimes: make 1 the oldest, 0 the newest.
    for i, t in ((1, 1000), (2, 2000), (0, 3000)):
        os.utime(tmp_path / FP.hex() / f"{k(i).key.hex()}.kv", (t, t))
    tier.close()
    (tmp_path / FP.hex() / "junk.txt").write_text("ignored")
    (tmp_path / FP.hex() / f"{k(7).key.hex()}.123.456.tmp").write_bytes(b"half")  # a crashed write
    again = DiskTier(tmp_path, 300)
    assert again.stats().entries == 3 and again.stats().bytes == 300
    assert not list(tmp_path.rglob("*.tmp"))
    again.put(k(3), bytes(100))
    assert again.contains_many([k(0), k(1), k(2), k(3)]) == [True, False, True, True]


def test_a_smaller_budget_after_a_restart_evicts_the_oldest(tmp_path):
    tier = DiskTier(tmp_path, 300)
    for i in range(3):
        tier.put(k(i), bytes(100))
        os.utime(tmp_path / FP.hex() / f"{k(i).key.hex()}.kv", (1000 + i, 1000 + i))
    tier.close()
    again = DiskTier(tmp_path, 150)
    assert again.contains_many([k(0), k(1), k(2)]) == [False, False, True]
    assert len(list(tmp_path.rglob("*.kv"))) == 1


def test_one_store_per_directory(tmp_path):
    tier = DiskTier(tmp_path, 100)
    with pytest.raises(RuntimeError, match="in use"):
        DiskTier(tmp_path, 100)
    tier.close()
    DiskTier(tmp_path, 100).close()


def test_a_corrupt_file_is_a_miss_and_is_deleted(tmp_path):
    store = TieredKVStore(disk=DiskTier(tmp_path, 1 << 20))
    key, data = blob(1)
    assert store.put(FP, key, data)
    (path,) = tmp_path.rglob("*.kv")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert store.lookup(FP, [key]) == 1  # lookups read indexes, not contents
    assert store.get(FP, key) is None
    assert not path.exists() and store.lookup(FP, [key]) == 0
    assert store.stats().tiers[0].corrupt == 1


def test_a_file_removed_behind_its_back_is_a_miss(tmp_path):
    tier = DiskTier(tmp_path, 1000)
    tier.put(k(1), b"x")
    next(tmp_path.rglob("*.kv")).unlink()
    assert tier.get(k(1)) is None and not tier.contains(k(1))
