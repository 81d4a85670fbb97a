"""Anthropic's Messages API against the real mesh (SmolLM2 on the CPU), through the official
`anthropic` SDK, unchanged but for base_url: create, stream, a tool round trip, count_tokens,
Anthropic's error shape, and x-api-key on a gateway with an API key."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.gateway_process import extra_gateway
from tests.integration.test_gateway_openai import metric

anthropic = pytest.importorskip("anthropic")

MODEL = "SmolLM2-135M-Instruct"
FACT = [{"role": "user", "content": "What is the capital of France?"}]
KEY = "sk-ant-test-1"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(gateway_url):
    return anthropic.Anthropic(base_url=gateway_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def keyed_gateway(gateway_mesh, tmp_path_factory):
    """A second gateway of the same mesh, with an API key."""
    log = tmp_path_factory.mktemp("keyed-gateway") / "gateway.log"
    with extra_gateway(gateway_mesh.scheduler.address, log, env={"LLMESH_API_KEY": KEY}) as url:
        yield url


def test_create_stream_and_count_tokens(client, gateway_http):
    # Anthropic's SDK 2.x sends sampling knobs only as extra_body.
    kw = {"model": MODEL, "max_tokens": 12, "messages": FACT, "extra_body": {"temperature": 0}}
    msg = client.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    (block,) = msg.content
    assert block.type == "text" and "Paris" in block.text
    assert msg.stop_reason in ("end_turn", "max_tokens") and 1 <= msg.usage.output_tokens <= 12
    prompt = client.messages.count_tokens(model=MODEL, messages=FACT).input_tokens
    assert prompt == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text == final.content[0].text
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens == msg.usage.output_tokens
    scraped = gateway_http.get("/metrics").text
    assert metric(scraped, "llmesh:http_requests_total", 'route="/v1/messages",status="200"') >= 2
    assert metric(scraped, "llmesh:http_requests_total", 'route="/v1/messages/count_tokens"') >= 1


def test_tool_use_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = {"model": MODEL, "max_tokens": 32, "tools": [WEATHER], "extra_body": {"temperature": 0}}
    with client.messages.stream(**kw, messages=ask, tool_choice={"type": "tool", "name": "get_weather"}) as s:
        kinds = {e.type for e in s}
        msg = s.get_final_message()
    assert "content_block_delta" in kinds  # input_json_delta events, accumulated by the SDK
    assert msg.stop_reason == "tool_use"
    (call,) = msg.content
    assert call.type == "tool_use" and call.name == "get_weather" and isinstance(call.input.get("city"), str)
    # The client runs the tool and sends its result back; the model answers in text.
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"}
    turns = [*ask, {"role": "assistant", "content": msg.content}, {"role": "user", "content": [result]}]
    answer = client.messages.create(**{**kw, "max_tokens": 8}, messages=turns, tool_choice={"type": "none"})
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_structured_output(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
    msg = client.messages.create(
        model=MODEL,
        max_tokens=24,
        messages=FACT,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"temperature": 0},
    )
    assert msg.stop_reason == "end_turn"
    assert set(json.loads(msg.content[0].text)) == {"city"}


def test_errors_in_anthropics_shape(client, gateway_http):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=FACT, extra_body={"temperature": 1.5})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("temperature")
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=4, messages=FACT)
    assert e.value.body["error"]["type"] == "not_found_error"
    r = gateway_http.post("/v1/messages", json={"model": MODEL, "messages": FACT})  # no max_tokens
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens")


def test_x_api_key(keyed_gateway):
    ok = anthropic.Anthropic(base_url=keyed_gateway, api_key=KEY, max_retries=0, timeout=120)
    assert ok.messages.create(model=MODEL, max_tokens=2, messages=FACT).usage.output_tokens >= 1
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=keyed_gateway, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=FACT
        )
    assert e.value.body["error"]["type"] == "authentication_error"
    assert httpx.get(f"{keyed_gateway}/v1/models", headers={"x-api-key": KEY}).status_code == 200
