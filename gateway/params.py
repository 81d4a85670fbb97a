"""Request -> SamplingParams, with the checks that depend on configuration and on the model.

Everything is checked here, before the scheduler sees the request, so that
each mistake is answered with a 400 naming its parameter (the scheduler checks
again, but its messages are for gRPC clients). The caps shared with the
scheduler live in `services/limits.py` (`RequestLimits`); what is only the
gateway's (batched prompts, sequences per request, prompt text) is here.
Cheap checks come before expensive work: a request over a cap is refused
before any prompt is tokenized.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gateway.errors import APIError, bad_request
from gateway.protocol import SamplingRequest
from services.choices import ContextLengthError, fit_max_tokens
from services.limits import RequestLimits
from services.sampling_params import SamplingParams, SamplingParamsError
from services.structured_outputs import StructuredOutputs


@dataclass(frozen=True)
class Limits:
    """Caps of this gateway combined with what the served model allows."""

    caps: RequestLimits  # shared with the scheduler; max_logprobs already lowered to the model's
    max_prompts: int
    max_seqs_per_request: int
    max_model_len: int
    vocab_size: int
    prompt_chars: int  # a text prompt longer than this surely exceeds max_model_len tokens


def check_batch(num_prompts: int, n: int, limits: Limits) -> None:
    """How many sequences one request may start: refused before anything is tokenized."""
    if num_prompts > limits.max_prompts:
        raise bad_request("prompt", f"at most {limits.max_prompts} prompts per request, got {num_prompts}")
    if n > limits.caps.max_n:
        raise bad_request("n", f"must be <= {limits.caps.max_n}, got {n}")
    seqs = num_prompts * n
    if seqs > limits.max_seqs_per_request:
        raise bad_request(
            "n",
            f"{num_prompts} prompts x n={n} = {seqs} sequences; at most {limits.max_seqs_per_request} "
            "per request (send fewer prompts or a smaller n)",
        )


def context_exceeded(param: str, prompt_len: int, limits: Limits) -> APIError:
    return bad_request(
        param,
        f"the prompt is {prompt_len} tokens, but this model's maximum context length is "
        f"{limits.max_model_len} tokens",
        code="context_length_exceeded",
    )


def check_prompt_chars(param: str, chars: int, limits: Limits) -> None:
    """Refuse, without tokenizing it, a text too long for any tokenization to fit the context."""
    if chars > limits.prompt_chars:
        raise bad_request(
            param,
            f"the prompt is {chars} characters, more than this model's maximum context length of "
            f"{limits.max_model_len} tokens can hold",
            code="context_length_exceeded",
        )


def check_token_ids(param: str, ids: list[int], vocab_size: int) -> None:
    # min/max run in C: a list of millions of ids is checked without a Python loop per id.
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise bad_request(param, f"token ids must be in [0, {vocab_size}), got {bad[:5]}")


def check_prompt_ids(param: str, ids: list[int], limits: Limits) -> None:
    """A token-id prompt: its length first (cheap), then its vocabulary."""
    resolve_max_tokens(len(ids), None, limits, "max_tokens", param)
    check_token_ids(param, ids, limits.vocab_size)


def resolve_max_tokens(
    prompt_len: int, requested: int | None, limits: Limits, param: str, prompt_param: str
) -> int:
    """The tokens to generate: `requested`, or all the context leaves; 400 when they do not fit.

    The check is the scheduler's and the offline API's (`services.choices.fit_max_tokens`); only
    the wording is OpenAI's, naming the request's own parameters.
    """
    try:
        return fit_max_tokens(prompt_len, requested, limits.max_model_len)
    except ContextLengthError as e:
        if e.param == "prompt":
            raise context_exceeded(prompt_param, prompt_len, limits) from None
        raise bad_request(
            param,
            f"this model's maximum context length is {limits.max_model_len} tokens, but you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in {param}); "
            f"reduce the prompt or {param}",
            code="context_length_exceeded",
        ) from None


def sampling_params(
    req: SamplingRequest,
    limits: Limits,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    logprobs_param: str,
    structured: StructuredOutputs | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The request's sampling parameters, checked against the caps (once, before any prompt is tokenized).

    `max_tokens` None means "what the context leaves": `fit_to_prompt` settles it per prompt.
    """
    caps = limits.caps
    if req.logit_bias:
        raise bad_request("logit_bias", "is not supported", code="unsupported_parameter")
    stop_ids = list(req.stop_token_ids or [])
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        # Counts first: SamplingParams walks both lists, and a body may hold millions of entries.
        caps.check_counts(len(stops), len(stop_ids))
        if any(not s for s in stops):
            raise SamplingParamsError("stop", "stop strings must not be empty")
        params = SamplingParams(
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
            stop=stops,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            max_logprobs=caps.max_logprobs,
            structured_outputs=structured,  # checked already (gateway/structured.py): a cache hit
        )
        caps.check(params, limits.vocab_size)
    except SamplingParamsError as e:
        # Chat calls it top_logprobs; SamplingParams and the shared caps say logprobs.
        param = logprobs_param if e.param == "logprobs" else e.param
        raise bad_request(param, str(e).split(": ", 1)[-1]) from e
    return params


def fit_to_prompt(
    params: SamplingParams,
    prompt_len: int,
    requested: int | None,
    limits: Limits,
    param: str,
    prompt_param: str,
) -> SamplingParams:
    """`params` for one prompt: max_tokens resolved against the room its context leaves."""
    max_tokens = resolve_max_tokens(prompt_len, requested, limits, param, prompt_param)
    if params.min_tokens > max_tokens:
        raise bad_request("min_tokens", f"must be <= max_tokens ({max_tokens}), got {params.min_tokens}")
    return dataclasses.replace(params, max_tokens=max_tokens)
