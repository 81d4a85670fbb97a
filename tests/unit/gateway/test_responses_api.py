"""OpenAI's Responses API (gateway/serving_responses.py) against the in-process fake scheduler:
the translation to the chat route, output items, events, stored responses, through the official
`openai` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gateway.protocol_responses import ResponsesRequest
from gateway.serving_responses import input_messages, to_chat
from tests.unit.gateway.conftest import FakeScheduler

CALL_TEXT = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def sdk(h, api_key: str = "unused") -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=h.client._transport.app))
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=api_key, http_client=http, max_retries=0)


def test_translation_to_the_chat_route():
    req = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city":"Paris"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "9C"},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "So?"}]},
            ],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 9,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        }
    )
    chat = to_chat(req, input_messages(req.input))
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[2].tool_calls[0].id == "call_1" and chat.messages[3].tool_call_id == "call_1"
    assert chat.tools[0].function.name == "get_weather" and chat.tool_choice.function.name == "get_weather"
    assert chat.max_tokens == 9 and chat.response_format.json_schema.json_schema == {"type": "object"}


async def test_create_stream_retrieve_continue_delete(gateway):
    client = sdk(gateway)
    resp = await client.responses.create(model="fake-model", input="q", max_output_tokens=3)
    assert resp.id.startswith("resp_") and resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == " Paris is the" and resp.usage.output_tokens == 3
    assert (await client.responses.retrieve(resp.id)).output_text == resp.output_text
    # previous_response_id: the stored conversation, then the new input.
    later = await client.responses.create(
        model="fake-model", input="again", previous_response_id=resp.id, max_output_tokens=2
    )
    sent = gateway.fake.requests[-1].prompt_token_ids.ids
    assert len(sent) > len(gateway.fake.requests[0].prompt_token_ids.ids)
    assert later.previous_response_id == resp.id
    await client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="fake-model", input="x", previous_response_id=resp.id)
    # Streamed: the events a client accumulates into the same response.
    stream = await client.responses.create(model="fake-model", input="q", max_output_tokens=3, stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == " Paris is the" == events[-1].response.output_text
    stored = await client.responses.retrieve(events[-1].response.id)
    assert stored.output_text == text
    unstored = await client.responses.create(model="fake-model", input="q", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


async def test_function_call_whole_and_streamed(make_gateway, tokenizer):
    h = await make_gateway(FakeScheduler(reply=tokenizer.encode(CALL_TEXT), max_model_len=1024))
    client = sdk(h)
    kw = {"model": "fake-model", "input": "Weather in Paris?", "tools": [WEATHER], "max_output_tokens": 60}
    resp = await client.responses.create(**kw)
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    # The client answers the call; the conversation continues from the stored one.
    out = {"type": "function_call_output", "call_id": call.call_id, "output": "9C"}
    await client.responses.create(**{**kw, "input": [out]}, previous_response_id=resp.id)
    prompt = tokenizer.decode(list(h.fake.requests[-1].prompt_token_ids.ids))
    assert "get_weather" in prompt and "9C" in prompt and "Weather in Paris?" in prompt
    # Streamed (the fake ends every choice at max tokens: response.incomplete, not .completed).
    events = [e async for e in await client.responses.create(**kw, stream=True)]
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert json.loads(events[3].delta) == {"city": "Paris"} and events[4].name == "get_weather"
    assert events[-1].response.output[0].call_id == events[2].item.call_id


async def test_errors_and_tenants(make_gateway):
    h = await make_gateway(FakeScheduler(reply=[1]), api_key="k1,k2")
    a, b = sdk(h, "k1"), sdk(h, "k2")
    with pytest.raises(openai.BadRequestError) as e:
        await a.responses.create(model="fake-model", input="q", max_output_tokens=0)
    assert e.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        await a.responses.create(
            model="fake-model", input="q", text={"format": {"type": "json_schema", "name": "x"}}
        )
    assert e.value.body["param"] == "text.format.schema"
    resp = await a.responses.create(model="fake-model", input="q", max_output_tokens=1)
    assert (await a.responses.retrieve(resp.id)).id == resp.id
    with pytest.raises(openai.NotFoundError):  # another tenant's key finds nothing
        await b.responses.retrieve(resp.id)
