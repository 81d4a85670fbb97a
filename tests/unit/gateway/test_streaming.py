"""Streaming fast paths: prebuilt SSE frames say what the generic events say; responses that
pile up while the reader is behind come out as one delta; orjson responses."""

from __future__ import annotations

import asyncio
import json

from gateway.generation import Generation
from gateway.streaming import dumps, sse
from llmesh.v1 import generation_pb2 as g
from services.sampling_params import SamplingParams
from tests.unit.gateway.conftest import REPLY, FakeScheduler

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
NAME = 'my "model" ü/1'  # quotes and non-ASCII in the prebuilt frames


def events(text: str) -> list[dict]:
    lines = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(e) for e in lines[:-1]]


async def test_text_events_have_the_generic_shape(make_gateway, tokenizer):
    h = await make_gateway(FakeScheduler(reply=tokenizer.encode(REPLY)), served_model_name=[NAME])
    body = {"model": NAME, "prompt": "x", "max_tokens": 6, "stream": True, "n": 2}
    evs = events((await h.client.post(COMP, json=body)).text)
    for e in evs:
        assert list(e) == ["id", "object", "created", "model", "choices"] and e["model"] == NAME
        assert e["object"] == "text_completion" and e["id"].startswith("cmpl-")
        (c,) = e["choices"]
        assert list(c) == ["index", "text", "logprobs", "finish_reason", "stop_reason"]
    for i in (0, 1):
        assert "".join(e["choices"][0]["text"] for e in evs if e["choices"][0]["index"] == i) == (
            " Paris is the capital of France"
        )
    body = {"model": NAME, "messages": [{"role": "user", "content": "q"}], "max_tokens": 4, "stream": True}
    evs = events((await h.client.post(CHAT, json=body)).text)
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for e in evs[1:-1]:
        assert e["model"] == NAME and e["object"] == "chat.completion.chunk"
        (c,) = e["choices"]
        assert c == {"index": 0, "delta": {"content": c["delta"]["content"]}, "logprobs": None,
                     "finish_reason": None}  # fmt: skip
    assert evs[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in evs) == " Paris is the capital"


async def test_non_streaming_body_is_orjson_and_equal(gateway):
    r = await gateway.client.post(COMP, json={"prompt": "x", "max_tokens": 3})
    assert r.headers["content-type"] == "application/json"
    assert r.json()["choices"][0]["text"] == " Paris is the"
    assert dumps({"a": 'é\n"', "b": [1, None, 2.5]}) == b'{"a":"\xc3\xa9\\n\\"","b":[1,null,2.5]}'
    assert sse({"x": 2**70}) == b'data: {"x":1180591620717411303424}\n\n'  # beyond orjson's ints


class _Call:
    """A Generate call whose responses are all there at once (a reader far behind)."""

    def __init__(self, resps: list[g.GenerateResponse]) -> None:
        self.resps = resps
        self.cancelled = False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for r in self.resps:
            yield r

    def cancel(self) -> None:
        self.cancelled = True


class _Client:
    address = "fake"

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def generate(self, request, timeout):
        resps = [g.GenerateResponse(token_ids=[t]) for t in self.ids]
        resps[-1].finish_reason = g.FINISH_REASON_LENGTH
        return _Call(resps)


async def test_pending_responses_come_out_as_one_delta_per_choice(tokenizer):
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    gen = Generation(
        _Client(ids), tokenizer, [1, 2], SamplingParams(n=2, max_tokens=len(ids)), model="m", timeout=5
    )
    batches = [b async for b in gen.stream()]
    assert len(batches) == 1  # everything was pending: one batch, one delta per choice
    (batch,) = batches
    assert sorted(d.index for d in batch) == [0, 1]
    for d in batch:
        assert d.text == REPLY and d.token_ids == ids and d.finish_reason == "length"
    assert gen.completion_tokens == 2 * len(ids)
    await asyncio.sleep(0)
