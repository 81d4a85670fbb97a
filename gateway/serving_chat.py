"""POST /v1/chat/completions: the model's chat template, streaming or whole."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import bad_request
from gateway.generation import ChoiceDelta, Generation, TokenLogprob
from gateway.params import check_batch, check_prompt_chars, fit_to_prompt, sampling_params
from gateway.protocol import LOGPROB_FLOOR, ChatCompletionRequest
from gateway.serving_base import ChoiceResult, Run, cache_salt_of, usage
from gateway.state import GatewayState
from gateway.streaming import dumps, sse
from gateway.structured import (
    AUTO,
    NAMED,
    REQUIRED,
    ToolPlan,
    shows_tool_call_tags,
    structured_outputs,
    tool_plan,
)
from gateway.tokenizer import Tokenizer, chat_chars
from gateway.tool_parsers import AutoToolStream, ParsedToolCall, parse_required, parse_tool_calls
from services.structured_outputs import StructuredOutputs


def _check_unsupported(req: ChatCompletionRequest) -> None:
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


@dataclass
class ChatRun:
    """A chat request ready to run: what the other chat-shaped APIs (gateway/serving_messages.py,
    serving_responses.py) build on, each writing its own reply."""

    run: Run
    gen: Generation
    tools: ToolPlan
    name: str  # the model name the reply carries
    tokenizer: Tokenizer


async def prepare_chat(state: GatewayState, req: ChatCompletionRequest, request: Request) -> ChatRun:
    """Checks, the chat template, the prompt tokenized, and its generation (not started yet)."""
    model = state.resolve(req.model)
    name = req.model or model.names[0]
    limits = state.limits()
    _check_unsupported(req)
    check_batch(1, req.n, limits)
    salt = cache_salt_of(state, req, request)
    tools = tool_plan(req, shows_tool_call_tags(getattr(model.tokenizer.hf, "chat_template", None)))
    structured = _constraint(req, tools)
    if req.max_completion_tokens is not None:
        requested, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = req.max_tokens, "max_tokens"
    top = (req.top_logprobs or 0) if req.logprobs else None
    base = sampling_params(
        req, limits, max_tokens=requested, logprobs=top, logprobs_param="top_logprobs", structured=structured
    )
    # The template only adds to the messages' text: text over the limit cannot fit, rendered or not.
    check_prompt_chars("messages", chat_chars(req.messages), limits)
    prompt = await model.tokenizer.encode_chat_async(
        req.messages,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        tools=tools.tools if tools.render else None,
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
        cache_salt=salt,
        lora=model.lora,
    )
    return ChatRun(Run(state, name, [gen]), gen, tools, name, model.tokenizer)


async def create_chat_completion(
    state: GatewayState, req: ChatCompletionRequest, request: Request
) -> Response:
    chat = await prepare_chat(state, req, request)
    run, gen, tools, name = chat.run, chat.gen, chat.tools, chat.name
    tok = chat.tokenizer
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        return await _stream(run, request, req, tok, rid, created, name, tools)

    def choice(r: ChoiceResult) -> dict[str, Any]:
        content, calls = split_tool_calls(tools, "".join(r.text), r.finish_reason)
        return {
            "index": r.index,
            "message": {
                "role": "assistant",
                "content": content,
                "refusal": None,
                "tool_calls": [c.to_openai() for c in calls],
            },
            "logprobs": _logprobs(tok, r.logprobs) if req.logprobs else None,
            "finish_reason": "tool_calls" if calls and r.finish_reason == "stop" else r.finish_reason,
            "stop_reason": r.stop_reason,
        }

    def build(results: list[ChoiceResult]) -> dict[str, Any]:
        choices = [choice(r) for r in results]
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


def _constraint(req: ChatCompletionRequest, tools: ToolPlan) -> StructuredOutputs | None:
    """What the output is held to: the request's response_format / structured_outputs, or the
    schema of a required / named tool_choice (the two cannot be combined)."""
    structured = structured_outputs(req)
    if tools.spec is None:
        return structured
    if structured is not None:
        raise bad_request(
            "tool_choice",
            "a required or named tool_choice cannot be combined with response_format / structured_outputs",
        )
    return tools.spec


def split_tool_calls(
    tools: ToolPlan, text: str, finish: str | None
) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, tool calls) of a whole choice. A named call is read only from output that
    finished (cut by max_tokens, its text stays content); required calls are every whole call
    written, also before max_tokens cut the list (then the text is not content)."""
    calls: list[ParsedToolCall] = []
    if tools.mode == NAMED and finish == "stop":
        assert tools.named is not None
        calls, text = [ParsedToolCall(tools.named, text)], ""
    elif tools.mode == REQUIRED:
        calls = parse_required(text)
        if calls:
            text = ""
    elif tools.mode == AUTO:
        text, calls = parse_tool_calls(text, {t.function.name for t in tools.tools})
    return (text if text or not calls else None), calls


class ToolCallStream:
    """One streamed choice of a request with tools: content and `delta.tool_calls` per delta."""

    def __init__(self, tools: ToolPlan) -> None:
        self.tools = tools
        self.auto = AutoToolStream({t.function.name for t in tools.tools}) if tools.mode == AUTO else None
        self.held = ""  # REQUIRED: the output so far (the list of calls)
        self.sent = 0  # REQUIRED: calls sent
        self.named_id: str | None = None

    def delta(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """(the delta's fields, its finish_reason)."""
        mode = self.tools.mode
        out: dict[str, Any] = {}
        calls: list[ParsedToolCall] = []
        if mode == NAMED:
            if text:
                call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
                if self.named_id is None:
                    self.named_id = ParsedToolCall(self.tools.named or "", "").id
                    call.update(id=self.named_id, type="function")
                    call["function"] = {"name": self.tools.named, "arguments": text}
                out["tool_calls"] = [call]
            called = self.named_id is not None
        elif mode == REQUIRED:
            # Each call goes out once whole: a call can only have ended where a "}" came.
            self.held += text
            if "}" in text:
                calls = parse_required(self.held)[self.sent :]
                self.sent += len(calls)
            if finish is not None and not self.sent and self.held:
                out["content"] = self.held
            called = self.sent > 0
        else:
            assert self.auto is not None
            content = self.auto.feed(text)
            if finish is not None:
                rest, calls = self.auto.finish()
                content += rest
            if content:
                out["content"] = content
            called = bool(calls)
        if calls:
            first = self.sent - len(calls) if mode == REQUIRED else 0
            out["tool_calls"] = [{"index": first + i, **c.to_openai()} for i, c in enumerate(calls)]
        if finish == "stop" and called:
            finish = "tool_calls"
        return out, finish


async def _stream(
    run: Run,
    request: Request,
    req: ChatCompletionRequest,
    tok: Tokenizer,
    rid: str,
    created: int,
    name: str,
    tools: ToolPlan,
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

    tool_streams = [ToolCallStream(tools) for _ in range(req.n)] if tools.mode != "none" else None

    def chunk(d: ChoiceDelta) -> bytes | None:
        lp = _logprobs(tok, d.logprobs) if req.logprobs and d.logprobs else None
        if tool_streams is not None:
            delta, finish = tool_streams[d.index].delta(d.text, d.finish_reason)
            if not delta and lp is None and finish is None:
                return None
            return event(d.index, delta, lp, finish, d.stop_reason)
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
