"""Launching a plan before the previous one's sampled ids are read changes no token."""

import pytest

from llmesh import LLM, SamplingParams
from worker_svc.pipeline import StepPipeline


def pipeline_of(llm: LLM) -> StepPipeline:
    return llm.engine._slot.link._steps.stepper


PROMPTS = [[(7 * i + 3 * j) % 400 + 20 for j in range(n)] for i, n in enumerate([5, 40, 17, 90, 33, 64])]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
        # A sampler that reads the output so far: the step before is read first.
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=11),
    ],
    ids=["greedy", "logprobs", "penalty", "seeded"],
)
def test_launching_ahead_gives_the_tokens_of_one_step_at_a_time(tiny_model_dirs, params):
    path = tiny_model_dirs["qwen2"]
    kw = dict(num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=64)
    serial = LLM(path, async_scheduling=False, **kw)
    want = [o.outputs[0] for o in serial.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert pipeline_of(serial).num_launched_ahead == 0

    ahead = LLM(path, **kw)
    got = [o.outputs[0] for o in ahead.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if params.logprobs:  # batches differ between the runs: equal up to float rounding
        for g, w in zip(got, want, strict=True):
            for a, b in zip(g.logprobs, w.logprobs, strict=True):
                assert a.top_token_ids == b.top_token_ids and a.rank == b.rank
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    launched_ahead = pipeline_of(ahead).num_launched_ahead
    if params.repetition_penalty == 1.0 and params.seed is None:
        assert launched_ahead > 10
    blocks = ahead.engine.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_blocks
