"""Request -> SamplingParams checks, and the error mapping they rely on."""

from __future__ import annotations

import grpc
import pytest

from gateway.errors import APIError, _loc_to_param, from_grpc
from gateway.params import Limits, resolve_max_tokens, sampling_params
from gateway.protocol import CompletionRequest

LIMITS = Limits(
    max_n=4, max_logprobs=5, max_stop=2, max_stop_chars=8, max_prompts=2, max_model_len=100, vocab_size=1000
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
    rejects("stop_token_ids", stop_token_ids=[1000])
    rejects("stop_token_ids", stop_token_ids=list(range(9)))
    rejects("logit_bias", logit_bias={"1": 1.0})
    rejects("min_tokens", min_tokens=11)


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
