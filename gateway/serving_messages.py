"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat route.

A Messages request is translated into the chat route's own request (system prompt, turns,
tool_use -> an assistant's tool_calls, tool_result -> tool messages, tools, tool_choice), run
by the same machinery (chat template, tool parsers, structured outputs for forced tool use:
gateway/serving_chat.py), and its output read back as content blocks (gateway/output_blocks.py)
in Anthropic's reply or its stream of events. Errors on these routes take Anthropic's shape
(gateway/errors.py).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import APIError, bad_request, renamer
from gateway.generation import ChoiceDelta, Generation
from gateway.output_blocks import (
    CALL,
    DELTA,
    START,
    STOP,
    TEXT,
    Block,
    BlockEvent,
    BlockStream,
    Ending,
    chat_request,
    whole_blocks,
)
from gateway.params import check_prompt_chars
from gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JSONSchemaFormat,
    NamedToolChoice,
    NamedToolChoiceFunction,
    ResponseFormat,
    Tool,
    ToolCall,
)
from gateway.protocol_anthropic import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from gateway.serving_chat import ChatRun, prepare_chat
from gateway.state import GatewayState
from gateway.streaming import ClientDisconnected, FastJSONResponse, dumps
from gateway.structured import tool_plan
from gateway.tokenizer import chat_chars

# The chat route's parameters, as the Messages API names them (in error messages).
RENAME = renamer(
    (r"^stop\b", "stop_sequences"),
    (r"^response_format\.json_schema\.schema\b", "output_config.format.schema"),
    (r"^response_format\b", "output_config.format"),
    (r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
    (r"^tools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"^tool_choice\.function\.", "tool_choice."),
)
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


# ---------------------------------------------------------------------------- Messages -> chat


def _text_of(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def chat_messages(req: CountTokensRequest) -> list[ChatMessage]:
    """The conversation as the chat route's messages."""
    out: list[ChatMessage] = []
    if req.system:
        out.append(ChatMessage(role="system", content=_text_of(req.system)))
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
            continue
        texts: list[str] = []
        calls: list[ToolCall] = []
        for j, block in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                if m.role != "assistant":
                    raise bad_request(where, "tool_use blocks belong to assistant turns")
                args = json.dumps(block.input, ensure_ascii=False)
                calls.append(ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=args)))
            elif isinstance(block, ToolResultBlock):
                if m.role != "user":
                    raise bad_request(where, "tool_result blocks belong to user turns")
                text = _text_of(block.content)
                content = f"Error: {text}" if block.is_error else text
                out.append(ChatMessage(role="tool", content=content, tool_call_id=block.tool_use_id))
            # thinking blocks: an earlier turn's, not part of the prompt
        if m.role == "assistant":
            out.append(ChatMessage(role="assistant", content="\n".join(texts), tool_calls=calls or None))
        elif texts:
            out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out


def _tools(req: CountTokensRequest) -> tuple[list[Tool] | None, Any, bool]:
    """(tools, tool_choice, parallel_tool_calls) in the chat route's terms."""
    tools = None
    if req.tools is not None:
        for i, t in enumerate(req.tools):
            if t.type not in (None, "custom"):
                raise bad_request(f"tools[{i}].type", f"server tools ({t.type}) are not served here")
        tools = [
            Tool(
                function=FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema)
            )
            for t in req.tools
        ]
    tc = req.tool_choice
    if tc is None:
        return tools, None, True
    if tc.type == "tool":
        if not tc.name:
            raise bad_request("tool_choice.name", "is required when tool_choice.type is 'tool'")
        choice: Any = NamedToolChoice(function=NamedToolChoiceFunction(name=tc.name))
    else:
        choice = _TOOL_CHOICES[tc.type]
    return tools, choice, not tc.disable_parallel_tool_use


def _response_format(req: MessagesRequest) -> ResponseFormat | None:
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is None:
        return None
    return ResponseFormat(
        type="json_schema", json_schema=JSONSchemaFormat.model_validate({"schema": fmt.json_schema})
    )


def to_chat(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat route's request for a Messages request. A last assistant turn is a prefill: the
    reply continues it, as Anthropic's does."""
    messages = chat_messages(req)
    prefill = req.messages[-1].role == "assistant"
    tools, choice, parallel = _tools(req)
    fields: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        fields = {
            "max_tokens": req.max_tokens,
            "stop": req.stop_sequences,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "user": req.metadata.user_id if req.metadata else None,
            "response_format": _response_format(req),
            "stream": req.stream,
        }
    if not messages:
        raise bad_request("messages", "no turn holds text, a tool call or a tool result")
    return chat_request(
        model=req.model,
        messages=messages,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        **fields,
    )


# ---------------------------------------------------------------------------- chat -> Messages


def tool_use_id(call_id: str) -> str:
    """Anthropic's spelling of a call id (`toolu_...`)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(ending: Ending, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a reply."""
    if ending.called:
        return "tool_use", None
    if ending.finish_reason == "length":
        return "max_tokens", None
    s = ending.stop_string
    if s is not None and s in (stop_sequences or []):
        return "stop_sequence", s
    return "end_turn", None


def content_block(block: Block, whole: bool = True) -> dict[str, Any]:
    if block.kind == TEXT:
        return {"type": "text", "text": block.text if whole else ""}
    try:
        args = json.loads(block.text) if whole and block.text else {}
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name, "input": args}


def usage_of(gen: Generation, output_tokens: int | None = None) -> dict[str, Any]:
    """Anthropic's usage: input_tokens leaves out the prompt tokens read from the prefix cache."""
    cached = gen.cached_tokens
    return {
        "input_tokens": len(gen.prompt_ids) - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": gen.completion_tokens if output_tokens is None else output_tokens,
    }


def _message(
    mid: str, name: str, blocks: list[Block], reason: tuple[str | None, str | None], usage: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": name,
        "content": [content_block(b) for b in blocks],
        "stop_reason": reason[0],
        "stop_sequence": reason[1],
        "usage": usage,
    }


def event(kind: str, payload: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic writes them: named, its type also in the data."""
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **payload}) + b"\n\n"


def _error_event(e: APIError) -> bytes:
    return event("error", {"error": e.anthropic_body()["error"]})


def block_event(ev: BlockEvent) -> bytes:
    if ev.kind == START:
        return event(
            "content_block_start", {"index": ev.index, "content_block": content_block(ev.block, False)}
        )
    if ev.kind == DELTA:
        if ev.block.kind == CALL:
            delta = {"type": "input_json_delta", "partial_json": ev.delta}
        else:
            delta = {"type": "text_delta", "text": ev.delta}
        return event("content_block_delta", {"index": ev.index, "delta": delta})
    assert ev.kind == STOP
    return event("content_block_stop", {"index": ev.index})


# ---------------------------------------------------------------------------- routes


async def create_message(state: GatewayState, req: MessagesRequest, request: Request) -> Response:
    try:
        chat = await prepare_chat(state, to_chat(req), request)
    except APIError as e:
        raise e.renamed(RENAME) from None
    mid = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        return await _stream(chat, request, req, mid)
    try:
        (result,) = await chat.run.collect(request, 1)
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; it marks the request in the metrics
    blocks, ending = whole_blocks(chat.tools, result)
    reason = stop_reason(ending, req.stop_sequences)
    return FastJSONResponse(_message(mid, chat.name, blocks, reason, usage_of(chat.gen)))


async def _stream(chat: ChatRun, request: Request, req: MessagesRequest, mid: str) -> Response:
    gen = chat.gen
    head = [
        event("message_start", {"message": _message(mid, chat.name, [], (None, None), usage_of(gen, 0))}),
        event("ping", {}),
    ]
    blocks = BlockStream(chat.tools)

    def chunk(d: ChoiceDelta) -> bytes | None:
        events = blocks.feed(d)
        return b"".join(block_event(e) for e in events) if events else None

    def tail() -> list[bytes]:
        ending = blocks.ending or Ending(None, None, False)
        reason, seq = stop_reason(ending, req.stop_sequences)
        delta = {"delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage_of(gen)}
        return [event("message_delta", delta), event("message_stop", {})]

    return await chat.run.stream(request, head, chunk, tail, end=b"", error_event=_error_event)


async def count_tokens(state: GatewayState, req: CountTokensRequest) -> dict[str, Any]:
    """The prompt's tokens, rendered exactly as /v1/messages renders it (tools included)."""
    try:
        chat = to_chat(req)
        model = state.resolve(chat.model)
        tools = tool_plan(chat)
        check_prompt_chars("messages", chat_chars(chat.messages), state.limits())
        ids = await model.tokenizer.encode_chat_async(
            chat.messages,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            tools=tools.tools if tools.render else None,
        )
    except APIError as e:
        raise e.renamed(RENAME) from None
    return {"input_tokens": len(ids)}
