"""Prompt logprobs and pooling at tensor-parallel size 2 on the CPU (gloo): the prompt rows join
the sampled rows' vocabulary gather on every rank, and pooling reads rank 0's hidden states, so
both must equal size 1's (fp32), beside greedy requests in the same batches."""

from __future__ import annotations

import pytest

from llmesh import LLM, SamplingParams
from llmesh.pooling import PoolingParams
from tests.helpers.tiny_models import make_tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 60))]
ENGINE = dict(
    kv_cache_memory=1 << 22, max_num_seqs=4, max_num_batched_tokens=32, long_prefill_token_threshold=16
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    # A vocabulary that 2 does not divide: the gathered logits are padded, and trimmed.
    return make_tiny_model(tmp_path_factory.mktemp("tp-prompt") / "qwen2", "qwen2", seed=4, vocab_size=509)


def run(path: str, size: int):
    llm = LLM(path, tensor_parallel_size=size, **ENGINE)
    try:
        params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3),
                  SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]  # fmt: skip
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        pooled = llm.encode(PROMPTS, PoolingParams(pooling_type="mean"), use_tqdm=False)
        return outs, [p.outputs.data for p in pooled]
    finally:
        llm.engine.close()


def test_size_2_prompt_logprobs_and_pooling_equal_size_1(model):
    (outs2, pooled2), (outs1, pooled1) = run(model, 2), run(model, 1)
    assert [o.outputs[0].token_ids for o in outs2] == [o.outputs[0].token_ids for o in outs1]
    a, b = outs2[0].prompt_logprobs, outs1[0].prompt_logprobs
    assert a[0] is None and b[0] is None and len(a) == len(b) == len(PROMPTS[0])
    for pa, pb in zip(a[1:], b[1:], strict=True):
        assert list(pa) == list(pb)  # the same tokens, in the same order
        assert [v.logprob for v in pa.values()] == pytest.approx([v.logprob for v in pb.values()], abs=1e-4)
        assert all(t < 509 for t in pa)  # no padded column
    for x, y in zip(pooled2, pooled1, strict=True):
        assert x == pytest.approx(y, abs=1e-4)
