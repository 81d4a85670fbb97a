"""An fp8 KV cache at tensor-parallel size 2 on the CPU (gloo rank processes on loopback).

Each rank measures its heads' K/V scales and the ranks take the largest, so a size-2 worker
names its blocks as a size-1 worker of the same model does: chunks one stores, the other
loads (every rank gets its heads back, as bytes), and the greedy tokens stay the same.
"""

from __future__ import annotations

import random

from llmesh import LLM, SamplingParams
from llmesh.kv_store import open_kv_store
from tests.helpers.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = dict(kv_cache_memory=1 << 22, max_num_seqs=4, kv_cache_dtype="fp8")


def _tokens(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]


def test_fp8_store_chunks_written_at_size_2_are_loaded_at_size_1(tmp_path) -> None:
    path = make_tiny_model(tmp_path / "llama", "llama", seed=3)
    rng = random.Random(3)
    batch = [[rng.randrange(1, 200) for _ in range(100)] for _ in range(2)]
    store = open_kv_store("memory:64000000")
    writer = LLM(path, tensor_parallel_size=2, kv_store=store, kv_chunk_tokens=32, **ENGINE)
    try:
        written = _tokens(writer, batch)
        writer.engine.flush_kv()
        fingerprint = writer.engine.runner.fingerprint
    finally:
        writer.engine.close()
    one = LLM(path, kv_store=store, kv_chunk_tokens=32, **ENGINE)
    try:
        assert one.engine.runner.fingerprint == fingerprint  # the same scales at both sizes
        assert _tokens(one, batch) == written
        assert one.engine.mesh.stats()["workers"]["local"]["store_hit_tokens"] == 2 * 96
    finally:
        one.engine.close()
