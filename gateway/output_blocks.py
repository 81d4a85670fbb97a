"""A chat choice's output as content blocks (text, function calls), whole or streamed.

The Anthropic Messages and OpenAI Responses APIs answer in blocks (items) rather than in
chat.completion's `content` + `tool_calls`. Both read a choice through this module, and this
module reads it through the chat route's own tool-call handling (gateway/serving_chat.py), so
that every API finds the same calls in the same output. `chat_request` builds the chat
route's request they translate theirs into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from gateway.errors import validation_error
from gateway.generation import ChoiceDelta
from gateway.protocol import ChatCompletionRequest
from gateway.serving_base import ChoiceResult
from gateway.serving_chat import ToolCallStream, split_tool_calls
from gateway.structured import NONE, ToolPlan

TEXT, CALL = "text", "call"
START, DELTA, STOP = "start", "delta", "stop"


def chat_request(**fields: Any) -> ChatCompletionRequest:
    """The chat route's request; what its model refuses is a 400 (rarely: the other APIs' bodies
    are checked by their own models first)."""
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as e:
        raise validation_error(RequestValidationError(e.errors())) from None


@dataclass
class Block:
    kind: str  # TEXT or CALL
    text: str = ""  # the text, or a call's arguments (JSON text)
    call_id: str = ""  # CALL: "call_<hex>"
    name: str = ""  # CALL: the function


@dataclass
class Ending:
    """How a choice ended, in the chat route's terms."""

    finish_reason: str | None  # stop | length | abort
    stop_reason: int | str | None  # the stop string or stop token id that ended it
    called: bool  # it ended in tool calls

    @property
    def stop_string(self) -> str | None:
        return self.stop_reason if isinstance(self.stop_reason, str) else None


def whole_blocks(tools: ToolPlan, r: ChoiceResult) -> tuple[list[Block], Ending]:
    """The blocks of a whole (non-streamed) choice, and how it ended."""
    content, calls = split_tool_calls(tools, "".join(r.text), r.finish_reason)
    blocks = [Block(TEXT, content)] if content else []
    blocks += [Block(CALL, c.arguments, c.id, c.name) for c in calls]
    return blocks, Ending(r.finish_reason, r.stop_reason, bool(calls) and r.finish_reason == "stop")


@dataclass
class BlockEvent:
    kind: str  # START, DELTA or STOP
    index: int  # the block's position in the output
    block: Block  # STOP: whole by then
    delta: str = ""


class BlockStream:
    """One streamed choice's deltas -> block events: a block starts, grows, stops; a block stops
    before the next starts. `ending` is set once the choice finished."""

    def __init__(self, tools: ToolPlan) -> None:
        self.calls = ToolCallStream(tools) if tools.mode != NONE else None
        self.blocks: list[Block] = []
        self.ending: Ending | None = None
        self._open: int | None = None  # the block taking deltas
        self._by_call: dict[int, int] = {}  # the chat delta's tool_calls index -> block index

    def feed(self, d: ChoiceDelta) -> list[BlockEvent]:
        if self.calls is None:
            fields: dict[str, Any] = {"content": d.text} if d.text else {}
            finish = d.finish_reason
        else:
            fields, finish = self.calls.delta(d.text, d.finish_reason)
        events: list[BlockEvent] = []
        if fields.get("content"):
            events += self._text(fields["content"])
        for call in fields.get("tool_calls", []):
            events += self._call(call)
        if d.finish_reason is not None:
            events += self._stop()
            self.ending = Ending(d.finish_reason, d.stop_reason, finish == "tool_calls")
        return events

    def _start(self, block: Block) -> BlockEvent:
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        return BlockEvent(START, self._open, block)

    def _grow(self, index: int, text: str) -> BlockEvent:
        block = self.blocks[index]
        block.text += text
        return BlockEvent(DELTA, index, block, text)

    def _stop(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [BlockEvent(STOP, index, self.blocks[index])]

    def _text(self, text: str) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if self._open is None or self.blocks[self._open].kind != TEXT:
            events += self._stop()
            events.append(self._start(Block(TEXT)))
        assert self._open is not None
        events.append(self._grow(self._open, text))
        return events

    def _call(self, call: dict[str, Any]) -> list[BlockEvent]:
        fn = call.get("function", {})
        events: list[BlockEvent] = []
        if "id" in call:  # a call begins
            events += self._stop()
            events.append(self._start(Block(CALL, "", call["id"], fn.get("name", ""))))
            self._by_call[call["index"]] = len(self.blocks) - 1
        args = fn.get("arguments") or ""
        if args:
            events.append(self._grow(self._by_call[call["index"]], args))
        return events
