"""Request bodies of Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`).

What a local model can serve of it: text, tool use and tool results, tools and tool_choice,
stop sequences, structured outputs (`output_config.format`), the sampling knobs (which Anthropic's
SDK 2.x sends only through `extra_body`). Images and documents are refused (400); thinking
blocks an earlier turn may carry back are accepted and left out of the prompt. Unknown fields
are ignored, as for the OpenAI bodies (gateway/protocol.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from gateway.protocol import INT32_MAX, Text, _Body

TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # what the chat route's FunctionDefinition takes


class TextBlock(_Body):
    type: Literal["text"]
    text: Text


class ToolUseBlock(_Body):
    """An assistant's earlier call."""

    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Body):
    """A user turn's answer to a call."""

    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(_Body):
    """An earlier turn's thinking, sent back by clients that keep it: not part of the prompt."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]


class ToolDefinition(_Body):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: Text | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    # Anthropic's own server tools (web search, bash, ...) carry a versioned type: not served here.
    type: Literal["custom"] | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None  # type "tool"
    disable_parallel_tool_use: bool = False


class OutputFormat(_Body):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(_Body):
    """Structured outputs: the reply is JSON valid against `format.schema` (`effort` is ignored)."""

    format: OutputFormat | None = None


class Metadata(_Body):
    user_id: Text | None = None


class CountTokensRequest(_Body):
    """`/v1/messages/count_tokens`: the prompt part of a Messages request."""

    model: Text | None = Field(None, description="served model id; default: the first served model")
    system: Text | list[TextBlock] | None = None
    messages: list[Message] = Field(..., min_length=1)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(..., ge=1, le=INT32_MAX)
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    stream: bool = False
