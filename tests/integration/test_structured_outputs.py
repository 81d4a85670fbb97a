"""Structured outputs and tool calls through the official `openai` client, real SmolLM2 on CPU.

Every schema's output must validate (jsonschema_rs), streamed and not; the 20 schemas run
concurrently so that the mesh batches them.
"""

from __future__ import annotations

import json
import pathlib
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema_rs
import pytest

SCHEMAS = json.loads((pathlib.Path(__file__).parents[1] / "data" / "structured_schemas.json").read_text())
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Give me an example as JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 12}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOL_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _schema_text(client, i: int, schema: dict, stream: bool) -> tuple[str, str]:
    kw = dict(
        model=MODEL,
        messages=ASK,
        max_tokens=96,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
        },
    )
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        return c.message.content, c.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_twenty_json_schemas_all_valid(openai_client, stream):
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        outs = list(pool.map(lambda a: _schema_text(openai_client, *a, stream), enumerate(SCHEMAS)))
    for schema, (text, finish) in zip(SCHEMAS, outs, strict=True):
        assert finish == "stop", (schema, text)
        jsonschema_rs.validate(schema, json.loads(text))


def test_json_object_regex_choice_completions_and_chat(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=64, temperature=0, response_format={"type": "json_object"}
    )
    # Any object: nothing bounds its strings, and a 135M model may repeat itself until
    # max_tokens; what ended by itself is a whole object.
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.finish_reason == "length" and c.message.content.startswith("{")
    r = openai_client.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=16,
        temperature=0.7,
        n=3,
        seed=3,
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
    )
    assert all(re.fullmatch(r"\d{3}-\d{4}", c.text) for c in r.choices), [c.text for c in r.choices]
    r = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert r.choices[0].message.content in ("yes", "no")
    r = openai_client.completions.create(
        model=MODEL,
        prompt="Answer:",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": 'start: "a" ("b" | "c")'}},
    )
    assert r.choices[0].text in ("ab", "ac")


def test_named_and_required_tool_choice(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL,
        messages=TOOL_ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
        temperature=0,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema_rs.validate(WEATHER["function"]["parameters"], json.loads(call.function.arguments))

    r = openai_client.chat.completions.create(
        model=MODEL,
        messages=TOOL_ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema_rs.validate(tool["function"]["parameters"], json.loads(call.function.arguments))

    # Streamed, named: the first delta names the call, later ones add argument text.
    chunks = list(
        openai_client.chat.completions.create(
            model=MODEL,
            messages=TOOL_ASK,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=48,
            temperature=0,
            stream=True,
        )
    )
    deltas = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    args = "".join(d.function.arguments or "" for d in deltas)
    jsonschema_rs.validate(WEATHER["function"]["parameters"], json.loads(args))
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["tool_calls"]


def test_auto_tool_choice_answers(openai_client):
    """The small model may or may not call: either way the answer is well formed."""
    r = openai_client.chat.completions.create(
        model=MODEL, messages=TOOL_ASK, tools=[WEATHER], max_tokens=48, temperature=0
    )
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        assert all(t.function.name == "get_weather" for t in c.message.tool_calls)
    else:
        assert c.message.content and c.finish_reason in ("stop", "length")


def _err(gateway_http, path: str, body: dict) -> dict:
    r = gateway_http.post(path, json=body)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_bad_specs_are_400(gateway_http):
    chat = "/v1/chat/completions"
    msgs = {"messages": ASK, "max_tokens": 4}

    def rf(schema):
        return {
            **msgs,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        }

    assert _err(gateway_http, chat, rf({"type": "foo"}))["param"] == "response_format.json_schema.schema"
    assert "not" in _err(gateway_http, chat, rf({"not": {"type": "string"}}))["message"]
    assert _err(gateway_http, chat, rf({"type": "integer", "minimum": 5, "maximum": 1}))["param"].startswith(
        "response_format"
    )
    e = _err(gateway_http, "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(("}})
    assert e["param"] == "structured_outputs.regex"
    e = _err(gateway_http, "/v1/completions", {"prompt": "x", "guided_grammar": "start: nothing_here"})
    assert e["param"] == "guided_grammar"
    e = _err(
        gateway_http,
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
    )
    assert e["param"] == "structured_outputs"
    e = _err(gateway_http, "/v1/completions", {"prompt": "x", "guided_choice": []})
    assert e["param"] == "guided_choice"
    e = _err(gateway_http, "/v1/completions", {"prompt": "x", "guided_regex": "a" * 70000})
    assert e["param"] == "guided_regex"
    body = {**msgs, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    assert _err(gateway_http, chat, body)["param"] == "tool_choice"
    assert _err(gateway_http, chat, {**msgs, "tool_choice": "required"})["param"] == "tool_choice"
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}
    assert _err(gateway_http, chat, {**msgs, "tools": [bad_tool]})["param"] == "tools[0].function.parameters"
    body = {**msgs, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}
    assert _err(gateway_http, chat, body)["param"] == "tool_choice"
    # The service is still up and answering.
    assert gateway_http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
