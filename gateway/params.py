"""Request -> SamplingParams, with the checks that depend on configuration and on the model.

Everything is checked here, before the scheduler sees the request, so that
each mistake is answered with a 400 naming its parameter (the scheduler checks
again, but its messages are for gRPC clients).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import bad_request
from gateway.protocol import SamplingRequest
from services.sampling_params import SamplingParams, SamplingParamsError


@dataclass(frozen=True)
class Limits:
    """Caps of this gateway combined with what the served model allows."""

    max_n: int
    max_logprobs: int
    max_stop: int
    max_stop_chars: int
    max_prompts: int
    max_model_len: int
    vocab_size: int


def stop_strings(req: SamplingRequest, limits: Limits) -> list[str]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > limits.max_stop:
        raise bad_request("stop", f"at most {limits.max_stop} stop strings, got {len(stops)}")
    for s in stops:
        if not s:
            raise bad_request("stop", "stop strings must not be empty")
        if len(s) > limits.max_stop_chars:
            raise bad_request("stop", f"stop strings must be at most {limits.max_stop_chars} characters")
    return stops


def check_token_ids(param: str, ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(param, f"token ids must be in [0, {vocab_size}), got {bad[:5]}")


def resolve_max_tokens(
    prompt_len: int, requested: int | None, limits: Limits, param: str, prompt_param: str
) -> int:
    """The tokens to generate: `requested`, or all the context leaves; 400 when they do not fit."""
    room = limits.max_model_len - prompt_len
    if room <= 0:
        raise bad_request(
            prompt_param,
            f"the prompt is {prompt_len} tokens, but this model's maximum context length is "
            f"{limits.max_model_len} tokens",
            code="context_length_exceeded",
        )
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            param,
            f"this model's maximum context length is {limits.max_model_len} tokens, but you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in {param}); "
            f"reduce the prompt or {param}",
            code="context_length_exceeded",
        )
    return requested


def sampling_params(
    req: SamplingRequest, limits: Limits, *, max_tokens: int, logprobs: int | None, logprobs_param: str
) -> SamplingParams:
    if req.n > limits.max_n:
        raise bad_request("n", f"must be <= {limits.max_n}, got {req.n}")
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise bad_request(logprobs_param, f"must be <= {limits.max_logprobs}, got {logprobs}")
    if req.logit_bias:
        raise bad_request("logit_bias", "is not supported", code="unsupported_parameter")
    stop_ids = list(req.stop_token_ids or [])
    if len(stop_ids) > 4 * limits.max_stop:
        raise bad_request("stop_token_ids", f"at most {4 * limits.max_stop} ids, got {len(stop_ids)}")
    check_token_ids("stop_token_ids", stop_ids, limits.vocab_size)
    if req.min_tokens > max_tokens:
        raise bad_request("min_tokens", f"must be <= max_tokens ({max_tokens}), got {req.min_tokens}")
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop_token_ids=stop_ids,
            stop=stop_strings(req, limits),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            max_logprobs=limits.max_logprobs,
        )
    except SamplingParamsError as e:
        raise bad_request(e.param, str(e).split(": ", 1)[-1]) from e
