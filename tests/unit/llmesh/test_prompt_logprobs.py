"""Prompt logprobs offline (vLLM's SamplingParams.prompt_logprobs) against HF transformers' log-softmax
(fp32, CPU): whole prompts, chunked prefills, and beside a cached prefix that must not be used."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmesh import LLM, SamplingParams
from services.sampling_params import SamplingParamsError

TEXTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin. Both cities are",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
]
K = 3


@pytest.fixture(scope="module")
def reference(smollm2):
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32, attn_implementation="eager")
    prompts = [tok.encode(t) for t in TEXTS]
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0].float()
            refs.append(torch.log_softmax(logits, dim=-1))  # row p predicts token p + 1
    return prompts, refs


def check(out, prompt: list[int], ref: torch.Tensor) -> None:
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for p in range(1, len(prompt)):
        d = plp[p]
        tok = prompt[p]
        row = ref[p - 1]
        assert list(d)[0] == tok  # the prompt token itself, first
        assert d[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert d[tok].rank == int((row > row[tok]).sum()) + 1
        top = torch.topk(row, K)
        for rank, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
            assert d[tid].logprob == pytest.approx(lp, abs=1e-4)
            if tid != tok:
                assert d[tid].rank == rank
        assert len(d) in (K, K + 1)


def test_prompt_logprobs_match_transformers_whole_and_chunked(smollm2, reference):
    prompts, refs = reference
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)
    llm = LLM(smollm2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, prompt, ref in zip(outs, prompts, refs, strict=True):
        check(out, prompt, ref)
        assert out.outputs[0].token_ids  # it still generates
    # Chunks of 5 tokens: each chunk's rows come back in its own step.
    small = LLM(smollm2, max_num_batched_tokens=16, long_prefill_token_threshold=5)
    outs = small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, prompt, ref in zip(outs, prompts, refs, strict=True):
        check(out, prompt, ref)
    no_lp = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert no_lp[0].prompt_logprobs is None


def test_prompt_logprobs_ignore_a_cached_prefix(smollm2, reference):
    prompts, refs = reference
    llm = LLM(smollm2)
    # Warm the prefix cache with the same prompt: a plain request would hit every full block.
    warm = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1), use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert warm[0].num_cached_tokens == 0 and again[0].num_cached_tokens > 0
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=K, n=2)
    out = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
    check(out, prompts[0], refs[0])
    assert len(out.outputs) == 2  # choice 1 wants none and may use the cache
    one = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert one[0].num_cached_tokens == 0  # computed, not taken from the cache


def test_prompt_logprobs_validated():
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
