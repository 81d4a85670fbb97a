"""tool_choice "required" through the official `openai` client, real SmolLM2 on CPU (#34): with
the default parallel_tool_calls the list of calls ends, and `$defs` / `$ref` tool schemas (what
pydantic writes) work in every tool mode."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest
from pydantic import BaseModel

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Weather in Rome please"}]
# The OpenAI docs' example tool: a free string, which a bare JSON list of calls let the model
# repeat until max_tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get current temperature for a given location.",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string", "description": "City and country"}},
            "required": ["location"],
            "additionalProperties": False,
        },
    },
}


class Place(BaseModel):
    city: str
    country: str | None = None


class Forecast(BaseModel):
    place: Place
    days: int


FORECAST = {
    "type": "function",
    "function": {"name": "get_forecast", "parameters": Forecast.model_json_schema()},
}
pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_with_default_parallel_calls_ends(openai_client, stream):
    kw = dict(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=64, temperature=0
    )
    if not stream:
        c = openai_client.chat.completions.create(**kw).choices[0]
        finish, content, calls = c.finish_reason, c.message.content, c.message.tool_calls or []
        args = [(t.function.name, t.function.arguments) for t in calls]
    else:
        chunks = list(openai_client.chat.completions.create(stream=True, **kw))
        finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason][0]
        content = "".join(c.delta.content or "" for ch in chunks for c in ch.choices) or None
        deltas = [t for ch in chunks for c in ch.choices for t in c.delta.tool_calls or []]
        assert [t.index for t in deltas] == list(range(len(deltas)))  # each call whole, once
        args = [(t.function.name, t.function.arguments) for t in deltas]
    assert finish == "tool_calls" and content is None and args, (finish, content)
    for name, arguments in args:
        assert name == "get_weather"
        jsonschema_rs.validate(WEATHER["function"]["parameters"], json.loads(arguments))


def test_defs_refs_schema_in_every_tool_mode(openai_client):
    schema = FORECAST["function"]["parameters"]
    assert "$defs" in schema
    base = dict(model=MODEL, messages=ASK, tools=[WEATHER, FORECAST], max_tokens=64, temperature=0)
    modes = ["required", {"type": "function", "function": {"name": "get_forecast"}}, "auto"]
    for choice in modes:
        c = openai_client.chat.completions.create(tool_choice=choice, **base).choices[0]
        assert c.finish_reason in ("tool_calls", "stop", "length"), (choice, c)
        if choice != "auto":
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, (choice, c)
        for t in c.message.tool_calls or []:
            if t.function.name == "get_forecast":
                Forecast.model_validate_json(t.function.arguments)
