"""OpenAI's Responses API against the real mesh (SmolLM2 on the CPU), through the official `openai`
client, unchanged but for base_url: create, stream, a function tool round trip, text.format, and
a conversation continued by `previous_response_id` on another gateway process (stored in Redis)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.helpers.gateway_process import extra_gateway
from tests.helpers.redis_server import RedisServer
from tests.integration.test_gateway_openai import metric

MODEL = "SmolLM2-135M-Instruct"
FACT = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def redis_gateways(gateway_mesh, tmp_path_factory):
    """Two more gateway processes of the mesh, their stored responses in one Redis (as deploy/'s
    ACL user, limited to llmesh:* keys)."""
    tmp = tmp_path_factory.mktemp("responses-redis")
    with RedisServer(tmp / "redis", user="llmesh") as redis_server:
        env = {"LLMESH_GATEWAY_RESPONSES_REDIS_URL": redis_server.url}
        sched = gateway_mesh.scheduler.address
        with extra_gateway(sched, tmp / "a.log", env) as a, extra_gateway(sched, tmp / "b.log", env) as b:
            yield a, b


def test_create_and_stream(openai_client, gateway_http):
    kw = {"model": MODEL, "input": FACT, "max_output_tokens": 12, "temperature": 0}
    resp = openai_client.responses.create(**kw, instructions="Answer in one sentence.")
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert resp.status in ("completed", "incomplete") and "Paris" in resp.output_text
    assert resp.output[0].type == "message" and resp.output[0].content[0].type == "output_text"
    assert 1 <= resp.usage.output_tokens <= 12 and resp.usage.input_tokens > 0
    with openai_client.responses.stream(**{**kw, "max_output_tokens": 32}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert (
        final.status == "completed" and "".join(deltas) == final.output_text and "Paris" in final.output_text
    )
    assert openai_client.responses.retrieve(final.id).output_text == final.output_text
    scraped = gateway_http.get("/metrics").text
    assert metric(scraped, "llmesh:http_requests_total", 'route="/v1/responses",status="200"') >= 2
    assert 'method="GET",route="/v1/responses/{response_id}",status="200"' in scraped


def test_function_call_round_trip(openai_client):
    kw = {"model": MODEL, "tools": [WEATHER], "max_output_tokens": 32, "temperature": 0}
    first = openai_client.responses.create(
        **kw, input="What is the weather in Paris?", tool_choice={"type": "function", "name": "get_weather"}
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and first.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)
    # The client runs the function and sends its output back, continuing the stored conversation.
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    answer = openai_client.responses.create(
        **{**kw, "max_output_tokens": 8}, input=[output], previous_response_id=first.id, tool_choice="none"
    )
    assert answer.output_text and answer.previous_response_id == first.id
    # Streamed: the arguments arrive as deltas.
    events = list(
        openai_client.responses.create(
            **kw,
            input="What is the weather in Paris?",
            tool_choice={"type": "function", "name": "get_weather"},
            stream=True,
        )
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == json.loads(events[-1].response.output[0].arguments)
    assert events[-1].type == "response.completed"


def test_text_format_and_errors(openai_client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
    resp = openai_client.responses.create(
        model=MODEL,
        input=FACT,
        max_output_tokens=24,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
    )
    assert set(json.loads(resp.output_text)) == {"city"}
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.responses.create(
            model=MODEL, input="x", text={"format": {"type": "json_schema", "name": "x"}}
        )
    assert e.value.body["param"] == "text.format.schema"


def test_continued_on_another_gateway_process(redis_gateways):
    a, b = (_client(url) for url in redis_gateways)
    first = a.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8, temperature=0)
    assert b.responses.retrieve(first.id).output_text == first.output_text
    later = b.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    assert later.previous_response_id == first.id and later.output_text
    # The conversation B continued holds A's turn: both ends of it are stored.
    assert later.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    b.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(first.id)
