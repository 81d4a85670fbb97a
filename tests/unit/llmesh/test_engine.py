"""The in-process engine against Hugging Face transformers: greedy output token for token (fp32, CPU)."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmesh import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his three daughters. Every morning he walked into the forest",
    "Translate to French: I like apples.",
    "The three primary colours are red, yellow and",
    "In 1492,",
    "Hello",
]


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    eos = None if ignore_eos else model.generation_config.eos_token_id
    outs = []
    with torch.inference_mode():
        for ids in prompts:  # one at a time: no padding effects on the reference side
            kw = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            if ignore_eos:
                kw.update(min_new_tokens=max_new_tokens, eos_token_id=None)
            gen = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), **kw
            )
            new = gen[0, len(ids) :].tolist()
            if eos is not None:
                eos_ids = eos if isinstance(eos, list) else [eos]
                for i, t in enumerate(new):
                    if t in eos_ids:
                        new = new[: i + 1]
                        break
            outs.append(new)
    return outs


def assert_no_leak(llm: LLM) -> None:
    blocks = llm.engine.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_blocks
    assert not llm.engine.has_unfinished()


@pytest.fixture(scope="module")
def smol_reference(smollm2):
    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = [tok.encode(p) for p in PROMPTS]
    return prompts, hf_greedy(smollm2, prompts, 24, ignore_eos=False)


def test_smollm2_batched_greedy_matches_transformers(smollm2, smol_reference):
    prompts, ref = smol_reference
    llm = LLM(smollm2)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24)
    )
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert outs[0].outputs[0].text.strip().startswith("Paris")
    assert_no_leak(llm)


def test_smollm2_under_kv_pressure_and_small_chunks(smollm2, smol_reference):
    prompts, ref = smol_reference
    # ~10 blocks of 16 tokens for 10 sequences of up to ~60 tokens: preemption must happen.
    llm = LLM(smollm2, num_kv_blocks=12, max_num_batched_tokens=24, long_prefill_token_threshold=8)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24)
    )
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.engine.planner.num_preemptions > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_random_models_match_transformers(arch, tiny_models):
    path = tiny_models[arch]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 17, 33, 64, 100)]
    ref = hf_greedy(path, prompts, 20, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = LLM(path, max_num_batched_tokens=64, num_kv_blocks=64)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    assert_no_leak(llm)
    # Same again with a cache so small that sequences are preempted and recomputed.
    llm = LLM(path, num_kv_blocks=14, max_num_batched_tokens=32, long_prefill_token_threshold=16)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    assert llm.engine.planner.num_preemptions > 0
    assert_no_leak(llm)


def test_prefix_cache_hits_on_shared_prefix(tiny_models):
    path = tiny_models["llama"]
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(80)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (3, 9, 20)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cold = LLM(path, enable_prefix_caching=False)
    ref = [o.outputs[0].token_ids for o in cold.generate(prompts, params, use_tqdm=False)]
    llm = LLM(path)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == ref
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 80 for o in rest)  # 5 full blocks of 16
    assert llm.engine.blocks.stats.hits == 160
    assert_no_leak(llm)


def test_n_samples_share_the_prompt_blocks(tiny_models):
    llm = LLM(tiny_models["llama"])
    prompt = list(range(10, 74))  # 4 full blocks
    out = llm.generate(
        [prompt], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs) == 3
    # All three children hit (or share in-step) the 4 prompt blocks: 3 of them reported as cached for 2 kids.
    assert llm.engine.blocks.stats.hits >= 2 * 48
    again = llm.generate(
        [prompt], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_no_leak(llm)


def test_outputs_in_input_order_with_per_prompt_params_and_logprobs(tiny_models):
    llm = LLM(tiny_models["qwen2"])
    prompts = [[5, 6, 7], list(range(20, 90)), [9]]
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, logprobs=2) for k in (3, 1, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 1, 5]
    assert [o.prompt_token_ids for o in outs] == prompts
    for o in outs:
        lps = o.outputs[0].logprobs
        assert len(lps) == len(o.outputs[0].token_ids)
        assert all(lp.rank == 1 and len(lp.top_token_ids) == 2 for lp in lps)  # greedy = top-1
    assert_no_leak(llm)


def test_stop_strings_and_chat(smollm2):
    llm = LLM(smollm2)
    out = llm.generate(
        "1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=30, stop=[" 7"]), use_tqdm=False
    )[0]
    assert out.outputs[0].text == " 5, 6,"
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == " 7"
    reply = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
        use_tqdm=False,
    )[0]
    assert "Paris" in reply.outputs[0].text
    assert_no_leak(llm)


def test_outputs_taken_in_batches_of_tokens_equal_token_by_token(smollm2):
    # Offline, a request's tokens arrive 16 at a time after its first (nothing streams): the same
    # tokens, text, logprobs and stop as one token at a time, though a stop string is seen late.
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop=[" 7"], logprobs=1),
        SamplingParams(temperature=0.8, seed=11, max_tokens=20, n=2),
        # 1 + 16 + 7 tokens at interval 16: a last batch cut short by max_tokens (40 took 1.7x as long)
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    ]
    prompts = ["1, 2, 3, 4,", "Once upon a time", "The capital of France is"]
    outs = {}
    for interval in (1, 16):
        llm = LLM(smollm2, stream_interval=interval)
        got = llm.generate(prompts, params, use_tqdm=False)
        outs[interval] = [
            [(c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
            for o in got
        ]
        assert_no_leak(llm)
        llm.engine.close()
    assert outs[1] == outs[16]
    assert outs[16][0][0][:1] == (" 5, 6,",)


def test_bad_input_raises_clearly(tiny_models):
    llm = LLM(tiny_models["llama"])
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 2, 100000]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 5000], use_tqdm=False)
    with pytest.raises(TypeError, match="unknown engine settings"):
        LLM(tiny_models["llama"], not_a_setting=1)
    assert_no_leak(llm)


def test_async_scheduling_on_and_off_give_the_same_greedy_tokens():
    """Two plans in flight (the default) or one: the same tokens, EOS mid-flight included."""
    # Four prompts for three seats (one waits for a seat): three end on EOS at different steps
    # (after 13, 26 and 30 tokens), one runs to max_tokens. All ten prompts took 3x as long.
    prompts = [PROMPTS[1], PROMPTS[6], PROMPTS[0], PROMPTS[2]]
    sp = SamplingParams(temperature=0, max_tokens=32)
    outs = {}
    for on in (True, False):
        llm = LLM(async_scheduling=on, kv_cache_memory=64 << 20, max_num_seqs=3)
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert_no_leak(llm)
        llm.engine.close()
    assert outs[True] == outs[False]
    assert sum(len(t) < 32 for t in outs[True]) >= 2  # stopped on EOS while a plan was in flight


def test_text_decoded_once_equals_incremental_detokenization():
    """Without stop strings the offline text is decoded once at the end: the same text."""
    from services.detokenizer import IncrementalDetokenizer

    llm = LLM(kv_cache_memory=64 << 20)
    prompts = ["Write a poem in French about the sea:", "日本語で自己紹介してください。", "List some emojis:"]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=48), use_tqdm=False)
    for o in outs:
        incremental = IncrementalDetokenizer(llm.tokenizer)
        incremental.push(o.outputs[0].token_ids)
        incremental.flush()
        assert o.outputs[0].text == incremental.text
    llm.engine.close()


def test_detokenize_false_gives_the_same_tokens_and_no_text():
    llm = LLM(kv_cache_memory=64 << 20)
    prompts = PROMPTS[:3]
    with_text = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    ids_only = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, detokenize=False), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in ids_only] == [o.outputs[0].token_ids for o in with_text]
    assert all(o.outputs[0].text == "" for o in ids_only) and all(o.outputs[0].text for o in with_text)
    llm.engine.close()


def test_n_with_the_largest_seed_fans_out_like_separate_requests(tiny_models):
    """Seeds of the n choices are seed + i wrapped into int64 (services/choices.py), as at the
    scheduler and the gateway: n=2 from 2**63-1 is seeds 2**63-1 and -2**63, never an error."""
    llm = LLM(tiny_models["llama"])
    prompt = list(range(10, 30))
    kw = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    fanned = llm.generate([prompt], SamplingParams(n=2, seed=2**63 - 1, **kw), use_tqdm=False)[0]
    apart = llm.generate(
        [prompt, prompt],
        [SamplingParams(seed=2**63 - 1, **kw), SamplingParams(seed=-(2**63), **kw)],
        use_tqdm=False,
    )
    assert [c.token_ids for c in fanned.outputs] == [o.outputs[0].token_ids for o in apart]
    assert_no_leak(llm)
