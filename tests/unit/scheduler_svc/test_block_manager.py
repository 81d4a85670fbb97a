from scheduler_svc.block_manager import BlockManager
from scheduler_svc.prefix_hash import ROOT_KEY, block_key, extend_block_keys


def test_block_keys_are_a_stable_chain():
    keys = extend_block_keys([], list(range(40)), 16, b"fp")
    assert len(keys) == 2  # only full blocks
    assert keys[0] == block_key(ROOT_KEY, list(range(16)), b"fp")
    assert keys[1] == block_key(keys[0], list(range(16, 32)), b"fp")
    # Known value: the chain must not depend on the process (no Python hash()).
    assert keys[0].hex()[:16] == block_key(ROOT_KEY, list(range(16)), b"fp").hex()[:16]
    assert extend_block_keys([], list(range(40)), 16, b"other")[0] != keys[0]


def test_allocate_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", list(range(10)), 0, 10) is not None
    assert bm.num_free_blocks == 5
    assert bm.allocate("b", list(range(100, 124)), 0, 24) is None  # needs 6, 5 free
    assert bm.num_free_blocks == 5  # a failed allocation changes nothing
    bm.check_invariants()
    bm.free_seq("a")
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_prefix_hit_shares_blocks_and_ref_counts():
    bm = BlockManager(num_blocks=16, block_size=4, fingerprint=b"m")
    prompt = list(range(12))
    bm.allocate("a", prompt, 0, 12)
    hits = bm.longest_cached_prefix(prompt + [99, 98])
    assert hits == bm.block_ids("a")[:3]
    bm.allocate("b", prompt + [99, 98], 12, 2)
    assert bm.block_ids("b")[:3] == bm.block_ids("a")[:3]
    assert all(bm.blocks[b].ref_count == 2 for b in hits)
    bm.check_invariants()
    bm.free_seq("a")
    bm.free_seq("b")
    bm.check_invariants()
    assert bm.num_free_blocks == 16
    # Finished blocks stay cached until evicted.
    assert bm.longest_cached_prefix(prompt) == hits


def test_lru_eviction_drops_cached_keys():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", [1, 2, 3, 4], 0, 4)
    bm.free_seq("a")
    assert len(bm.longest_cached_prefix([1, 2, 3, 4])) == 2
    bm.allocate("b", [5, 6, 7, 8, 9, 10, 11, 12], 0, 8)  # takes every block
    assert bm.longest_cached_prefix([1, 2, 3, 4]) == []
    bm.free_seq("b")
    bm.check_invariants()


def test_cached_hit_in_free_list_counts_against_fresh_allocation():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", [1, 2, 3, 4], 0, 4)
    bm.free_seq("a")  # both blocks cached and free
    # b hits 2 cached blocks and needs 2 more, but only 1 other block is free.
    assert bm.allocate("b", [1, 2, 3, 4, 5, 6, 7], 4, 3) is None
    bm.check_invariants()
    assert bm.allocate("b", [1, 2, 3, 4, 5, 6], 4, 2) is not None
    bm.free_seq("b")
    bm.check_invariants()
    assert bm.num_free_blocks == 3
