"""Prompt logprobs on the wire: SamplingParams.prompt_logprobs, StepResult chunks, whole prompts."""

import pytest

from llmesh.v1 import generation_pb2
from services.convert import (
    prompt_logprobs_from_proto,
    prompt_logprobs_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
    step_result_from_proto,
    step_result_to_proto,
)
from services.sampling_params import SamplingParams, SamplingParamsError
from services.step import PromptLogprobs, StepResult, TokenLogprobs


def test_sampling_params_round_trip_and_range():
    for k in (None, 0, 5):
        assert (
            sampling_params_from_proto(
                sampling_params_to_proto(SamplingParams(prompt_logprobs=k))
            ).prompt_logprobs
            == k
        )
    msg = generation_pb2.SamplingParams(prompt_logprobs=21)
    with pytest.raises(SamplingParamsError, match="^prompt_logprobs: "):
        sampling_params_from_proto(msg)


def test_pooling_round_trip_and_unknown_values():
    for kind in (None, "default", "last", "mean", "cls"):
        assert (
            sampling_params_from_proto(sampling_params_to_proto(SamplingParams(pooling=kind))).pooling == kind
        )
    with pytest.raises(SamplingParamsError, match="^pooling: "):
        sampling_params_from_proto(generation_pb2.SamplingParams(pooling=99))
    with pytest.raises(SamplingParamsError, match="^pooling: "):
        sampling_params_from_proto(
            generation_pb2.SamplingParams(pooling=generation_pb2.POOLING_MEAN, logprobs=1)
        )


def test_step_result_chunks_and_whole_prompt_round_trip():
    entries = [TokenLogprobs(7, -1.5, 2, [3, 7], [-0.5, -1.5]), TokenLogprobs(9, -0.25, 1, [], [])]
    result = StepResult(step_id=4, prompt_logprobs=[PromptLogprobs("s", 3, entries)])
    back = step_result_from_proto(step_result_to_proto(result))
    assert back.prompt_logprobs == result.prompt_logprobs
    whole = [None, *entries]
    assert prompt_logprobs_from_proto(prompt_logprobs_to_proto(whole), [5, 7, 9]) == whole
