"""Request -> SamplingParams checks, and the error mapping they rely on."""

from __future__ import annotations

import grpc
import pytest

from gateway.errors import APIError, _loc_to_param, from_grpc
from gateway.params import (
    Limits,
    check_batch,
    check_prompt_chars,
    check_prompt_ids,
    fit_to_prompt,
    resolve_max_tokens,
    sampling_params,
)
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.limits import RequestLimits

CAPS = RequestLimits(max_n=4, max_logprobs=5, max_stop=2, max_stop_chars=8, max_stop_token_ids=8)
LIMITS = Limits(
    caps=CAPS, max_prompts=3, max_seqs_per_request=6, max_model_len=100, vocab_size=1000, prompt_chars=500
)


def params(**body):
    req = CompletionRequest(prompt="x", **body)
    return sampling_params(req, LIMITS, max_tokens=10, logprobs=req.logprobs, logprobs_param="logprobs")


def rejects(param: str, **body) -> APIError:
    with pytest.raises(APIError) as e:
        params(**body)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert e.value.message.startswith(f"{param}: ")
    return e.value


def test_defaults_follow_openai():
    sp = params()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.stop) == (1, 1.0, 1.0, 0, 10, [])
    sp = params(stop="end", top_k=-1, seed=3, logprobs=2, stop_token_ids=[5])
    assert (
        sp.stop == ["end"]
        and sp.top_k == 0
        and sp.seed == 3
        and sp.logprobs == 2
        and sp.stop_token_ids == [5]
    )


def test_caps_and_vocab():
    rejects("n", n=5)
    rejects("logprobs", logprobs=6)
    rejects("stop", stop=["a", "b", "c"])
    rejects("stop", stop=["123456789"])
    rejects("stop", stop=["ok", ""])
    rejects("stop_token_ids", stop_token_ids=[1000])
    rejects("stop_token_ids", stop_token_ids=[-1])
    assert params(stop_token_ids=list(range(8))).stop_token_ids == list(range(8))  # at the cap
    err = rejects("stop_token_ids", stop_token_ids=list(range(9)))
    assert "at most 8" in err.message
    rejects("logit_bias", logit_bias={"1": 1.0})
    rejects("min_tokens", min_tokens=11)


def test_chat_names_top_logprobs():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=6)
    with pytest.raises(APIError) as e:
        sampling_params(req, LIMITS, max_tokens=None, logprobs=6, logprobs_param="top_logprobs")
    assert e.value.param == "top_logprobs" and e.value.message.startswith("top_logprobs: ")


def test_huge_stop_token_ids_are_refused_by_count():
    # A body may carry millions of ids: the count is refused before any per-id check.
    err = rejects("stop_token_ids", stop_token_ids=[-1] * 1_000_000)
    assert "at most 8 ids" in err.message


def test_batch_caps():
    check_batch(3, 2, LIMITS)  # 6 sequences: at both caps
    with pytest.raises(APIError) as e:
        check_batch(4, 1, LIMITS)
    assert e.value.param == "prompt" and "at most 3 prompts" in e.value.message
    with pytest.raises(APIError) as e:
        check_batch(1, 5, LIMITS)
    assert e.value.param == "n" and "<= 4" in e.value.message
    with pytest.raises(APIError) as e:
        check_batch(2, 4, LIMITS)  # 8 sequences > 6
    assert e.value.param == "n" and "8 sequences" in e.value.message and e.value.status == 400


def test_prompt_length_refused_before_tokenizing():
    check_prompt_chars("prompt", 500, LIMITS)
    with pytest.raises(APIError) as e:
        check_prompt_chars("prompt[2]", 501, LIMITS)
    assert (e.value.param, e.value.code) == ("prompt[2]", "context_length_exceeded")
    check_prompt_ids("prompt", [999] * 99, LIMITS)
    with pytest.raises(APIError) as e:
        check_prompt_ids("prompt", [10**9] * 100, LIMITS)  # too long: said before the vocabulary
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as e:
        check_prompt_ids("prompt", [1, 1000], LIMITS)
    assert e.value.code == "invalid_value" and "[1000]" in e.value.message


def test_fit_to_prompt():
    base = params(min_tokens=5)
    assert base.max_tokens == 10
    req = CompletionRequest(prompt="x", max_tokens=None, min_tokens=5)
    base = sampling_params(req, LIMITS, max_tokens=None, logprobs=None, logprobs_param="logprobs")
    assert base.max_tokens is None
    assert fit_to_prompt(base, 40, None, LIMITS, "max_tokens", "prompt").max_tokens == 60
    assert fit_to_prompt(base, 40, 7, LIMITS, "max_tokens", "prompt").max_tokens == 7
    with pytest.raises(APIError) as e:
        fit_to_prompt(base, 97, None, LIMITS, "max_tokens", "prompt")  # 3 tokens of room < min_tokens
    assert e.value.param == "min_tokens"
    with pytest.raises(APIError) as e:
        fit_to_prompt(base, 100, None, LIMITS, "max_tokens", "messages")
    assert (e.value.param, e.value.code) == ("messages", "context_length_exceeded")


def test_context_length():
    assert resolve_max_tokens(10, None, LIMITS, "max_tokens", "prompt") == 90
    assert resolve_max_tokens(10, 90, LIMITS, "max_tokens", "prompt") == 90
    with pytest.raises(APIError) as e:
        resolve_max_tokens(10, 91, LIMITS, "max_completion_tokens", "messages")
    assert e.value.param == "max_completion_tokens" and e.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as e:
        resolve_max_tokens(100, 1, LIMITS, "max_tokens", "messages")
    assert e.value.param == "messages"


class _RpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_grpc_errors():
    e = from_grpc(_RpcError(grpc.StatusCode.INVALID_ARGUMENT, "min_p: must be in [0, 1], got 2"), "s:1")
    assert (e.status, e.param) == (400, "min_p")
    e = from_grpc(_RpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"), "s:1")
    assert e.status == 503 and "s:1" in e.message and e.code == "service_unavailable"
    assert from_grpc(_RpcError(grpc.StatusCode.NOT_FOUND, "model 'x'"), "s:1").status == 404


def test_validation_locations_name_the_param():
    assert _loc_to_param(("body", "messages", 0, "content", "list[ContentPart]", 1, "text")) == (
        "messages[0].content[1].text"
    )
    assert _loc_to_param(("body", "prompt", "function-after[_valid_unicode(), str]")) == "prompt"
    assert _loc_to_param(("body",)) is None
