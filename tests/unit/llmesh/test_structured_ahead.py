"""Structured outputs one step behind: a constrained row is launched ahead like any other (its
forward queued while the step before is in flight, its mask filled once that step's tokens are
accepted), and samples exactly what the path without launch-ahead samples (SmolLM2, fp32, CPU)."""

from __future__ import annotations

import re

from benchmarks.structured import mask_in_step
from llmesh import LLM, SamplingParams, StructuredOutputs

REGEX = r"[a-z ]{5,30}\."
CHOICES = ["yes", "no", "maybe later"]


def test_constrained_rows_launch_ahead_and_sample_the_same(smollm2: str) -> None:
    greedy = dict(max_tokens=24, temperature=0)
    params = [
        SamplingParams(**greedy, structured_outputs=StructuredOutputs(regex=REGEX)),
        SamplingParams(**greedy),  # a free row beside them
        SamplingParams(**greedy, structured_outputs=StructuredOutputs(choice=CHOICES)),
        SamplingParams(max_tokens=24, temperature=1.0, structured_outputs=StructuredOutputs(regex=REGEX)),
    ]
    prompts = ["The weather today is", "My favourite animal is", "Answer yes or no:", "Say something:"]
    with LLM(smollm2, max_model_len=256, num_kv_blocks=128, max_num_seqs=4, seed=3) as llm:
        pipeline = llm.engine._link._steps.stepper
        before = pipeline.num_launched_ahead
        ahead = llm.generate(prompts[:3], params[:3], use_tqdm=False)
        assert pipeline.num_launched_ahead - before >= 5  # constrained rows no longer hold steps back
        with mask_in_step(llm):
            behind = llm.generate(prompts[:3], params[:3], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in ahead] == [o.outputs[0].token_ids for o in behind]
        texts = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert re.fullmatch(REGEX, texts[0]) and re.fullmatch(REGEX, texts[3])
    assert texts[2] in CHOICES
