"""`cache_salt` in the offline API (vLLM's prompt dict key): salted prompts share cached blocks
only with their own salt, in the GPU cache and through a KV store; greedy output never changes."""

import random

import pytest

from llmesh import LLM, SamplingParams
from llmesh.kv_store import open_kv_store

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def prompt(seed: int = 1, length: int = 70) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length)]


def ask(llm: LLM, ids: list[int], salt: str | None) -> tuple[list[int], int]:
    """Greedy tokens and prefix-cache hit (tokens) of one prompt under `salt` (None: no key)."""
    item: dict = {"prompt_token_ids": ids}
    if salt is not None:
        item["cache_salt"] = salt
    out = llm.generate([item], GREEDY, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_gpu_cache_is_shared_only_within_a_salt(tiny_models):
    llm = LLM(tiny_models["llama"])
    ids = prompt()
    first, hit = ask(llm, ids, "tenant-a")
    assert hit == 0
    assert ask(llm, ids, "tenant-b") == (first, 0)  # another tenant: no hit, same tokens
    assert ask(llm, ids, None) == (first, 0)  # unsalted is a tenant of its own
    assert ask(llm, ids, "") == (first, 64)  # "" is no salt: it shares with unsalted requests
    assert ask(llm, ids, "tenant-a") == (first, 64)  # 4 full blocks of 16
    blocks = llm.engine.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_blocks


def test_kv_store_entries_are_found_only_under_their_salt(tiny_models):
    path = tiny_models["llama"]
    store = open_kv_store("memory:64000000")
    ids = prompt(2, 100)
    writer = LLM(path, kv_store=store, kv_chunk_tokens=32)
    reference, _ = ask(writer, ids, "tenant-a")
    writer.engine.flush_kv()

    reader = LLM(path, kv_store=store, kv_chunk_tokens=32)  # a cold GPU cache
    assert ask(reader, ids, "tenant-b") == (reference, 0)
    assert reader.engine.mesh.stats()["workers"]["local"]["store_hit_tokens"] == 0
    assert ask(reader, ids, "tenant-a")[0] == reference
    assert reader.engine.mesh.stats()["workers"]["local"]["store_hit_tokens"] == 96


@pytest.mark.parametrize("salt", ["x" * 257, 7])
def test_bad_salts_are_refused_before_anything_runs(tiny_models, salt):
    llm = LLM(tiny_models["llama"])
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": [5, 6, 7], "cache_salt": salt}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
