"""The store's arena: its allocator (fill, free, coalesce, first fit) and its file (mode, unlink, orphans)."""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys

import pytest

from kvstore_svc.arena import ARENA_PREFIX, COMMIT_STEP, ArenaFile, FreeSpace, check_arena_name
from kvstore_svc.shm import ALIGN


def test_fill_to_the_last_byte_then_nothing_fits():
    space = FreeSpace(16 * ALIGN)
    starts = [space.alloc(ALIGN) for _ in range(16)]
    assert starts == [i * ALIGN for i in range(16)]
    assert space.alloc(1) is None and space.free_bytes == 0


def test_sizes_are_aligned_and_runs_never_overlap():
    space = FreeSpace(1 << 20)
    rng = random.Random(0)
    held: dict[int, int] = {}
    for _ in range(2000):
        if held and rng.random() < 0.45:
            start = rng.choice(list(held))
            space.free(start, held.pop(start))
        else:
            n = rng.randrange(1, 40_000)
            start = space.alloc(n)
            if start is not None:
                assert start % ALIGN == 0
                held[start] = n
        taken = sorted((s, s + -(-n // ALIGN) * ALIGN) for s, n in held.items())
        assert all(a[1] <= b[0] for a, b in zip(taken, taken[1:], strict=False))
        assert space.free_bytes + sum(e - s for s, e in taken) == space.size
    for start, n in held.items():
        space.free(start, n)
    assert space.runs() == [(0, space.size)]  # everything coalesced back into one run


def test_freeing_coalesces_with_both_neighbours():
    space = FreeSpace(4 * ALIGN)
    a, b, c, d = (space.alloc(ALIGN) for _ in range(4))
    space.free(a, ALIGN)
    space.free(c, ALIGN)
    assert space.runs() == [(a, ALIGN), (c, ALIGN)]
    assert space.alloc(2 * ALIGN) is None  # two free runs, neither long enough
    assert space.free(b, ALIGN) == 3 * ALIGN  # joins the run before and the run after
    assert space.runs() == [(0, 3 * ALIGN)]
    assert space.alloc(3 * ALIGN) == 0
    del d


def test_equal_sized_entries_reuse_freed_runs_exactly():
    """Entries of one fingerprint are one size: a freed slot is taken whole by the next entry."""
    size = 12 << 20
    space = FreeSpace(10 * size)
    slots = [space.alloc(size) for _ in range(10)]
    for s in slots[::2]:
        space.free(s, size)
    again = sorted(space.alloc(size) for _ in range(5))
    assert again == sorted(slots[::2]) and space.free_bytes == 0


def test_a_bad_free_is_refused():
    space = FreeSpace(8 * ALIGN)
    with pytest.raises(ValueError):
        space.free(3, ALIGN)
    with pytest.raises(ValueError):
        space.free(7 * ALIGN, 2 * ALIGN)


def test_the_file_is_the_owners_alone_and_unlinked_on_close(tmp_path):
    arena = ArenaFile(1 << 20, str(tmp_path))
    check_arena_name(arena.name)
    st = os.stat(arena.path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 1 << 20
    assert arena.name.startswith(f"{ARENA_PREFIX}{os.getpid()}-")
    arena.view[:4] = b"abcd"
    arena.close()
    assert not os.path.exists(arena.path)


@pytest.mark.parametrize(
    "name", ["llmesh-kv-123-abc", "llmesh-kvstore-1-xyz", "../llmesh-kvstore-1-0123456789abcdef", ""]
)
def test_only_arena_names_are_accepted(name):
    with pytest.raises(ValueError):
        check_arena_name(name)


def test_an_arena_of_a_killed_store_is_removed_by_the_next(tmp_path):
    code = (
        "import os, sys; from kvstore_svc.arena import ArenaFile; a = ArenaFile(4096, sys.argv[1]); "
        "print(a.name, flush=True); os._exit(0)"  # dies without unlinking (as a killed store)
    )
    cmd = [sys.executable, "-c", code, str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    orphan = out.stdout.strip()
    assert os.path.exists(tmp_path / orphan)
    arena = ArenaFile(4096, str(tmp_path))
    try:
        assert not os.path.exists(tmp_path / orphan)
    finally:
        arena.close()


def test_pages_are_committed_as_the_allocator_reaches_them(tmp_path):
    arena = ArenaFile(3 * COMMIT_STEP, str(tmp_path))
    try:
        assert arena.committed == 0 and os.stat(arena.path).st_blocks == 0  # sparse at start
        assert arena.commit(100) and arena.committed == COMMIT_STEP
        assert arena.commit(COMMIT_STEP) and arena.committed == COMMIT_STEP
        assert arena.commit(COMMIT_STEP + 1) and arena.committed == 2 * COMMIT_STEP
        assert os.stat(arena.path).st_blocks * 512 >= 2 * COMMIT_STEP
    finally:
        arena.close()


def test_an_arena_larger_than_the_free_space_is_refused_up_front(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(OSError, match="free"):
        ArenaFile(free + (1 << 30), str(tmp_path))
    assert os.listdir(tmp_path) == []
