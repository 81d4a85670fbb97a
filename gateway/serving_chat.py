"""POST /v1/chat/completions: the model's chat template, streaming or whole."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import bad_request
from gateway.generation import ChoiceDelta, Generation, TokenLogprob
from gateway.params import check_batch, check_prompt_chars, fit_to_prompt, sampling_params
from gateway.protocol import LOGPROB_FLOOR, ChatCompletionRequest
from gateway.serving_base import ChoiceResult, Run, usage
from gateway.state import GatewayState
from gateway.streaming import dumps, sse
from gateway.tokenizer import Tokenizer, chat_chars


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise bad_request("tools", "tool calling is not supported", code="unsupported_parameter")
    if req.tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice", "tool calling is not supported", code="unsupported_parameter")
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request(
            "response_format",
            f"only type 'text' is supported, got {req.response_format.type!r}",
            code="unsupported_parameter",
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs", "needs logprobs=true")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options", "is only allowed with stream=true")


def _logprobs(tok: Tokenizer, entries: list[TokenLogprob]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        raw = tok.token_bytes(token_id)
        return {
            "token": raw.decode("utf-8", errors="replace"),
            "logprob": max(logprob, LOGPROB_FLOOR),
            "bytes": list(raw),
        }

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries
        ],
        "refusal": None,
    }


async def create_chat_completion(
    state: GatewayState, req: ChatCompletionRequest, request: Request
) -> Response:
    model = state.resolve(req.model)
    name = req.model or model.names[0]
    limits = state.limits()
    _check_unsupported(req)
    check_batch(1, req.n, limits)
    if req.max_completion_tokens is not None:
        requested, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = req.max_tokens, "max_tokens"
    top = (req.top_logprobs or 0) if req.logprobs else None
    base = sampling_params(req, limits, max_tokens=requested, logprobs=top, logprobs_param="top_logprobs")
    # The template only adds to the messages' text: text over the limit cannot fit, rendered or not.
    check_prompt_chars("messages", chat_chars(req.messages), limits)
    prompt = await model.tokenizer.encode_chat_async(
        req.messages,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
    )
    params = fit_to_prompt(base, len(prompt), requested, limits, param, "messages")
    gen = Generation(
        state.client,
        model.tokenizer,
        prompt,
        params,
        model=model.info.id,
        timeout=state.config.request_timeout_s,
        priority=req.priority,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    run = Run(state, name, [gen])
    if req.stream:
        return await _stream(run, request, req, model.tokenizer, rid, created, name)

    def build(results: list[ChoiceResult]) -> dict[str, Any]:
        choices = [
            {
                "index": r.index,
                "message": {
                    "role": "assistant",
                    "content": "".join(r.text),
                    "refusal": None,
                    "tool_calls": [],
                },
                "logprobs": _logprobs(model.tokenizer, r.logprobs) if req.logprobs else None,
                "finish_reason": r.finish_reason,
                "stop_reason": r.stop_reason,
            }
            for r in results
        ]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": choices,
            "usage": usage([gen]),
            "system_fingerprint": None,
        }

    return await run.respond(request, build, req.n)


async def _stream(
    run: Run, request: Request, req: ChatCompletionRequest, tok: Tokenizer, rid: str, created: int, name: str
) -> Response:
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name}

    def event(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None, stop=None):
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop
        return sse({**base, "choices": [choice]})

    # OpenAI opens every choice with its role, before any content.
    head = [event(i, {"role": "assistant", "content": ""}) for i in range(req.n)]
    # The usual event (content only) from prebuilt bytes: only its index and text are serialized.
    prefix = b'data: {"id":%b,"object":"chat.completion.chunk","created":%d,"model":%b,' % (
        dumps(rid),
        created,
        dumps(name),
    )
    prefix += b'"choices":[{"index":'
    plain_tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'

    def chunk(d: ChoiceDelta) -> bytes | None:
        lp = _logprobs(tok, d.logprobs) if req.logprobs and d.logprobs else None
        if lp is None and d.finish_reason is None:
            if not d.text:
                return None
            return b'%b%d,"delta":{"content":%b%b' % (prefix, d.index, dumps(d.text), plain_tail)
        delta = {"content": d.text} if d.text or lp is not None else {}
        return event(d.index, delta, lp, d.finish_reason, d.stop_reason)

    def tail() -> list[bytes]:
        so = req.stream_options
        if so is not None and so.include_usage:
            return [sse({**base, "choices": [], "usage": usage(run.gens)})]
        return []

    return await run.stream(request, head, chunk, tail)
