"""Request bodies of OpenAI's Responses API (`POST /v1/responses`), as pydantic models.

What a local model can serve of it: text input items (messages with input_text / output_text
parts), function calls and their outputs, function tools, `text.format` (json_schema or
json_object), stored responses continued by `previous_response_id`. Built-in tools (web search,
file search, ...), images and files are refused (400); reasoning items a client sends back are
accepted and left out of the prompt. Unknown fields are ignored, as for the chat bodies.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from gateway.protocol import INT32_MAX, Text, _Body

FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # what the chat route's FunctionDefinition takes


class TextPart(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: Text


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[TextPart]


class FunctionCallItem(_Body):
    """A call the model made earlier (sent back by a client that keeps the conversation)."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text = "{}"


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[TextPart]


class ReasoningItem(_Body):
    """An earlier turn's reasoning: not part of the prompt."""

    type: Literal["reasoning"]


def _item_type(value: Any) -> str:
    # An "easy" input message ({"role", "content"}) may leave out its type.
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Body):
    """Responses' flat function tool: name and parameters beside `type`, not under `function`."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Body):
    type: Literal["function"]
    name: Text


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Text = "response"
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(_Body):
    model: Text | None = Field(None, description="served model id; default: the first served model")
    input: Text | list[InputItem]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None
