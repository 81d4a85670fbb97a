"""A worker loading prefixes from a real `llmesh kvstore` process over its bulk path (issue 32).

`kv_store_transfer="bulk"` makes the store on loopback stand in for one on another host: no shared
memory, payloads received over the bulk TCP path straight into the worker's staging, verified
(MAC) where they land, then scattered into the cache. SmolLM2's greedy tokens equal the recompute
path's; an entry altered in the store (a valid checksum, only the MAC can tell) is refused and its
chunk computed instead, with the same tokens.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvstore_svc.client import KVStoreClient
from llmesh import LLM, SamplingParams
from scheduler_svc.prefix_hash import extend_block_keys
from services.kv_entry import checksum
from services.step import store_fingerprint
from tests.helpers.tiny_models import smollm2_path
from tests.integration.test_kvstore import StoreProcess

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CHUNK_TOKENS = 32
PROMPT_TOKENS = 150  # 4 whole chunks each


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


def generate(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]


def bulk_engine(smollm2: str, address: str) -> LLM:
    return LLM(
        smollm2,
        kv_store=address,
        kv_store_transfer="bulk",
        kv_chunk_tokens=CHUNK_TOKENS,
        kv_cache_memory=32 << 20,
    )


@pytest.fixture(scope="module")
def smollm2() -> str:
    return smollm2_path()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = StoreProcess(tmp_path_factory.mktemp("kv-bulk-worker"), "--memory-bytes", "256MiB")
    yield s
    assert s.stop() == 0, s.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def written(smollm2, store):
    """Prompts, their recompute tokens, and the store holding their chunks (put over gRPC): the
    writer finds nothing in the store, so it computes every prompt (the recompute path)."""
    batch = prompts(5, 3)
    writer = bulk_engine(smollm2, store.address)
    reference = generate(writer, batch)
    assert writer.engine.runner.kv_tiers.counters.store_loaded_blocks == 0
    writer.engine.flush_kv()
    info = writer.engine.info
    writer.engine.close()
    return batch, reference, info


def test_a_worker_loads_over_the_bulk_path_and_gives_the_recompute_tokens(smollm2, store, written):
    batch, reference, _ = written
    before = _bulk_bytes(store.address)
    reader = bulk_engine(smollm2, store.address)  # a cold GPU cache, as on another host
    try:
        assert generate(reader, batch) == reference
        c = reader.engine.runner.kv_tiers.counters
        assert c.store_bulk_loads == 3  # every prompt's load went over the bulk path
        assert c.store_loaded_blocks == 3 * (4 * CHUNK_TOKENS // 16)
        assert c.store_verify_failures == 0
        assert _bulk_bytes(store.address) - before >= c.store_loaded_bytes
    finally:
        reader.engine.close()


def test_an_altered_entry_over_the_bulk_path_is_refused_and_computed(smollm2, store, written):
    batch, reference, info = written
    chunk = CHUNK_TOKENS // info.block_size
    fp = store_fingerprint(info.fingerprint, chunk)
    target = extend_block_keys([], batch[0], info.block_size, info.fingerprint)[chunk - 1 :: chunk][1]
    with KVStoreClient(store.address, shared_memory="off", bulk="off") as client:
        [(key, header, payload)] = client.get(fp, [target])
        changed = bytearray(payload)
        changed[len(changed) // 3] ^= 0x04  # one bit; a valid checksum: only the MAC can tell
        assert client.delete(fp, [key]) == 1
        client.put(fp, [(key, dataclasses.replace(header, checksum=checksum(changed)), bytes(changed))])
    reader = bulk_engine(smollm2, store.address)
    try:
        assert generate(reader, batch) == reference  # chunk 1 on of prompt 0: computed instead
        c = reader.engine.runner.kv_tiers.counters
        assert c.store_verify_failures == 1
        assert c.store_bulk_loads == 3
        # Prompt 0 kept its verified first chunk; the others loaded all four.
        assert c.store_loaded_blocks == (1 + 4 + 4) * chunk
        stats = reader.engine.mesh.stats()["workers"]["local"]
        assert stats["failed_loads"] == 1
        assert stats["kv_verify_failures"] == 1
    finally:
        reader.engine.close()


def _bulk_bytes(address: str) -> int:
    with KVStoreClient(address, shared_memory="off", bulk="off") as client:
        return client.stats().bulk_bytes_out
