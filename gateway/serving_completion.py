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
from gateway.serving_base import ChoiceResult, Run, cache_salt_of, usage
from gateway.state import GatewayState, ServedModel
from gateway.streaming import dumps, sse
from gateway.structured import structured_outputs
from gateway.tokenizer import Tokenizer


def _raw_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts as sent: texts or token-id lists (none tokenized yet)."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise bad_request("prompt", "must not be empty")
    # The schema admits only homogeneous lists: the first item tells which (no walk over a million ids).
    if isinstance(p[0], int):
        return [p]  # type: ignore[list-item]
    return list(p)  # type: ignore[arg-type]


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


async def create_completion(state: GatewayState, req: CompletionRequest, request: Request) -> Response:
    model = state.resolve(req.model)
    name = req.model or model.names[0]
    limits = state.limits()
    if req.suffix:
        raise bad_request("suffix", "is not supported", code="unsupported_parameter")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of", "only best_of == n is supported", code="unsupported_parameter")
    if req.echo and req.logprobs is not None:
        raise bad_request(
            "echo",
            "echo with logprobs needs prompt logprobs, which are not supported",
            code="unsupported_parameter",
        )
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options", "is only allowed with stream=true")
    raw = _raw_prompts(req)
    check_batch(len(raw), req.n, limits)
    salt = cache_salt_of(state, req, request)
    base = sampling_params(
        req,
        limits,
        max_tokens=req.max_tokens,
        logprobs=req.logprobs,
        logprobs_param="logprobs",
        structured=structured_outputs(req),
    )
    prompts = await _encode_prompts(raw, model, limits)
    gens = []
    for ids, _ in prompts:
        params = fit_to_prompt(base, len(ids), req.max_tokens, limits, "max_tokens", "prompt")
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
            )
        )
    echo = [
        (text if text is not None else await model.tokenizer.decode_async(ids)) if req.echo else ""
        for ids, text in prompts
    ]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    run = Run(state, name, gens)
    if req.stream:
        return await _stream(run, request, req, model.tokenizer, rid, created, name, echo)

    def build(results: list[ChoiceResult]) -> dict[str, Any]:
        choices = []
        for r in results:
            prefix = echo[r.index // req.n]
            lp = _logprobs(model.tokenizer, r.logprobs, len(prefix))[0] if req.logprobs is not None else None
            choices.append(
                {
                    "index": r.index,
                    "text": prefix + "".join(r.text),
                    "logprobs": lp,
                    "finish_reason": r.finish_reason,
                    "stop_reason": r.stop_reason,
                }
            )
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": name,
            "choices": choices,
            "usage": usage(gens),
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
) -> Response:
    base = {"id": rid, "object": "text_completion", "created": created, "model": name}
    offsets = {i: len(echo[i // req.n]) for i in range(len(echo) * req.n)}
    echoed: set[int] = set()
    # The usual event (text only) from prebuilt bytes: only its index and text are serialized.
    head = b'data: {"id":%b,"object":"text_completion","created":%d,"model":%b,"choices":[{"index":' % (
        dumps(rid),
        created,
        dumps(name),
    )
    plain_tail = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'

    def chunk(d: ChoiceDelta) -> bytes | None:
        text = d.text
        if req.echo and d.index not in echoed:
            echoed.add(d.index)
            text = echo[d.index // req.n] + text
        lp = None
        if req.logprobs is not None and d.logprobs:
            lp, offsets[d.index] = _logprobs(tok, d.logprobs, offsets[d.index])
        if lp is None and d.finish_reason is None:
            if not text:
                return None
            return b'%b%d,"text":%b%b' % (head, d.index, dumps(text), plain_tail)
        choice = {
            "index": d.index,
            "text": text,
            "logprobs": lp,
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }
        return sse({**base, "choices": [choice]})

    def tail() -> list[bytes]:
        so = req.stream_options
        if so is not None and so.include_usage:
            return [sse({**base, "choices": [], "usage": usage(run.gens)})]
        return []

    return await run.stream(request, [], chunk, tail)
