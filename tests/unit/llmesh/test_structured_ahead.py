"""Structured outputs one step behind: a constrained row is launched ahead like any other (its
forward queued while the step before is in flight, its mask filled once that step's tokens are
accepted, on the fill thread while that step's result is handed over), and samples exactly what
the path without launch-ahead samples (SmolLM2, fp32, CPU)."""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from typing import Any

from benchmarks.structured import mask_in_step
from llmesh import LLM, SamplingParams, StructuredOutputs

REGEX = r"[a-z ]{5,30}\."
CHOICES = ["yes", "no", "maybe later"]


@contextlib.contextmanager
def order_of_events(runner: Any) -> Iterator[list[tuple[str, int]]]:
    """Records (what, id of the step) as the runner fills masks, hands over a step's result and
    queues a deferred sampling, and (("fill thread", 0)) where a fill ran off the caller's thread."""
    events: list[tuple[str, int]] = []
    finish, fill_masks, sample_deferred = runner.finish, runner._fill_masks, runner.sample_deferred
    fill = runner.structured._fill
    caller = threading.current_thread()

    def on_finish(launched: Any) -> Any:
        result = finish(launched)
        events.append(("result", id(launched)))
        return result

    def on_fill_masks(launched: Any) -> None:
        events.append(("fill", id(launched)))
        fill_masks(launched)

    def on_sample(launched: Any) -> None:
        if launched.deferred is not None:
            events.append(("sample", id(launched)))
        sample_deferred(launched)

    def on_fill(*a: Any) -> None:
        if threading.current_thread() is not caller and threading.current_thread().name.startswith(
            "grammar-fill"
        ):
            events.append(("fill thread", 0))
        fill(*a)

    runner.finish, runner._fill_masks, runner.sample_deferred = on_finish, on_fill_masks, on_sample
    runner.structured._fill = on_fill
    try:
        yield events
    finally:
        del runner.finish, runner._fill_masks, runner.sample_deferred, runner.structured._fill


def handed_over_before_sampling(events: list[tuple[str, int]]) -> tuple[int, int]:
    """(deferred samplings, those queued after the result of the step before them had been handed
    over, their masks filled meanwhile); each is filled before it is queued."""
    fills = handed_over = 0
    for i, (what, step) in enumerate(events):
        if what != "fill":
            continue
        queued = events.index(("sample", step), i)  # ValueError: never queued, or before its fill
        fills += 1
        handed_over += any(w == "result" for w, _ in events[i + 1 : queued])
    return fills, handed_over


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
        with order_of_events(llm.engine.runner) as events:
            ahead = llm.generate(prompts[:3], params[:3], use_tqdm=False)
        assert pipeline.num_launched_ahead - before >= 5  # constrained rows no longer hold steps back
        # The step thread hands a step's result over before it queues the next step's sampling,
        # whose masks the fill thread fills meanwhile. (How many samplings are deferred depends
        # on timing: the constrained rows end after a few tokens.)
        fills, handed_over = handed_over_before_sampling(events)
        assert fills >= 2 and handed_over == fills
        assert ("fill thread", 0) in events
        with mask_in_step(llm):
            behind = llm.generate(prompts[:3], params[:3], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in ahead] == [o.outputs[0].token_ids for o in behind]
        texts = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert re.fullmatch(REGEX, texts[0]) and re.fullmatch(REGEX, texts[3])
    assert texts[2] in CHOICES
