"""The KV store's same-host path: payloads through the client's shared memory segments (real store process).

These stores keep no arena (--no-memory-arena), so gets take GetShared as well; reads in place
from the store's arena are tests/integration/test_kvstore_in_place.py.

A client on loopback moves entries with GetShared / PutShared; hostile regions are refused
with the protocol's codes; a store that refuses shared memory, or cannot open the client's
segment (as from another container), is streamed to instead; a store killed mid-call costs
the caller a miss, never its segments; an engine loads a SmolLM2 prefix through shared
memory with the recompute path's greedy tokens.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import tempfile
import threading
import time

import grpc
import pytest

from kvstore_svc import shm
from kvstore_svc.client import KVStoreClient, KVStoreUnavailable
from llmesh.v1 import kvstore_pb2 as kv
from llmesh.v1 import kvstore_pb2_grpc as kvg
from services.grpc_server import open_sync_channel
from tests.helpers.kv_entries import entry
from tests.integration.test_kvstore import StoreProcess, fresh_fp

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm on this host")

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    # No arena: gets use the client's segments too (reads in place: test_kvstore_in_place.py).
    s = StoreProcess(tmp_path_factory.mktemp("kvstore-shm"), "--memory-bytes", "256MiB", "--no-memory-arena")
    yield s
    assert s.stop() == 0, s.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def refusing_store(tmp_path_factory):
    s = StoreProcess(
        tmp_path_factory.mktemp("kvstore-noshm"), "--memory-bytes", "256MiB", "--no-shared-memory"
    )
    yield s
    assert s.stop() == 0, s.log.read_text()[-3000:]


def segment_files(client: KVStoreClient) -> list[str]:
    names = client.shared.pool.names if client.shared is not None else []
    return [n for n in names if os.path.exists(os.path.join(shm.SHM_DIR, n))]


def test_entries_round_trip_through_shared_memory_in_rounds(store):
    fp = fresh_fp("shm-rounds")
    # 300 KiB entries in 1 MiB segments: three per round; one of 1.5 MiB fits no segment (streamed).
    ents = [entry(i, 300 * KiB, fp) for i in range(7)] + [entry(7, 1536 * KiB, fp)]
    keys = [k for k, _, _ in ents]
    with KVStoreClient(store.address, timeout_s=30, segment_bytes=MiB) as c:
        before = c.stats()
        assert c.put(fp, ents) == 8
        assert c.get(fp, keys) == ents
        seen = []
        assert c.get_each(fp, keys, lambda k, h, p: seen.append((k, h, bytes(p)))) == 8
        assert seen == ents
        assert c.get_each(fp, keys, lambda k, h, p: False) == 1  # the consumer stops the run
        # A fenced consumer: each reply's copies are waited for before its segment is written
        # again (3 replies of three 300 KiB entries); the streamed one, after itself.
        waits = []
        fenced = c.get_each(fp, keys, lambda k, h, p: None, fence=lambda: lambda: waits.append(1))
        assert fenced == 8 and len(waits) == 4
        assert c.shared is not None
        after = c.stats()
        assert after.shared_bytes_in - before.shared_bytes_in == 7 * 300 * KiB
        assert after.shared_bytes_out - before.shared_bytes_out >= 3 * 7 * 300 * KiB
        assert after.shared_segments >= 1
        names = c.shared.pool.names
        assert names and all(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in names)
    assert not any(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in names)  # unlinked on close


def _raw(address: str, method: str, request) -> grpc.RpcError | object:
    with open_sync_channel(address) as ch:
        try:
            return getattr(kvg.KVStoreStub(ch), method)(request, timeout=10)
        except grpc.RpcError as e:
            return e


def test_hostile_regions_get_the_protocols_codes_and_the_store_serves_on(store, tmp_path):
    fp = fresh_fp("shm-hostile")
    k, h, p = entry(0, 4096, fp)
    seg = shm.Segment(64 * KiB)
    try:
        seg.view[: len(p)] = p
        good = kv.SharedRegion(segment=seg.name, segment_bytes=seg.size, offset=0, length=seg.size)
        from services.kv_entry import header_to_proto

        hp = header_to_proto(h)
        cases = {
            "a name outside the prefix": (
                "GetShared",
                kv.GetSharedRequest(
                    fingerprint=fp,
                    keys=[k],
                    region=kv.SharedRegion(
                        segment="../../etc/passwd", segment_bytes=4096, offset=0, length=4096
                    ),
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "a region past the segment": (
                "GetShared",
                kv.GetSharedRequest(
                    fingerprint=fp,
                    keys=[k],
                    region=kv.SharedRegion(
                        segment=seg.name, segment_bytes=seg.size, offset=seg.size - 10, length=100
                    ),
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "another size than the file's": (
                "GetShared",
                kv.GetSharedRequest(
                    fingerprint=fp,
                    keys=[k],
                    region=kv.SharedRegion(
                        segment=seg.name, segment_bytes=2 * seg.size, offset=0, length=seg.size
                    ),
                ),
                grpc.StatusCode.FAILED_PRECONDITION,
            ),
            "a segment that does not exist here": (
                "GetShared",
                kv.GetSharedRequest(
                    fingerprint=fp,
                    keys=[k],
                    region=kv.SharedRegion(
                        segment="llmesh-kv-1-0000000000000000", segment_bytes=4096, offset=0, length=4096
                    ),
                ),
                grpc.StatusCode.FAILED_PRECONDITION,
            ),
            "a payload outside the region": (
                "PutShared",
                kv.PutSharedRequest(
                    fingerprint=fp,
                    region=kv.SharedRegion(segment=seg.name, segment_bytes=seg.size, offset=0, length=4096),
                    entries=[kv.SharedEntry(key=k, header=hp, offset=64)],
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            "a payload that fails its checksum": (
                "PutShared",
                kv.PutSharedRequest(
                    fingerprint=fp, region=good, entries=[kv.SharedEntry(key=k, header=hp, offset=8192)]
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
        }
        for name, (method, request, code) in cases.items():
            got = _raw(store.address, method, request)
            assert isinstance(got, grpc.RpcError) and got.code() == code, name
        # and the honest request still works on the same segment
        put = _raw(
            store.address,
            "PutShared",
            kv.PutSharedRequest(
                fingerprint=fp, region=good, entries=[kv.SharedEntry(key=k, header=hp, offset=0)]
            ),
        )
        assert put.num_stored == 1
        seg.view[: len(p)] = b"\0" * len(p)
        resp = _raw(store.address, "GetShared", kv.GetSharedRequest(fingerprint=fp, keys=[k], region=good))
        e = resp.entries[0]
        assert bytes(seg.view[e.offset : e.offset + len(p)]) == p and not resp.region_full
    finally:
        seg.close()


def test_a_store_that_refuses_shared_memory_is_streamed_to(refusing_store):
    fp = fresh_fp("shm-refused")
    ents = [entry(i, 200 * KiB, fp) for i in range(3)]
    with KVStoreClient(refusing_store.address, timeout_s=30, segment_bytes=MiB) as c:
        assert c.shared is not None  # loopback: it tries
        assert c.put(fp, ents) == 3
        assert c.shared is None  # ... and remembers the refusal
        assert c.get(fp, [k for k, _, _ in ents]) == ents
        stats = c.stats()
        assert stats.shared_bytes_in == stats.shared_bytes_out == 0 and stats.bytes_in >= 600 * KiB


def test_a_segment_the_store_cannot_open_falls_back_to_streaming(store):
    """As from another container: the client's /dev/shm is not the store's."""
    fp = fresh_fp("shm-elsewhere")
    ents = [entry(i, 100 * KiB, fp) for i in range(2)]
    root = tempfile.mkdtemp(dir=shm.SHM_DIR, prefix="llmesh-test-")
    try:
        with KVStoreClient(store.address, timeout_s=30, segment_bytes=MiB, shm_root=root) as c:
            got = []
            assert c.get_each(fp, [ents[0][0]], lambda *e: got.append(e)) == 0  # a miss, streamed
            assert c.shared is None
            assert c.put(fp, ents) == 2 and c.get(fp, [k for k, _, _ in ents]) == ents
        assert os.listdir(root) == []  # the refused segment was unlinked at once
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("call", ["get", "put"])
def test_a_store_killed_mid_call_is_a_miss_and_leaks_no_segment(tmp_path, call):
    s = StoreProcess(tmp_path, "--memory-bytes", "64MiB", "--no-memory-arena")
    fp = fresh_fp("shm-killed")
    ents = [entry(i, 256 * KiB, fp) for i in range(4)]
    # in_place=False: the get goes straight to GetShared (this store has no arena to read in place).
    c = KVStoreClient(s.address, timeout_s=30, segment_bytes=MiB, in_place=False)
    try:
        assert c.put(fp, ents[:2]) == 2  # the segment exists and the store maps it
        names = c.shared.pool.names
        s.proc.send_signal(signal.SIGSTOP)  # the next call hangs in the store ...
        outcome: list = []

        def run() -> None:
            try:
                if call == "get":
                    outcome.append(c.get(fp, [k for k, _, _ in ents]))
                else:
                    outcome.append(c.put(fp, ents[2:]))
            except Exception as e:  # noqa: BLE001
                outcome.append(e)

        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.3)
        assert t.is_alive()
        s.proc.kill()  # ... and the store dies under it
        s.proc.wait(10)
        t.join(10)
        assert not t.is_alive() and isinstance(outcome[0], KVStoreUnavailable)
        # The store may have been copying into that segment: it is unlinked, never reused.
        assert not any(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in names)
        with c.shared.pool.lease() as seg:
            assert seg.name not in names
    finally:
        c.close()
        if s.proc.poll() is None:
            s.proc.kill()
    assert not any(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in names)


# -- an engine over the shared path ----------------------------------------------------


CHUNK_TOKENS = 64


def _prompts() -> list[list[int]]:
    rng = random.Random(9)
    return [[rng.randrange(100, 40000) for _ in range(200)] for _ in range(2)]


def test_an_engine_loads_a_prefix_through_shared_memory_with_the_recompute_tokens(store):
    from llmesh import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = _prompts()
    kw = dict(kv_cache_memory=64 << 20, kv_chunk_tokens=CHUNK_TOKENS)

    def run(llm) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    reference = run(LLM(kv_cache_memory=64 << 20, enable_prefix_caching=False))
    writer = LLM(kv_store=store.address, **kw)
    assert run(writer) == reference
    writer.engine.flush_kv()
    writer.engine.close()
    before = KVStoreClient(store.address).stats()

    reader = LLM(kv_store=store.address, **kw)  # a cold GPU cache: another worker
    assert run(reader) == reference
    counters = reader.engine.runner.kv_tiers.counters
    full_chunks = (200 - 1) // CHUNK_TOKENS
    assert counters.store_loaded_blocks == 2 * full_chunks * CHUNK_TOKENS // 16
    assert counters.store_load_failures == 0
    client = reader.engine.kv_store
    assert client.shared is not None and client.shared.bytes_in >= counters.store_loaded_bytes
    after = KVStoreClient(store.address).stats()
    assert after.shared_bytes_out - before.shared_bytes_out >= counters.store_loaded_bytes
    names = client.shared.pool.names

    # Closed: every block back, no segment left.
    blocks = reader.engine.blocks
    reader.engine.close()
    assert not any(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in names)
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_blocks


def test_an_engine_whose_store_died_computes_and_frees_everything(tmp_path):
    from llmesh import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = _prompts()
    s = StoreProcess(tmp_path, "--memory-bytes", "64MiB")
    kw = dict(kv_cache_memory=64 << 20, kv_chunk_tokens=CHUNK_TOKENS)
    writer = LLM(kv_store=s.address, **kw)
    expected = [o.outputs[0].token_ids for o in writer.generate(prompts, params, use_tqdm=False)]
    writer.engine.flush_kv()
    writer.engine.close()
    reader = LLM(kv_store=s.address, **kw)
    s.proc.kill()
    s.proc.wait(10)
    got = [o.outputs[0].token_ids for o in reader.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    blocks = reader.engine.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_blocks
    names = reader.engine.kv_store.shared.pool.names if reader.engine.kv_store.shared else []
    reader.engine.close()
    assert not any(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in names)
