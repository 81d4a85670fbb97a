"""Reads in place: the store's memory tier in its shared memory arena, leased to readers (real store process).

A client on loopback reads entries where they lie (GetInPlace, a read-only mapping) and
releases each lease; a reader that dies holding a lease leaks nothing (it expires, the space
is reused); a restarted store's new arena is mapped by a live client; a store killed in the
middle of a load neither kills the engine nor changes its tokens; a store without an arena is
read the other ways; a SmolLM2 engine loads a prefix in place with the recompute path's tokens.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import grpc
import pytest

from kvstore_svc import shm
from kvstore_svc.client import KVStoreClient
from llmesh.v1 import kvstore_pb2 as kv
from llmesh.v1 import kvstore_pb2_grpc as kvg
from services.grpc_server import open_sync_channel
from tests.helpers.kv_entries import entry
from tests.integration.test_kvstore import StoreProcess, fresh_fp

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm on this host")

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = StoreProcess(tmp_path_factory.mktemp("kvstore-inplace"), "--memory-bytes", "64MiB")
    yield s
    assert s.stop() == 0, s.log.read_text()[-3000:]


def _raw(address: str, method: str, request):
    with open_sync_channel(address) as ch:
        try:
            return getattr(kvg.KVStoreStub(ch), method)(request, timeout=10)
        except grpc.RpcError as e:
            return e


def test_entries_are_read_in_place_and_every_lease_is_released(store):
    fp = fresh_fp("inplace-rounds")
    ents = [entry(i, 300 * KiB, fp) for i in range(6)]
    keys = [k for k, _, _ in ents]
    with KVStoreClient(store.address, timeout_s=30, segment_bytes=MiB) as c:
        before = c.stats()
        assert c.put(fp, ents[:5]) == 5  # through the client's segment, into the arena
        assert c.get(fp, keys) == ents[:5]  # a miss ends the chain
        seen = []
        assert c.get_each(fp, keys[:5], lambda k, h, p: seen.append((k, h, bytes(p)))) == 5
        assert seen == ents[:5]
        assert c.get_each(fp, keys, lambda k, h, p: False) == 1
        after = c.stats()
        assert c.in_place is not None and c.in_place.arena == after.arena
        assert after.arena_bytes == 64 * MiB and os.path.exists(os.path.join(shm.SHM_DIR, after.arena))
        assert after.inplace_bytes_out - before.inplace_bytes_out >= 11 * 300 * KiB
        assert after.shared_bytes_out == before.shared_bytes_out  # no payload copied into a segment
        assert after.leases - before.leases == 3 and after.active_leases == 0 and after.leased_bytes == 0


def test_a_fenced_read_keeps_its_lease_until_the_copies_are_done(store):
    """A consumer copying asynchronously (a GPU's DMA) passes a fence: get_each returns at once,
    and the lease (and the mapping) is ended only once the fence's wait returns."""
    import threading

    fp = fresh_fp("inplace-fence")
    ents = [entry(i, 200 * KiB, fp) for i in range(3)]
    keys = [k for k, _, _ in ents]
    copies_done = threading.Event()
    fenced = []

    def fence():
        fenced.append(len(seen))
        return lambda: copies_done.wait(10)

    with KVStoreClient(store.address, timeout_s=30, segment_bytes=MiB) as c:
        assert c.put(fp, ents) == 3
        before = c.stats()
        seen = []
        assert c.get_each(fp, keys, lambda k, h, p: seen.append((k, h, bytes(p))), fence=fence) == 3
        assert seen == ents and fenced == [3]  # one fence for the one lease, after its entries
        held = c.stats()
        assert held.active_leases == before.active_leases + 1  # the copies are still "running"
        assert c.in_place is not None and c.in_place._map.users == 1
        copies_done.set()
        c.in_place.flush()
        after = c.stats()
        assert after.active_leases == before.active_leases and c.in_place._map.users == 0


def test_hostile_in_place_calls_get_the_protocols_codes_and_the_store_serves_on(store):
    fp = fresh_fp("inplace-hostile")
    arena = KVStoreClient(store.address).stats().arena
    bad_keys = _raw(store.address, "GetInPlace", kv.GetInPlaceRequest(fingerprint=fp, keys=[b""]))
    assert bad_keys.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The store's own arena named as a client segment: the store would write into its own entries.
    region = kv.SharedRegion(segment=arena, segment_bytes=64 * MiB, offset=0, length=4096)
    put = _raw(store.address, "PutShared", kv.PutSharedRequest(fingerprint=fp, region=region))
    assert put.code() == grpc.StatusCode.INVALID_ARGUMENT
    unknown = _raw(store.address, "ReleaseInPlace", kv.ReleaseInPlaceRequest(lease_id=12345))
    assert unknown.released is False
    miss = _raw(store.address, "GetInPlace", kv.GetInPlaceRequest(fingerprint=fp, keys=[b"k" * 32]))
    assert list(miss.entries) == [] and miss.lease_id == 0 and not miss.more
    with KVStoreClient(store.address, timeout_s=30) as c:
        e = entry(0, 4096, fp)
        assert c.put(fp, [e]) == 1 and c.get(fp, [e[0]]) == [e]


_DYING_READER = """
import sys, os, grpc
from llmesh.v1 import kvstore_pb2 as kv, kvstore_pb2_grpc as kvg
from services.grpc_server import open_sync_channel
address, fp, keys = sys.argv[1], bytes.fromhex(sys.argv[2]), [bytes.fromhex(k) for k in sys.argv[3:]]
with open_sync_channel(address) as ch:
    r = kvg.KVStoreStub(ch).GetInPlace(kv.GetInPlaceRequest(fingerprint=fp, keys=keys), timeout=10)
print(len(r.entries), flush=True)
os._exit(0)  # dies holding the lease
"""


def test_a_reader_killed_holding_a_lease_leaks_nothing(tmp_path):
    s = StoreProcess(tmp_path, "--memory-bytes", "4MiB", "--lease-timeout-s", "1")
    fp = fresh_fp("inplace-dead-reader")
    try:
        with KVStoreClient(s.address, timeout_s=30, segment_bytes=MiB) as c:
            ents = [entry(i, 512 * KiB, fp) for i in range(4)]
            assert c.put(fp, ents) == 4
            keys = [ents[0][0].hex(), ents[1][0].hex()]
            cmd = [sys.executable, "-c", _DYING_READER, s.address, fp.hex(), *keys]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
            assert out.stdout.strip() == "2"
            held = c.stats()
            assert held.active_leases == 1 and held.leased_bytes == 1 * MiB
            more = [entry(10 + i, 512 * KiB, fp) for i in range(8)]  # a whole arena's worth
            c.put(fp, more)
            assert c.lookup(fp, [ents[0][0]]) == 1  # leased: not evicted
            time.sleep(1.2)
            c.put(fp, more)  # the lease expired: the space is reused
            after = c.stats()
            assert after.active_leases == 0 and after.leased_bytes == 0 and after.lease_expiries == 1
            assert c.lookup(fp, [ents[0][0]]) == 0
            assert c.get(fp, [k for k, _, _ in more[-4:]]) == more[-4:]
    finally:
        assert s.stop() == 0


def test_a_chain_longer_than_one_lease_may_pin_is_read_in_several(tmp_path):
    s = StoreProcess(tmp_path, "--memory-bytes", "4MiB")  # leases pin at most 2 MiB
    fp = fresh_fp("inplace-long-chain")
    ents = [entry(i, 512 * KiB, fp) for i in range(6)]
    try:
        with KVStoreClient(s.address, timeout_s=30, segment_bytes=MiB) as c:
            assert c.put(fp, ents) == 6
            assert c.get(fp, [k for k, _, _ in ents]) == ents
            stats = c.stats()
            assert stats.leases == 2 and stats.active_leases == 0  # 4 entries, then 2
            assert stats.inplace_bytes_out == 3 * MiB and stats.shared_bytes_out == 0
    finally:
        assert s.stop() == 0


def test_entries_whose_lease_ran_out_are_read_another_way(tmp_path):
    s = StoreProcess(tmp_path, "--memory-bytes", "8MiB", "--lease-timeout-s", "0.2")
    fp = fresh_fp("inplace-slow-reader")
    ents = [entry(i, 64 * KiB, fp) for i in range(3)]
    try:
        with KVStoreClient(s.address, timeout_s=30, segment_bytes=MiB) as c:
            c.put(fp, ents)
            seen = []

            def slow(k, h, p):  # a reader that stalls past its lease on the first entry
                seen.append((k, h, bytes(p)))
                time.sleep(0.3)

            assert c.get_each(fp, [k for k, _, _ in ents], slow) == 3
            assert seen == ents  # entries 1 and 2 came through GetShared, not a stale arena slot
            stats = c.stats()
            assert stats.inplace_bytes_out == 3 * 64 * KiB and stats.shared_bytes_out == 2 * 64 * KiB
            assert c.in_place is not None  # a slow read is not a refusal
    finally:
        assert s.stop() == 0


def test_a_restarted_store_is_mapped_again_by_a_live_client(tmp_path):
    fp = fresh_fp("inplace-restart")
    ents = [entry(i, 64 * KiB, fp) for i in range(3)]
    s = StoreProcess(tmp_path, "--memory-bytes", "8MiB")
    c = KVStoreClient(s.address, timeout_s=30, segment_bytes=MiB)
    try:
        c.put(fp, ents)
        assert c.get(fp, [k for k, _, _ in ents]) == ents
        first = c.in_place.arena
        assert s.stop() == 0
        assert not os.path.exists(os.path.join(shm.SHM_DIR, first))  # the store unlinked it
        s = StoreProcess(tmp_path, "--memory-bytes", "8MiB", port=s.port)
        assert c.get(fp, [k for k, _, _ in ents]) == []  # an empty store: a miss, nothing mapped
        assert c.in_place is not None  # the restart cost this client no path
        c.put(fp, ents)
        assert c.get(fp, [k for k, _, _ in ents]) == ents
        assert c.in_place is not None and c.in_place.arena not in (None, first)
        assert c.in_place.arena == c.stats().arena
    finally:
        c.close()
        s.stop()


def test_prepare_maps_the_arena_once_ahead_of_the_first_load(store):
    """A worker maps (and, on CUDA, page-locks) the arena while it starts, not at its first load."""
    fp = fresh_fp("inplace-prepare")
    ents = [entry(i, 200 * KiB, fp) for i in range(2)]
    with KVStoreClient(store.address, timeout_s=30, segment_bytes=MiB) as writer:
        assert writer.put(fp, ents) == 2
    with KVStoreClient(store.address, timeout_s=30, segment_bytes=MiB) as c:
        mapped = []
        c.on_arena(mapped.append, lambda m: None)
        before = c.stats()
        c.prepare(fp)
        assert [m.name for m in mapped] == [before.arena] == [c.in_place.arena]
        assert c.stats().leases == before.leases  # asking for no keys leases nothing
        assert c.get(fp, [k for k, _, _ in ents]) == ents
        assert len(mapped) == 1  # the load used the mapping made ahead


def test_prepare_without_an_arena_makes_the_segments_and_never_raises(tmp_path):
    fp = fresh_fp("inplace-prepare-none")
    s = StoreProcess(tmp_path, "--memory-bytes", "8MiB", "--no-memory-arena")
    try:
        with KVStoreClient(s.address, timeout_s=30, segment_bytes=MiB) as c:
            made = []
            c.on_segments(made.append, lambda seg: None)
            c.prepare(fp)
            assert c.in_place is None and len(made) == 2 == len(c.shared.pool.names)
            c.prepare(fp)  # again: nothing new
            assert len(made) == 2
    finally:
        assert s.stop() == 0
    with KVStoreClient(s.address, timeout_s=1, segment_bytes=MiB) as c:
        c.prepare(fp)  # the store is gone: logged, the first use will say more


def test_a_store_without_an_arena_is_read_the_other_ways(tmp_path):
    fp = fresh_fp("inplace-none")
    ents = [entry(i, 100 * KiB, fp) for i in range(2)]
    for flag in ("--no-memory-arena", "--no-shared-memory"):
        s = StoreProcess(tmp_path, "--memory-bytes", "8MiB", flag)
        try:
            with KVStoreClient(s.address, timeout_s=30, segment_bytes=MiB) as c:
                assert c.put(fp, ents) == 2
                assert c.get(fp, [k for k, _, _ in ents]) == ents
                assert c.in_place is None  # refused once, not asked again
                stats = c.stats()
                assert stats.arena == "" and stats.inplace_bytes_out == 0
                assert (stats.shared_bytes_out > 0) == (flag == "--no-memory-arena")
        finally:
            assert s.stop() == 0


# -- an engine reading in place ----------------------------------------------------------


CHUNK_TOKENS = 64


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(100, 40000) for _ in range(200)] for _ in range(2)]


def _written(address: str, prompts, params, kw) -> list[list[int]]:
    from llmesh import LLM

    writer = LLM(kv_store=address, **kw)
    out = [o.outputs[0].token_ids for o in writer.generate(prompts, params, use_tqdm=False)]
    writer.engine.flush_kv()
    writer.engine.close()
    return out


def test_an_engine_loads_a_prefix_in_place_with_the_recompute_tokens(store):
    from llmesh import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = _prompts()
    kw = dict(kv_cache_memory=64 << 20, kv_chunk_tokens=CHUNK_TOKENS)
    reference = [
        o.outputs[0].token_ids
        for o in LLM(kv_cache_memory=64 << 20, enable_prefix_caching=False).generate(
            prompts, params, use_tqdm=False
        )
    ]
    assert _written(store.address, prompts, params, kw) == reference
    before = KVStoreClient(store.address).stats()

    reader = LLM(kv_store=store.address, **kw)  # a cold GPU cache: another worker
    got = [o.outputs[0].token_ids for o in reader.generate(prompts, params, use_tqdm=False)]
    assert got == reference
    counters = reader.engine.runner.kv_tiers.counters
    assert counters.store_loaded_blocks == 2 * ((200 - 1) // CHUNK_TOKENS) * CHUNK_TOKENS // 16
    assert counters.store_load_failures == 0
    client = reader.engine.kv_store
    assert client.in_place is not None and client.in_place.bytes_in >= counters.store_loaded_bytes
    after = KVStoreClient(store.address).stats()
    assert after.inplace_bytes_out - before.inplace_bytes_out >= counters.store_loaded_bytes
    assert after.shared_bytes_out == before.shared_bytes_out and after.active_leases == 0
    blocks = reader.engine.blocks
    reader.engine.close()
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_blocks


def test_a_store_killed_mid_load_costs_the_engine_nothing_but_time(tmp_path):
    from llmesh import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = _prompts()
    kw = dict(kv_cache_memory=64 << 20, kv_chunk_tokens=CHUNK_TOKENS)
    s = StoreProcess(tmp_path, "--memory-bytes", "64MiB")
    try:
        expected = _written(s.address, prompts, params, kw)
        # Every hit loaded (the predictor, which times loads against prefills, may skip the loads
        # after the kill on a loaded machine: no GetInPlace then meets the dead store).
        reader = LLM(kv_store=s.address, kv_load_predictor=False, **kw)
        tiers = reader.engine.runner.kv_tiers
        load_chunk = tiers._load_chunk

        def killing_load_chunk(targets, chunk):  # the store dies while the worker copies from its arena
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait(10)
            load_chunk(targets, chunk)

        tiers._load_chunk = killing_load_chunk
        got = [o.outputs[0].token_ids for o in reader.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        assert s.proc.poll() is not None and tiers.counters.store_loaded_blocks > 0
        assert reader.engine.kv_store.in_place.arena is None  # the dead store's arena was let go
        blocks = reader.engine.blocks
        reader.engine.close()
        blocks.check_invariants()
        assert blocks.num_free_blocks == blocks.num_blocks
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    # A killed store cannot unlink its arena: the next store of this user does.
    leftover = [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"llmesh-kvstore-{s.proc.pid}-")]
    assert len(leftover) == 1
    StoreProcess(tmp_path, "--memory-bytes", "1MiB").stop()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, leftover[0]))
