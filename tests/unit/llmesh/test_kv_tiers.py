"""KV tiers below the GPU cache, in process: the worker's host tier and a KV store.

Greedy tokens with a block loaded from a tier equal those computed from scratch,
and loads really replace computation (the tiers' counters say how many tokens).
"""

import random

from llmesh import LLM, SamplingParams

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
