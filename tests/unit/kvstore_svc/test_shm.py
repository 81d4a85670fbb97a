"""Shared memory segments: the client's (made, leased, unlinked), the store's (opened, checked, dropped)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading

import pytest

from kvstore_svc import shm
from kvstore_svc.shared_client import is_loopback, wants_shared
from kvstore_svc.shared_transfer import SharedEntry, copy_out, ingest
from kvstore_svc.shm import Region, Segment, SegmentMaps, SegmentPool, SegmentUnavailable
from kvstore_svc.store import TieredKVStore
from kvstore_svc.tiers.memory import MemoryTier
from services.kv_entry import CorruptEntry, encode_entry
from tests.helpers.kv_entries import FP, OTHER_FP, entry

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm on this host")


@pytest.fixture
def root():
    """A directory of our own under /dev/shm (tmpfs, as in production), so sweeps see only our files."""
    path = tempfile.mkdtemp(dir=shm.SHM_DIR, prefix="llmesh-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_segment_is_a_private_file_with_the_prefix_unlinked_on_close(root):
    seg = Segment(4096, root)
    assert seg.name.startswith(f"{shm.PREFIX}{os.getpid()}-")
    shm.check_name(seg.name)
    st = os.stat(seg.path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 4096
    seg.view[:5] = b"hello"
    seg.close()
    assert os.listdir(root) == []
    seg.close()  # twice is harmless


def test_a_forgotten_segment_is_unlinked_when_collected(root):
    seg = Segment(4096, root)
    del seg
    assert os.listdir(root) == []


@pytest.mark.parametrize(
    "name",
    [
        "../../etc/passwd",
        "llmesh-kv-",
        "llmesh-kv-short",
        "other-kv-12345678",
        "llmesh-kv-abc/defghijk",
        "llmesh-kv-" + "a" * 81,
        "llmesh-kv-12345678\n",
        "/dev/shm/llmesh-kv-12345678",
    ],
)
def test_names_outside_the_prefix_are_refused(name):
    with pytest.raises(ValueError, match="segment name"):
        shm.check_name(name)
    with pytest.raises(ValueError):
        Region(name, 4096, 0, 4096).check()


@pytest.mark.parametrize(
    "region",
    [
        Region("llmesh-kv-12345678", 4096, 0, 0),
        Region("llmesh-kv-12345678", 4096, 4000, 97),
        Region("llmesh-kv-12345678", 0, 0, 1),
        Region("llmesh-kv-12345678", 4096, 1 << 64, 1),
    ],
)
def test_regions_past_the_segment_are_refused(region):
    with pytest.raises(ValueError, match="region|segment_bytes"):
        region.check()


def test_the_store_maps_a_client_segment_and_sees_its_bytes(root):
    seg = Segment(8192, root)
    maps = SegmentMaps(root)
    with maps.open(Region(seg.name, 8192, 0, 8192)) as view:
        view[100:103] = b"abc"
    assert bytes(seg.view[100:103]) == b"abc"
    with maps.open(Region(seg.name, 8192, 4096, 4096)):
        assert len(maps) == 1  # the mapping is reused
    seg.close()
    maps._next_sweep = 0.0
    with pytest.raises(SegmentUnavailable):  # the client went away: its file is gone
        with maps.open(Region(seg.name, 8192, 0, 8192)):
            pass
    assert len(maps) == 0  # and the sweep dropped the mapping
    maps.close()


def test_the_store_refuses_what_it_cannot_use(root):
    maps = SegmentMaps(root)
    seg = Segment(8192, root)
    with pytest.raises(SegmentUnavailable, match="8192 bytes, the call says 4096"):
        with maps.open(Region(seg.name, 4096, 0, 4096)):
            pass
    with pytest.raises(SegmentUnavailable, match="cannot open"):
        with maps.open(Region("llmesh-kv-999999-00000000", 8192, 0, 8192)):
            pass
    os.symlink(seg.path, os.path.join(root, "llmesh-kv-symlink-1"))  # no links followed
    with pytest.raises(SegmentUnavailable):
        with maps.open(Region("llmesh-kv-symlink-1", 8192, 0, 8192)):
            pass
    os.mkdir(os.path.join(root, "llmesh-kv-adirectory"))
    with pytest.raises(SegmentUnavailable):
        with maps.open(Region("llmesh-kv-adirectory", 8192, 0, 8192)):
            pass
    with pytest.raises(ValueError):
        with maps.open(Region(seg.name, 8192, 8000, 1000)):
            pass
    seg.close()
    maps.close()


def test_a_replaced_segment_gets_a_fresh_mapping_and_old_ones_are_bounded(root):
    maps = SegmentMaps(root, max_maps=2)
    segs = [Segment(4096, root) for _ in range(3)]
    for s in segs:
        with maps.open(s.region()) as view:
            view[0:1] = b"x"
    assert len(maps) == 2
    path = segs[0].path
    segs[0].close()
    with open(path, "wb") as f:  # another file under the same name
        f.truncate(4096)
    with maps.open(Region(segs[0].name, 4096, 0, 4096)) as view:
        assert bytes(view[0:1]) == b"\0"
    os.unlink(path)
    for s in segs[1:]:
        s.close()
    maps.close()


def test_the_pool_leases_one_segment_per_caller_and_unlinks_all_on_close(root):
    pool = SegmentPool(4096, count=2, root=root)
    with pool.lease() as a, pool.lease() as b:
        assert a is not b
        got = []

        def third() -> None:
            with pool.lease() as c:
                got.append(c)

        t = threading.Thread(target=third)
        t.start()
        t.join(0.2)
        assert t.is_alive()  # a third caller waits for one of the two
    t.join(5)
    assert got and got[0] in (a, b)
    assert len(os.listdir(root)) == 2
    pool.close()
    assert os.listdir(root) == []
    with pytest.raises(RuntimeError, match="closed"):
        with pool.lease():
            pass


def test_a_leased_segment_is_unlinked_at_close_and_unmapped_at_release(root):
    pool = SegmentPool(4096, count=1, root=root)
    with pool.lease() as seg:
        pool.close()
        assert os.listdir(root) == []
        seg.view[0:1] = b"y"  # still mapped for the holder
    with pytest.raises(ValueError):  # unmapped once the lease ended
        seg.view[0:1] = b"z"


def test_a_segment_whose_call_failed_is_never_handed_out_again(root):
    pool = SegmentPool(4096, count=1, root=root)
    with pytest.raises(TimeoutError), pool.lease() as seg:
        raise TimeoutError("the store did not answer: it may still write into the segment")
    assert not os.path.exists(seg.path)
    with pool.lease() as fresh:
        assert fresh is not seg and os.path.exists(fresh.path)
    pool.close()
    assert os.listdir(root) == []


def test_segments_of_dead_processes_are_swept(root):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    orphan = os.path.join(root, f"{shm.PREFIX}{dead_pid}-0123456789abcdef")
    live = os.path.join(root, f"{shm.PREFIX}{os.getppid()}-0123456789abcdef")
    foreign = os.path.join(root, f"{shm.PREFIX}somebody-else")
    for p in (orphan, live, foreign):
        open(p, "wb").close()
    pool = SegmentPool(4096, count=1, root=root)  # at start: a restarted worker may not use it soon
    assert not os.path.exists(orphan)
    with pool.lease():
        pass
    left = set(os.listdir(root))
    assert os.path.basename(orphan) not in left
    assert {os.path.basename(live), os.path.basename(foreign)} <= left
    pool.close()


def test_a_segment_too_big_for_the_filesystem_fails_when_made_not_mid_copy(root):
    with pytest.raises(OSError):
        Segment(1 << 62, root)
    assert os.listdir(root) == []


# -- the store's copies --------------------------------------------------------------


def make_store() -> TieredKVStore:
    return TieredKVStore(memory=MemoryTier(64 << 20), max_entry_bytes=1 << 20)


def test_copy_out_packs_aligned_entries_and_stops_at_a_miss_or_a_full_region(root):
    store = make_store()
    ents = [entry(i, 1000 + 8 * i) for i in range(4)]
    for k, h, p in ents[:3]:
        store.put(FP, k, encode_entry(h, p))
    seg = Segment(8192, root)
    region = Region(seg.name, 8192, 100, 3000)
    got, full = copy_out(store, FP, [e[0] for e in ents], seg.view, region)
    assert [g.key for g in got] == [e[0] for e in ents[:2]] and full  # the third does not fit
    assert got[0].offset == 128 and got[1].offset % shm.ALIGN == 0
    for g, (_, h, p) in zip(got, ents, strict=False):
        assert g.header == h and bytes(seg.view[g.offset : g.offset + len(p)]) == p
    got, full = copy_out(store, FP, [e[0] for e in ents[2:]], seg.view, Region(seg.name, 8192, 0, 8192))
    assert len(got) == 1 and not full  # the fourth is a miss
    seg.close()


def test_ingest_checks_bounds_and_checksums_and_keeps_what_came_before(root):
    store = make_store()
    seg = Segment(8192, root)
    region = Region(seg.name, 8192, 0, 4096)
    (k0, h0, p0), (k1, h1, p1) = entry(0, 1024), entry(1, 1024)
    seg.view[0:1024] = p0
    seg.view[1024:2048] = p1
    assert ingest(store, FP, [SharedEntry(k0, h0, 0), SharedEntry(k1, h1, 1024)], seg.view, region) == (2, 0)
    assert store.lookup(FP, [k0, k1]) == 2

    (k2, h2, p2), (k3, h3, _) = entry(2, 1024), entry(3, 1024)
    seg.view[0:1024] = p2
    with pytest.raises(CorruptEntry, match="entry 1 .*outside the region.*1 earlier entries stored"):
        ingest(store, FP, [SharedEntry(k2, h2, 0), SharedEntry(k3, h3, 3584)], seg.view, region)
    assert store.lookup(FP, [k2]) == 1 and store.lookup(FP, [k3]) == 0
    with pytest.raises(CorruptEntry, match="checksum"):  # k3's header over k2's bytes
        ingest(store, FP, [SharedEntry(k3, h3, 0)], seg.view, region)
    with pytest.raises(CorruptEntry, match="fingerprint"):
        ingest(store, OTHER_FP, [SharedEntry(k3, h3, 0)], seg.view, region)
    assert store.lookup(FP, [k3]) == 0
    seg.close()


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:5", True),
        ("127.3.2.1:5", True),
        ("[::1]:5", True),
        ("localhost:5", True),
        ("unix:/tmp/kv.sock", True),
        ("10.0.0.7:5", False),
        ("kvstore:50070", False),
        ("[2001:db8::1]:5", False),
    ],
)
def test_auto_shares_memory_only_with_a_store_on_this_host(address, loopback):
    assert is_loopback(address) is loopback
    assert wants_shared("auto", address) is loopback
    assert wants_shared("on", address) is True
    assert wants_shared("off", address) is False


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="auto, on, off"):
        wants_shared("always", "127.0.0.1:1")
