"""KV tiers below the GPU cache, in process: the worker's host tier and a KV store.

Greedy tokens with a block loaded from a tier equal those computed from scratch,
and loads really replace computation (the tiers' counters say how many tokens).
"""

import dataclasses
import random

import pytest

from llmesh import LLM, SamplingParams
from llmesh.kv_store import open_kv_store

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompts(seed: int, n: int, length: int, vocab: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


def tier_stats(llm: LLM) -> dict:
    return llm.engine.mesh.stats()["workers"]["local"]


def generate(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]


def test_blocks_evicted_from_the_gpu_come_back_from_the_host_tier(tiny_models):
    path = tiny_models["llama"]
    first = prompts(1, 2, 100)
    flood = prompts(2, 6, 100)
    reference = generate(LLM(path, num_kv_blocks=24, enable_prefix_caching=False), first)

    llm = LLM(path, num_kv_blocks=24, kv_offload_bytes=8 << 20)
    assert generate(llm, first) == reference
    generate(llm, flood)  # evicts the first prompts' blocks from the 24-block GPU cache
    assert generate(llm, first) == reference
    stats = tier_stats(llm)
    assert stats["saved_blocks"] > 0
    assert stats["host_hit_tokens"] >= 2 * 96  # every full block of both prompts but the last token's
    blocks = llm.engine.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_blocks


def test_a_prefix_computed_by_one_engine_is_loaded_by_another_from_the_store(tiny_models):
    path = tiny_models["llama"]
    batch = prompts(3, 3, 150)
    reference = generate(LLM(path, enable_prefix_caching=False), batch)
    store = open_kv_store("memory:64000000")

    first = LLM(path, kv_store=store, kv_chunk_tokens=32)
    assert generate(first, batch) == reference
    first.engine.flush_kv()
    assert tier_stats(first)["stored_chunks"] >= 3 * 4  # 4 whole 32-token chunks per prompt

    second = LLM(path, kv_store=store, kv_chunk_tokens=32)  # another worker, same model: cold GPU cache
    assert generate(second, batch) == reference
    stats = tier_stats(second)
    assert stats["store_hit_tokens"] == 3 * 128
    assert stats["failed_loads"] == 0
    assert second.engine.runner.kv_tiers.counters.store_loaded_blocks == 3 * 8


class _FlakyStore:
    """The real in-process store, but its entries come back corrupt, missing or not at all."""

    def __init__(self, store, mode: str) -> None:
        self.store, self.mode = store, mode

    def lookup(self, fingerprint, keys):
        return self.store.lookup(fingerprint, keys)

    def put(self, fingerprint, entries):
        return self.store.put(fingerprint, entries)

    def get(self, fingerprint, keys):
        if self.mode == "down":
            raise ConnectionError("the store went away")
        entries = self.store.get(fingerprint, keys)
        if self.mode == "missing":
            return entries[:1]
        key, header, payload = entries[0]
        wrong = dataclasses.replace(header, shape=(1, *header.shape))
        return [(key, wrong, payload), *entries[1:]]


@pytest.mark.parametrize("mode", ["down", "missing", "wrong-shape"])
def test_store_loads_that_fail_are_computed_instead(tiny_models, mode):
    path = tiny_models["llama"]
    batch = prompts(4, 2, 150)
    reference = generate(LLM(path, enable_prefix_caching=False), batch)
    store = open_kv_store("memory:64000000")
    first = LLM(path, kv_store=store, kv_chunk_tokens=32)
    generate(first, batch)
    first.engine.flush_kv()

    second = LLM(path, kv_store=_FlakyStore(store, mode), kv_chunk_tokens=32)
    assert generate(second, batch) == reference
    assert tier_stats(second)["failed_loads"] == 2
    blocks = second.engine.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_blocks
