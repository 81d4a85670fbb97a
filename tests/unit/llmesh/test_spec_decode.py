"""Speculative decoding in the engine, on the real SmolLM2: it never changes what the model says.

Greedy tokens with n-gram drafts equal those without, with async scheduling on and off, in a
batch mixing drafting and plain sequences, through preemption, stop tokens and max_tokens;
random sampling with seeds and penalties runs; no KV block leaks.
"""

from __future__ import annotations

import pytest

from llmesh import LLM, SamplingParams

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
    "disable_by_batch_size": 0,  # speculate in every batch: these tests check mixed batches
}
TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow."
)
PROMPTS = [
    f"Repeat this text exactly: {TEXT}\nRepeated: {TEXT[:30]}",
    "Count from one to twenty: one, two, three, four,",
    "Write a sentence about the ocean.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def token_ids(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def spec_stats(llm: LLM):
    return llm.engine.mesh.workers["local"].planner.spec.stats


def assert_no_leaks(llm: LLM) -> None:
    blocks = llm.engine.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_blocks


@pytest.fixture(scope="module")
def reference(smollm2) -> list[list[int]]:
    return token_ids(LLM(smollm2, kv_cache_memory=64 << 20), PROMPTS)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_tokens_are_identical_with_ngram_drafts(smollm2, reference, async_scheduling: bool) -> None:
    llm = LLM(smollm2, kv_cache_memory=64 << 20, speculative_config=NGRAM, async_scheduling=async_scheduling)
    assert token_ids(llm, PROMPTS) == reference
    stats = spec_stats(llm)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0  # the copying prompt's drafts pay
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert_no_leaks(llm)


def test_verifications_chain_behind_the_one_in_flight(smollm2, reference) -> None:
    # One copying sequence: each plan verifies again behind the verification in flight (the
    # worker resolves the positions once that one is done), and max_tokens stays exact.
    llm = LLM(smollm2, kv_cache_memory=64 << 20, speculative_config=NGRAM)
    assert token_ids(llm, PROMPTS[:1]) == reference[:1]
    assert spec_stats(llm).num_chained > 0
    for n in (1, 2, 3, 6):
        out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        assert out[0].outputs[0].token_ids == reference[0][:n]
    assert_no_leaks(llm)


def test_chaining_switched_off_waits_for_each_result(smollm2, reference) -> None:
    # chain_verifications=False (the GPU A/B switch): the same tokens, no plan chained.
    llm = LLM(smollm2, kv_cache_memory=64 << 20, speculative_config=NGRAM, chain_verifications=False)
    assert token_ids(llm, PROMPTS[:1]) == reference[:1]
    assert spec_stats(llm).num_chained == 0 and spec_stats(llm).num_drafts > 0
    assert_no_leaks(llm)


def test_preemption_stop_tokens_and_max_tokens_with_drafts(smollm2, reference) -> None:
    # 8 blocks of 16 tokens hold the longest sequence (~100 tokens), not all three at once.
    llm = LLM(smollm2, num_kv_blocks=8, speculative_config=NGRAM, max_num_seqs=3)
    assert token_ids(llm, PROMPTS) == reference
    assert llm.engine.mesh.workers["local"].planner.num_preemptions > 0
    assert_no_leaks(llm)

    # A stop token that drafts would run past: the output ends right there.
    first = reference[0]
    stop = first[10]
    want = first[: first.index(stop) + 1]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop]))
    assert out[0].outputs[0].token_ids == want and out[0].outputs[0].finish_reason == "stop"
    for n in (1, 2, 7):  # max_tokens is exact even when a verification could gain 5 tokens
        out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        assert out[0].outputs[0].token_ids == first[:n]
    assert_no_leaks(llm)


def test_sampling_with_seeds_penalties_and_logprobs_alongside_drafts(smollm2) -> None:
    llm = LLM(smollm2, kv_cache_memory=64 << 20, speculative_config=NGRAM)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.2, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, logprobs=2, max_tokens=20, ignore_eos=True),  # never drafts
        SamplingParams(temperature=0.7, min_tokens=5, presence_penalty=0.5, max_tokens=20, ignore_eos=True),
    ]
    prompts = [PROMPTS[0]] * len(params)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [20] * 4
    assert all(lp is not None for lp in outs[2].outputs[0].logprobs)
    again = llm.generate(prompts[:1], params[:1], use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids  # a seed is a seed
    assert_no_leaks(llm)


def test_draft_model_early_exit_keeps_greedy_tokens(smollm2, reference) -> None:
    draft = {"method": "draft_model", "num_speculative_tokens": 3, "num_layers": 8,
             "disable_by_batch_size": 0}
    llm = LLM(smollm2, kv_cache_memory=64 << 20, speculative_config=draft)
    assert token_ids(llm, PROMPTS) == reference
    assert spec_stats(llm).num_drafts > 0
    assert_no_leaks(llm)


def test_a_draft_identical_to_the_target_is_always_accepted(tiny_models) -> None:
    """The draft's own paged KV cache follows the target's exactly (prefill, decode, verify)."""
    path = tiny_models["llama"]
    prompts = [[5, 6, 7, 8, 9] * 7, [11, 12, 13] * 3]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path).generate(prompts, params, use_tqdm=False)]
    everything = {"method": "draft_model", "num_speculative_tokens": 4, "num_layers": 2,
                  "disable_by_batch_size": 0}
    llm = LLM(path, speculative_config=everything)
    assert llm.engine.runner.draft.model_config.num_layers == llm.engine.runner.model_config.num_layers
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = spec_stats(llm)
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0
    assert_no_leaks(llm)
    with pytest.raises(ValueError, match="exceeds"):
        LLM(path, speculative_config={**everything, "num_layers": 99})


def test_constrained_and_drafting_sequences_share_a_batch(smollm2, reference) -> None:
    from llmesh import StructuredOutputs

    llm = LLM(smollm2, kv_cache_memory=64 << 20, speculative_config=NGRAM)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputs(regex=r"(yes|no)-[0-9]{3}")
    )
    outs = llm.generate([PROMPTS[0], PROMPTS[2]], [GREEDY, constrained], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == reference[0]  # drafts verified beside a grammar row
    import re

    assert re.fullmatch(r"(yes|no)-[0-9]{3}", outs[1].outputs[0].text)
    assert spec_stats(llm).num_drafts > 0
    assert_no_leaks(llm)
