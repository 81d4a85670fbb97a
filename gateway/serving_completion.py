"""POST /v1/completions: text or token-id prompts (one or a batch), streaming or whole."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import bad_request
from gateway.generation import ChoiceDelta, Generation, TokenLogprob
from gateway.params import (
    Limits,
    check_batch,
    check_prompt_chars,
    check_prompt_ids,
    fit_to_prompt,
    sampling_params,
)
from gateway.protocol import LOGPROB_FLOOR, CompletionRequest
from gateway.serving_base import ChoiceResult, Run, cache_salt_of, raw_prompts, usage
from gateway.state import GatewayState, ServedModel
from gateway.streaming import dumps, sse
from gateway.structured import structured_outputs
from gateway.tokenizer import Tokenizer
from services.step import TokenLogprobs


async def _encode_prompts(
    raw: list[str | list[int]], model: ServedModel, limits: Limits
) -> list[tuple[list[int], str | None]]:
    """(token ids, text or None) per prompt; what is cheap to refuse is refused before any tokenizing."""
    params = ["prompt" if len(raw) == 1 else f"prompt[{i}]" for i in range(len(raw))]
    for param, item in zip(params, raw, strict=True):
        if not item:
            raise bad_request(param, "must not be empty")
        if isinstance(item, str):
            check_prompt_chars(param, len(item), limits)
        else:
            check_prompt_ids(param, item, limits)
    out = []
    # One prompt at a time: a batch of large prompts holds one tokenizer thread, not all of them.
    for param, item in zip(params, raw, strict=True):
        if isinstance(item, str):
            ids = await model.tokenizer.encode_async(item)
            if not ids:
                raise bad_request(param, "encodes to no tokens")
            out.append((ids, item))
        else:
            out.append((list(item), None))
    return out


def _logprobs(tok: Tokenizer, entries: list[TokenLogprob], offset: int) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy logprobs object for some tokens; text offsets start at `offset`."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        text = tok.token_text(e.token_id)
        tokens.append(text)
        lps.append(max(e.logprob, LOGPROB_FLOOR))
        top = {tok.token_text(t): max(lp, LOGPROB_FLOOR) for t, lp in e.top}
        top.setdefault(text, lps[-1])  # vLLM's shape: the sampled token is always listed
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def _prompt_part(
    tok: Tokenizer, prompt_ids: list[int], entries: list[TokenLogprobs | None] | None, k: int
) -> tuple[dict[str, Any], int]:
    """The echoed prompt's share of the legacy logprobs object, offsets from 0 (vLLM's shape: the
    first token, and any without an entry, has null logprob and null top_logprobs)."""
    if entries is None:  # none came (the choice ended before its first token)
        entries = [None] * len(prompt_ids)
    tokens, lps, tops, offsets = [], [], [], []
    offset = 0
    for token_id, e in zip(prompt_ids, entries, strict=True):
        text = tok.token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if e is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(max(e.logprob, LOGPROB_FLOOR))
        top = {
            tok.token_text(t): max(lp, LOGPROB_FLOOR)
            for t, lp in zip(e.top_token_ids[:k], e.top_logprobs[:k], strict=True)
        }
        top.setdefault(text, lps[-1])
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def _joined(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {key: a[key] + b[key] for key in a}


def _vllm_prompt_logprobs(tok: Tokenizer, entries: list[TokenLogprobs | None] | None) -> list | None:
    """vLLM's `prompt_logprobs` of a completion choice: per position None or
    {token id: {logprob, rank, decoded_token}}, the prompt token first."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {e.token_id: {"logprob": max(e.logprob, LOGPROB_FLOOR), "rank": e.rank}}
        for rank, (t, lp) in enumerate(zip(e.top_token_ids, e.top_logprobs, strict=True), 1):
            d.setdefault(t, {"logprob": max(lp, LOGPROB_FLOOR), "rank": rank})
        out.append({str(t): {**v, "decoded_token": tok.token_text(t)} for t, v in d.items()})
    return out


def _prompt_logprobs_of(req: CompletionRequest) -> int | None:
    """What the prompt needs: vLLM's own `prompt_logprobs`, else `logprobs` when it is echoed."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    return req.logprobs if req.echo else None


def _usage(gens: list[Generation], prompt_only: bool) -> dict[str, Any]:
    """Token counts; with max_tokens 0 nothing generated is returned, so none is counted."""
    out = usage(gens)
    if prompt_only:
        out["completion_tokens"] = 0
        out["total_tokens"] = out["prompt_tokens"]
    return out


async def create_completion(state: GatewayState, req: CompletionRequest, request: Request) -> Response:
    model = state.resolve(req.model)
    name = req.model or model.names[0]
    limits = state.limits()
    if req.suffix:
        raise bad_request("suffix", "is not supported", code="unsupported_parameter")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of", "only best_of == n is supported", code="unsupported_parameter")
    # max_tokens 0 (vLLM's echo without generation): one token is generated and dropped.
    prompt_only = req.max_tokens == 0
    if prompt_only and not req.echo:
        raise bad_request("max_tokens", "must be >= 1 (0 is only for echo: the prompt alone)")
    max_tokens = 1 if prompt_only else req.max_tokens
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options", "is only allowed with stream=true")
    raw = raw_prompts(req.prompt, "prompt")
    check_batch(len(raw), req.n, limits)
    salt = cache_salt_of(state, req, request)
    base = sampling_params(
        req,
        limits,
        max_tokens=max_tokens,
        logprobs=req.logprobs,
        logprobs_param="logprobs",
        structured=structured_outputs(req),
        prompt_logprobs=_prompt_logprobs_of(req),
    )
    prompts = await _encode_prompts(raw, model, limits)
    gens = []
    for ids, _ in prompts:
        params = fit_to_prompt(base, len(ids), max_tokens, limits, "max_tokens", "prompt")
        gens.append(
            Generation(
                state.client,
                model.tokenizer,
                ids,
                params,
                model=model.info.id,
                timeout=state.config.request_timeout_s,
                first_index=len(gens) * req.n,
                priority=req.priority,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                cache_salt=salt,
                lora=model.lora,
            )
        )
    echo = [
        (text if text is not None else await model.tokenizer.decode_async(ids)) if req.echo else ""
        for ids, text in prompts
    ]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    run = Run(state, name, gens)
    prompt_ids = [ids for ids, _ in prompts]
    if req.stream:
        return await _stream(run, request, req, model.tokenizer, rid, created, name, echo, prompt_ids)
    tok = model.tokenizer

    def build(results: list[ChoiceResult]) -> dict[str, Any]:
        choices = []
        for r in results:
            prefix = echo[r.index // req.n]
            if prompt_only:
                r.text, r.logprobs, r.finish_reason, r.stop_reason = [], [], "length", None
            lp = None
            if req.logprobs is not None:
                start = len(prefix)
                if req.echo:
                    head, start = _prompt_part(
                        tok, prompt_ids[r.index // req.n], r.prompt_logprobs, req.logprobs
                    )
                lp = _logprobs(tok, r.logprobs, start)[0]
                if req.echo:
                    lp = _joined(head, lp)
            choice = {
                "index": r.index,
                "text": prefix + "".join(r.text),
                "logprobs": lp,
                "finish_reason": r.finish_reason,
                "stop_reason": r.stop_reason,
            }
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(tok, r.prompt_logprobs)
            choices.append(choice)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": name,
            "choices": choices,
            "usage": _usage(gens, prompt_only),
            "system_fingerprint": None,
        }

    return await run.respond(request, build, len(prompts) * req.n)


async def _stream(
    run: Run,
    request: Request,
    req: CompletionRequest,
    tok: Tokenizer,
    rid: str,
    created: int,
    name: str,
    echo: list[str],
    prompt_ids: list[list[int]],
) -> Response:
    base = {"id": rid, "object": "text_completion", "created": created, "model": name}
    offsets = {i: len(echo[i // req.n]) for i in range(len(echo) * req.n)}
    echoed: set[int] = set()
    prompt_only = req.max_tokens == 0
    # The usual event (text only) from prebuilt bytes: only its index and text are serialized.
    head = b'data: {"id":%b,"object":"text_completion","created":%d,"model":%b,"choices":[{"index":' % (
        dumps(rid),
        created,
        dumps(name),
    )
    plain_tail = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'

    def chunk(d: ChoiceDelta) -> bytes | None:
        if prompt_only:  # the prompt alone: what was generated is dropped
            if d.finish_reason is not None:
                d.finish_reason, d.stop_reason = "length", None
            d.text, d.logprobs = "", []
        text = d.text
        prompt_lp = None
        if req.echo and d.index not in echoed:
            echoed.add(d.index)
            text = echo[d.index // req.n] + text
            if req.logprobs is not None:
                ids = prompt_ids[d.index // req.n]
                prompt_lp, offsets[d.index] = _prompt_part(tok, ids, d.prompt_logprobs, req.logprobs)
        lp = None
        if req.logprobs is not None and (d.logprobs or prompt_lp is not None):
            lp, offsets[d.index] = _logprobs(tok, d.logprobs, offsets[d.index])
            if prompt_lp is not None:
                lp = _joined(prompt_lp, lp)
        extra = {}
        if req.prompt_logprobs is not None and d.prompt_logprobs is not None:
            extra["prompt_logprobs"] = _vllm_prompt_logprobs(tok, d.prompt_logprobs)
        if lp is None and d.finish_reason is None and not extra:
            if not text:
                return None
            return b'%b%d,"text":%b%b' % (head, d.index, dumps(text), plain_tail)
        choice = {
            "index": d.index,
            "text": text,
            "logprobs": lp,
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
            **extra,
        }
        return sse({**base, "choices": [choice]})

    def tail() -> list[bytes]:
        so = req.stream_options
        if so is not None and so.include_usage:
            return [sse({**base, "choices": [], "usage": _usage(run.gens, prompt_only)})]
        return []

    return await run.stream(request, [], chunk, tail)
