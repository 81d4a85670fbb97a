"""POST /v1/completions: text or token-id prompts (one or a batch), streaming or whole."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import bad_request
from gateway.generation import ChoiceDelta, Generation, TokenLogprob
from gateway.params import check_token_ids, resolve_max_tokens, sampling_params
from gateway.protocol import CompletionRequest
from gateway.serving_base import ChoiceResult, Run, usage
from gateway.state import GatewayState, ServedModel
from gateway.streaming import sse
from gateway.tokenizer import Tokenizer


def _prompts(
    req: CompletionRequest, model: ServedModel, max_prompts: int
) -> list[tuple[list[int], str | None]]:
    """(token ids, text or None) per prompt."""
    p = req.prompt
    if isinstance(p, str):
        raw: list[str | list[int]] = [p]
    elif not p:
        raise bad_request("prompt", "must not be empty")
    elif all(isinstance(x, int) for x in p):
        raw = [p]  # type: ignore[list-item]
    else:
        raw = list(p)  # type: ignore[arg-type]
    if len(raw) > max_prompts:
        raise bad_request("prompt", f"at most {max_prompts} prompts per request, got {len(raw)}")
    out = []
    for i, item in enumerate(raw):
        param = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad_request(param, "must not be empty")
            ids = model.tokenizer.encode(item)
            if not ids:
                raise bad_request(param, "encodes to no tokens")
            out.append((ids, item))
        else:
            if not item:
                raise bad_request(param, "must not be empty")
            check_token_ids(param, item, model.info.vocab_size)
            out.append((list(item), None))
    return out


def _logprobs(tok: Tokenizer, entries: list[TokenLogprob], offset: int) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy logprobs object for some tokens; text offsets start at `offset`."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        text = tok.token_text(e.token_id)
        tokens.append(text)
        lps.append(e.logprob)
        top = {tok.token_text(t): lp for t, lp in e.top}
        top.setdefault(text, e.logprob)  # vLLM's shape: the sampled token is always listed
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
    prompts = _prompts(req, model, limits.max_prompts)
    gens = []
    for ids, _ in prompts:
        max_tokens = resolve_max_tokens(len(ids), req.max_tokens, limits, "max_tokens", "prompt")
        params = sampling_params(
            req, limits, max_tokens=max_tokens, logprobs=req.logprobs, logprobs_param="logprobs"
        )
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
            )
        )
    echo = [
        (text if text is not None else model.tokenizer.decode(ids)) if req.echo else ""
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

    def chunk(d: ChoiceDelta) -> bytes | None:
        text = d.text
        if req.echo and d.index not in echoed:
            echoed.add(d.index)
            text = echo[d.index // req.n] + text
        lp = None
        if req.logprobs is not None and d.logprobs:
            lp, offsets[d.index] = _logprobs(tok, d.logprobs, offsets[d.index])
        if not text and lp is None and d.finish_reason is None:
            return None
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
