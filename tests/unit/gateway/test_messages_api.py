"""Anthropic's Messages API (gateway/serving_messages.py) against the in-process fake scheduler:
the translation to the chat route, the reply and its events, through the official `anthropic` SDK."""

from __future__ import annotations

import json

import pytest

from gateway.output_blocks import Ending
from gateway.protocol_anthropic import MessagesRequest
from gateway.serving_messages import stop_reason, to_chat
from tests.unit.gateway.conftest import FakeScheduler

anthropic = pytest.importorskip("anthropic")

CALL_TEXT = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>END'
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def sdk(h, api_key: str = "unused") -> anthropic.AsyncAnthropic:
    import httpx2  # the SDK's own httpx

    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=h.client._transport.app))
    return anthropic.AsyncAnthropic(
        base_url="http://gateway", api_key=api_key, http_client=http, max_retries=0
    )


def test_translation_to_the_chat_route():
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["\n\n"],
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            "metadata": {"user_id": "u1"},
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "x"},
                        {"type": "text", "text": "Let me look."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "9C"}],
                        },
                        {"type": "text", "text": "And so?"},
                    ],
                },
            ],
        }
    )
    chat = to_chat(req)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be brief."
    assert chat.messages[2].content == "Let me look."
    (call,) = chat.messages[2].tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "toolu_1",
        "get_weather",
        {"city": "Paris"},
    )
    assert chat.messages[3].tool_call_id == "toolu_1" and chat.messages[3].content == "9C"
    assert chat.tools[0].function.parameters == WEATHER["input_schema"]
    assert chat.tool_choice.function.name == "get_weather" and chat.parallel_tool_calls is False
    assert (chat.stop, chat.max_tokens, chat.user) == (["\n\n"], 8, "u1")
    assert chat.add_generation_prompt and not chat.continue_final_message
    # A last assistant turn is a prefill: the reply continues it.
    prefill = to_chat(
        MessagesRequest.model_validate(
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
            }
        )
    )
    assert prefill.continue_final_message and not prefill.add_generation_prompt


@pytest.mark.parametrize(
    "ending, stops, expected",
    [
        (Ending("stop", None, True), None, ("tool_use", None)),
        (Ending("length", None, False), None, ("max_tokens", None)),
        (Ending("stop", "##", False), ["##"], ("stop_sequence", "##")),
        (Ending("stop", 2, False), ["##"], ("end_turn", None)),
    ],
)
def test_stop_reasons(ending, stops, expected):
    assert stop_reason(ending, stops) == expected


async def test_create_and_stream(gateway):
    client = sdk(gateway)
    kw = {"model": "fake-model", "max_tokens": 3, "messages": [{"role": "user", "content": "q"}]}
    msg = await client.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].text == " Paris is the" and msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 3 and msg.usage.input_tokens > 0
    async with client.messages.stream(**kw) as stream:
        kinds = [e.type async for e in stream]
        final = await stream.get_final_message()
    assert final.content[0].text == " Paris is the" and final.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    count = await client.messages.count_tokens(model="fake-model", messages=kw["messages"])
    assert count.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


async def test_tool_use_whole_and_streamed(make_gateway, tokenizer):
    h = await make_gateway(FakeScheduler(reply=tokenizer.encode(CALL_TEXT), max_model_len=1024))
    client = sdk(h)
    kw = {
        "model": "fake-model",
        "max_tokens": 60,
        "tools": [WEATHER],
        "stop_sequences": ["END"],
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
    }
    msg = await client.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    (block,) = msg.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"}
    assert block.id.startswith("toolu_")
    async with client.messages.stream(**kw) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == {"city": "Paris"}


async def test_errors_take_anthropics_shape(make_gateway):
    h = await make_gateway(FakeScheduler(reply=[1]), api_key="secret")
    r = await h.client.post("/v1/messages", json={"messages": []}, headers={"x-api-key": "secret"})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    r = await h.client.post(
        "/v1/messages", json={"max_tokens": 1, "messages": [{"role": "user", "content": "q"}]}
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # x-api-key opens the OpenAI routes too; their errors keep OpenAI's shape.
    assert (await h.client.get("/v1/models", headers={"x-api-key": "secret"})).status_code == 200
    assert (await h.client.get("/v1/models", headers={"x-api-key": "wrong"})).status_code == 401
    assert (
        "error"
        in (await h.client.post("/v1/chat/completions", json={}, headers={"x-api-key": "secret"})).json()
    )
    with pytest.raises(anthropic.BadRequestError) as e:
        await sdk(h, "secret").messages.create(
            model="fake-model", max_tokens=1, messages=[{"role": "user", "content": "q"}], stop_sequences=[""]
        )
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("stop_sequences")


async def test_raw_events(gateway):
    body = {"max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "q"}]}
    r = await gateway.client.post("/v1/messages", json=body)
    names = [line[7:] for line in r.text.split("\n") if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names  # each event's name is its data's type; no [DONE]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert datas[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert datas[-2]["usage"]["output_tokens"] == 3
