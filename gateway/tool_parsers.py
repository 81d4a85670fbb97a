"""Tool calls out of model text: `<tool_call>` blocks (Hermes/Qwen and SmolLM2) and forced JSON.

Formats read:
- Hermes / Qwen 2.5: one JSON object per block,
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- SmolLM2 (its function-calling prompt): one block holding a JSON list of such objects,
  `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`;
- tool_choice "required": the whole output is such a JSON list (held to it by a grammar), in
  `<tool_call>` tags when the model was shown them;
- a named tool_choice: the whole output is the arguments object.

A block whose JSON does not parse, or names no function, stays in the content as text: the
caller sees what the model wrote rather than losing it. `"parameters"` is accepted for
`"arguments"` (some models write it).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _calls_of(value: Any, names: set[str] | None) -> list[ParsedToolCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        if names is not None and item["name"] not in names:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        calls.append(ParsedToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls


def parse_tool_calls(text: str, names: set[str] | None = None) -> tuple[str, list[ParsedToolCall]]:
    """(content left, tool calls) of a tool_choice "auto" output. `names`: the known functions;
    a call of another name is left as text."""
    if TOOL_CALL_START not in text:
        return text, []
    calls: list[ParsedToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        kept.append(text[pos : m.start()])
        pos = m.end()
        try:
            parsed = _calls_of(json.loads(m.group(1).strip()), names)
        except ValueError:
            parsed = None
        if parsed is None:
            kept.append(m.group(0))
        else:
            calls.extend(parsed)
    kept.append(text[pos:])
    return "".join(kept).strip() if calls else text, calls


def parse_required(text: str) -> list[ParsedToolCall]:
    """tool_choice "required": the output is a JSON list of calls, in `<tool_call>` tags or bare
    (gateway/structured.py). Every whole call is read, also from output cut by max_tokens
    (vLLM returns none of these); text that does not start a list has none."""
    body = text.strip()
    if body.startswith(TOOL_CALL_START):
        body = body[len(TOOL_CALL_START) :].lstrip()
    if not body.startswith("["):
        return []
    decoder = json.JSONDecoder()
    calls: list[ParsedToolCall] = []
    pos = 1
    while True:
        pos = _skip_space(body, pos)
        try:
            item, pos = decoder.raw_decode(body, pos)
        except ValueError:  # the end of the list, or a call cut short
            return calls
        parsed = _calls_of(item, None) if isinstance(item, dict) else None
        if parsed is None:
            return calls
        calls.extend(parsed)
        pos = _skip_space(body, pos)
        if body[pos : pos + 1] != ",":
            return calls
        pos += 1


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


class AutoToolStream:
    """Streaming for tool_choice "auto": content passes through until a `<tool_call>` may begin;
    from there the text is held and parsed when the choice ends."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self._held = ""
        self._in_call = False

    def feed(self, text: str) -> str:
        """Content that can go out now."""
        if self._in_call:
            self._held += text
            return ""
        buf = self._held + text
        start = buf.find(TOOL_CALL_START)
        if start >= 0:
            self._in_call = True
            self._held = buf[start:]
            return buf[:start]
        # Hold back a tail that could be the start of "<tool_call>".
        keep = 0
        for k in range(min(len(TOOL_CALL_START) - 1, len(buf)), 0, -1):
            if TOOL_CALL_START.startswith(buf[-k:]):
                keep = k
                break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """(content still to send, tool calls) once the choice ended."""
        held, self._held = self._held, ""
        if not self._in_call:
            return held, []
        return parse_tool_calls(held, self.names)
