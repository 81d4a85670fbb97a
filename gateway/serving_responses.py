"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat route.

A request is translated into the chat route's own request (instructions -> a system message,
input items -> turns, function_call / function_call_output items -> an assistant's tool_calls
and tool messages, flat function tools, text.format -> response_format), run by the same
machinery (gateway/serving_chat.py), and its output read back as output items
(gateway/output_blocks.py), whole or as Responses' stream of events.

With `store` (the default) the response and the conversation it ends are kept
(gateway/response_store.py) for `GET`, and for a later request's `previous_response_id` to
continue; `instructions` are not carried over, as OpenAI's are not. A record belongs to the API
key that made it: another tenant's key finds nothing.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.cache_salt import API_KEY_SCOPE
from gateway.errors import APIError, bad_request, renamer
from gateway.generation import ChoiceDelta, Generation
from gateway.output_blocks import (
    CALL,
    DELTA,
    START,
    TEXT,
    Block,
    BlockStream,
    Ending,
    chat_request,
    whole_blocks,
)
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
from gateway.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
    TextPart,
)
from gateway.response_store import ResponseStore
from gateway.serving_chat import ChatRun, prepare_chat
from gateway.state import GatewayState
from gateway.streaming import ClientDisconnected, FastJSONResponse, dumps

# The chat route's parameters, as the Responses API names them (in error messages).
RENAME = renamer(
    (r"^messages\b", "input"),
    (r"^max_tokens\b", "max_output_tokens"),
    (r"^response_format\.json_schema\.schema\b", "text.format.schema"),
    (r"^response_format\b", "text.format"),
    (r"^tools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"^tool_choice\.function\.", "tool_choice."),
)


# ---------------------------------------------------------------------------- Responses -> chat


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def input_messages(items: Any) -> list[ChatMessage]:
    """The request's input as chat messages; function calls join the assistant turn before them."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append(ChatMessage(role=item.role, content=_text(item.content)))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(ChatMessage(role="tool", content=_text(item.output), tool_call_id=item.call_id))
        # reasoning items: an earlier turn's, not part of the prompt
    return out


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.json_schema is None:
        raise bad_request("text.format.schema", "is required when text.format.type is 'json_schema'")
    schema = JSONSchemaFormat.model_validate(
        {"name": fmt.name, "description": fmt.description, "schema": fmt.json_schema, "strict": fmt.strict}
    )
    return ResponseFormat(type="json_schema", json_schema=schema)


def to_chat(req: ResponsesRequest, conversation: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat route's request: the instructions, then the conversation so far and the input."""
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    messages += conversation
    if not messages:
        raise bad_request("input", "holds no message, function call or function call output")
    tools = [
        Tool(
            function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
            )
        )
        for t in req.tools or []
    ]
    choice: Any = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(function=NamedToolChoiceFunction(name=choice.name))
    return chat_request(
        model=req.model,
        messages=messages,
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        response_format=_response_format(req),
        user=req.user,
        stream=req.stream,
    )


# ---------------------------------------------------------------------------- chat -> Responses


def item_id(block: Block) -> str:
    return ("msg_" if block.kind == TEXT else "fc_") + uuid.uuid4().hex


def _part(block: Block) -> dict[str, Any]:
    return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}


def output_item(block: Block, iid: str, status: str) -> dict[str, Any]:
    if block.kind == TEXT:
        content = [_part(block)] if status != "in_progress" else []
        return {"type": "message", "id": iid, "status": status, "role": "assistant", "content": content}
    return {
        "type": "function_call",
        "id": iid,
        "call_id": block.call_id,
        "name": block.name,
        "arguments": block.text if status != "in_progress" else "",
        "status": status,
    }


def status_of(ending: Ending | None) -> str:
    if ending is None:
        return "in_progress"
    return "incomplete" if ending.finish_reason == "length" else "completed"


def usage_of(gen: Generation) -> dict[str, Any]:
    prompt, output = len(gen.prompt_ids), gen.completion_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": gen.cached_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def response_object(
    rid: str,
    created: int,
    req: ResponsesRequest,
    name: str,
    output: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    choice = req.tool_choice
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text else {"type": "text"}
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": name,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": None,
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt},
        "tool_choice": (choice or "auto") if isinstance(choice, str | None) else choice.model_dump(),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def assistant_turn(blocks: list[Block]) -> ChatMessage:
    """The reply as the conversation's next chat message (what a continuation renders)."""
    text = "".join(b.text for b in blocks if b.kind == TEXT)
    calls = [
        ToolCall(id=b.call_id, function=FunctionCall(name=b.name, arguments=b.text))
        for b in blocks
        if b.kind == CALL
    ]
    return ChatMessage(role="assistant", content=text, tool_calls=calls or None)


def owner_of(request: Request) -> str | None:
    """Whose records these are: a digest of the API key the request presented (None: no keys)."""
    key = request.scope.get(API_KEY_SCOPE)
    return None if key is None else hashlib.sha256(key.encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------- routes


class Responses:
    """The Responses routes of one gateway: its state and its store of responses."""

    def __init__(self, state: GatewayState, store: ResponseStore) -> None:
        self.state = state
        self.store = store

    async def _stored(self, rid: str, request: Request, param: str | None = None) -> dict[str, Any]:
        record = await self.store.get(rid)
        if record is None or record.get("owner") != owner_of(request):
            raise APIError(404, f"No response with id '{rid}' is stored here.", param=param, code="not_found")
        return record

    async def retrieve(self, rid: str, request: Request) -> dict[str, Any]:
        return (await self._stored(rid, request))["response"]

    async def delete(self, rid: str, request: Request) -> dict[str, Any]:
        await self._stored(rid, request)
        await self.store.delete(rid)
        return {"id": rid, "object": "response", "deleted": True}

    async def create(self, req: ResponsesRequest, request: Request) -> Response:
        conversation: list[ChatMessage] = []
        if req.previous_response_id is not None:
            prev = await self._stored(req.previous_response_id, request, "previous_response_id")
            conversation = [ChatMessage.model_validate(m) for m in prev["history"]]
        conversation += input_messages(req.input)
        try:
            chat = await prepare_chat(self.state, to_chat(req, conversation), request)
        except APIError as e:
            raise e.renamed(RENAME) from None
        rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        owner = owner_of(request)

        async def finish(blocks: list[Block], ids: list[str], ending: Ending | None) -> dict[str, Any]:
            status = status_of(ending)
            output = [output_item(b, i, status) for b, i in zip(blocks, ids, strict=True)]
            resp = response_object(rid, created, req, chat.name, output, status, usage_of(chat.gen))
            if req.store:
                history = [m.model_dump(exclude_none=True) for m in [*conversation, assistant_turn(blocks)]]
                await self.store.put(rid, {"response": resp, "history": history, "owner": owner})
            return resp

        if req.stream:
            head = response_object(rid, created, req, chat.name, [], "in_progress", None)
            return await _stream(chat, request, head, finish)
        try:
            (result,) = await chat.run.collect(request, 1)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; it marks the request in the metrics
        blocks, ending = whole_blocks(chat.tools, result)
        return FastJSONResponse(await finish(blocks, [item_id(b) for b in blocks], ending))


async def _stream(chat: ChatRun, request: Request, head: dict[str, Any], finish) -> Response:
    seq = 0
    blocks = BlockStream(chat.tools)
    ids: list[str] = []

    def event(kind: str, **payload: Any) -> bytes:
        nonlocal seq
        data = dumps({"type": kind, "sequence_number": seq, **payload})
        seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def item_events(kind: str, i: int, block: Block, delta: str) -> list[bytes]:
        at = {"item_id": ids[i], "output_index": i}
        if kind == START:
            item = output_item(block, ids[i], "in_progress")
            started = [event("response.output_item.added", output_index=i, item=item)]
            if block.kind == TEXT:
                part = {**_part(block), "text": ""}
                started.append(event("response.content_part.added", **at, content_index=0, part=part))
            return started
        if block.kind == TEXT and kind == DELTA:
            return [event("response.output_text.delta", **at, content_index=0, delta=delta, logprobs=[])]
        if kind == DELTA:
            return [event("response.function_call_arguments.delta", **at, delta=delta)]
        status = status_of(blocks.ending) if blocks.ending is not None else "completed"
        if block.kind == TEXT:
            done = [
                event("response.output_text.done", **at, content_index=0, text=block.text, logprobs=[]),
                event("response.content_part.done", **at, content_index=0, part=_part(block)),
            ]
        else:
            args = block.text
            done = [event("response.function_call_arguments.done", **at, name=block.name, arguments=args)]
        item = output_item(block, ids[i], status)
        return [*done, event("response.output_item.done", output_index=i, item=item)]

    def chunk(d: ChoiceDelta) -> bytes | None:
        out: list[bytes] = []
        for e in blocks.feed(d):
            if e.kind == START:
                ids.append(item_id(e.block))
            out += item_events(e.kind, e.index, e.block, e.delta)
        return b"".join(out) if out else None

    async def tail() -> list[bytes]:
        resp = await finish(blocks.blocks, ids, blocks.ending or Ending(None, None, False))
        kind = "response.completed" if resp["status"] == "completed" else "response.incomplete"
        return [event(kind, response=resp)]

    def error_event(e: APIError) -> bytes:
        return event("error", code=e.code, message=e.message, param=e.param)

    start = [event("response.created", response=head), event("response.in_progress", response=head)]
    return await chat.run.stream(request, start, chunk, tail, end=b"", error_event=error_event)
