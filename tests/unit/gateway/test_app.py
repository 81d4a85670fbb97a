"""The gateway app against an in-process fake scheduler: what it sends upstream, how it maps failures."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from tests.unit.gateway.conftest import MODEL, REPLY, FakeScheduler, start_fake

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


async def test_n_fans_out_with_seeds_and_keeps_stop_strings(gateway, tokenizer):
    body = {"prompt": "Where?", "n": 2, "seed": 5, "temperature": 0.7, "max_tokens": 4, "stop": ["zzz"]}
    r = await gateway.client.post(COMP, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"] == {
        "prompt_tokens": len(tokenizer.encode("Where?")),
        "completion_tokens": 8,
        "total_tokens": len(tokenizer.encode("Where?")) + 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    reqs = gateway.fake.requests
    assert len(reqs) == 2
    assert sorted(r.sampling_params.seed for r in reqs) == [5, 6]
    for req in reqs:
        sp = req.sampling_params
        assert sp.n == 1 and list(sp.stop) == []  # stop strings are matched in the gateway
        assert sp.temperature == pytest.approx(0.7) and sp.max_tokens == 4
        assert list(req.prompt_token_ids.ids) == tokenizer.encode("Where?")
        assert req.model == MODEL


async def test_stop_string_cancels_its_call(make_gateway, tokenizer):
    h = await make_gateway(FakeScheduler(reply=tokenizer.encode(REPLY), delay_s=0.01))
    r = await h.client.post(COMP, json={"prompt": "x", "max_tokens": 20, "stop": "capital"})
    choice = r.json()["choices"][0]
    assert choice["text"] == " Paris is the " and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "capital"
    for _ in range(100):
        if h.fake.cancelled:
            break
        await asyncio.sleep(0.01)
    assert h.fake.cancelled == [h.fake.requests[0].request_id] and not h.fake.finished


async def test_chat_renders_the_template(gateway, hf_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
    ]
    r = await gateway.client.post(CHAT, json={"messages": messages, "max_tokens": 3})
    assert r.status_code == 200, r.text
    flat = [messages[0], {"role": "user", "content": "Hi\nthere"}]
    text = hf_tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    sent = list(gateway.fake.requests[0].prompt_token_ids.ids)
    assert sent == hf_tokenizer.encode(text, add_special_tokens=False)
    assert r.json()["choices"][0]["message"]["content"] == " Paris is the"


async def test_logprobs_shapes(gateway):
    r = await gateway.client.post(CHAT, json={"messages": [{"role": "user", "content": "q"}], "max_tokens": 2,
                                             "logprobs": True, "top_logprobs": 2})  # fmt: skip
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and content[0]["token"] == " Paris" and len(content[0]["top_logprobs"]) == 2
    assert bytes(content[0]["bytes"]) == b" Paris"
    assert gateway.fake.requests[0].sampling_params.logprobs == 2
    r = await gateway.client.post(COMP, json={"prompt": "q", "max_tokens": 2, "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [" Paris", " is"] and lp["text_offset"] == [0, 6]
    assert lp["top_logprobs"][0] == {" Paris": -0.5}


async def test_stream_with_usage(gateway):
    body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    r = await gateway.client.post(CHAT, json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        == " Paris is the"
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    "code, message, status, param",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1], got 2", 400, "top_p"),
        (grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: ids outside the vocabulary", 400, "prompt"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", 429, None),
        (grpc.StatusCode.UNAVAILABLE, "no worker is ready", 503, None),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "too slow", 504, None),
        (grpc.StatusCode.INTERNAL, "bug", 500, None),  # the scheduler's fault, not the input's
    ],
)
async def test_scheduler_errors_map_to_http(make_gateway, tokenizer, code, message, status, param):
    h = await make_gateway(FakeScheduler(reply=tokenizer.encode(REPLY), fail=(code, message)))
    for stream in (False, True):
        r = await h.client.post(COMP, json={"prompt": "x", "stream": stream})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"]


async def test_failure_mid_stream_is_an_error_event(make_gateway, tokenizer):
    fake = FakeScheduler(
        reply=tokenizer.encode(REPLY), fail=(grpc.StatusCode.UNAVAILABLE, "gone"), fail_after=2
    )
    h = await make_gateway(fake)
    r = await h.client.post(COMP, json={"prompt": "x", "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert "gone" in err["message"] and err["code"] == "service_unavailable"


async def test_api_key(make_gateway, tokenizer):
    h = await make_gateway(FakeScheduler(reply=[1]), api_key="secret")
    assert (await h.client.get("/health")).status_code == 200
    r = await h.client.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    assert (await h.client.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status_code == 401
    assert (await h.client.get("/v1/models", headers={"Authorization": "Basic secret"})).status_code == 401
    assert (await h.client.get("/v1/models", headers={"Authorization": "Bearer secret"})).status_code == 200


async def test_body_type_and_size(make_gateway):
    h = await make_gateway(FakeScheduler(reply=[1]), max_body_bytes=200)
    r = await h.client.post(COMP, json={"prompt": "x" * 300})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = await h.client.post(COMP, content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = await h.client.post(
        COMP, content=b'{"prompt": "x"}', headers={"content-type": "application/json; charset=utf-8"}
    )
    assert r.status_code == 200


async def test_served_model_names(make_gateway):
    h = await make_gateway(FakeScheduler(reply=[1]), served_model_name=["alias", "other"])
    ids = [m["id"] for m in (await h.client.get("/v1/models")).json()["data"]]
    assert ids == ["alias", "other"]
    r = await h.client.post(COMP, json={"prompt": "x", "model": "other"})
    assert r.status_code == 200 and r.json()["model"] == "other"
    assert h.fake.requests[0].model == MODEL  # the scheduler's own id upstream
    assert (await h.client.post(COMP, json={"prompt": "x", "model": MODEL})).status_code == 404


async def test_context_length_of_the_model(make_gateway):
    h = await make_gateway(FakeScheduler(reply=[1], max_model_len=64))
    r = await h.client.post(COMP, json={"prompt": [5] * 60, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = await h.client.post(COMP, json={"prompt": [5] * 60, "max_tokens": 4})
    assert r.status_code == 200
    r = await h.client.post(CHAT, json={"messages": [{"role": "user", "content": "x " * 60}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


async def test_metrics(gateway):
    await gateway.client.post(COMP, json={"prompt": "x", "max_tokens": 3})
    text = (await gateway.client.get("/metrics")).text
    assert 'llmesh:http_requests_total{method="POST",route="/v1/completions",status="200"} 1.0' in text
    assert 'llmesh:generation_tokens_total{model_name="fake-model"} 3.0' in text
    assert 'llmesh:time_to_first_token_seconds_count{model_name="fake-model"} 1.0' in text
    assert 'llmesh:inter_token_latency_seconds_count{model_name="fake-model"} 2.0' in text
    assert 'llmesh:request_success_total{finished_reason="length",model_name="fake-model"} 1.0' in text
    assert 'llmesh:kv_cache_free_blocks{worker="w0"} 10.0' in text
    assert "llmesh:scheduler_up 1.0" in text


async def test_scheduler_loss_and_recovery(gateway, tokenizer):
    assert (await gateway.client.get("/health")).status_code == 200
    await gateway.server.stop(0)
    r = await gateway.client.get("/health")
    assert r.status_code == 503 and "unavailable" in r.json()["error"]["message"]
    r = await gateway.client.post(COMP, json={"prompt": "x"})
    assert r.status_code == 503 and gateway.address in r.json()["error"]["message"]
    assert "llmesh:scheduler_up 0.0" in (await gateway.client.get("/metrics")).text
    port = int(gateway.address.rsplit(":", 1)[1])
    gateway.server, _ = await start_fake(FakeScheduler(reply=tokenizer.encode(REPLY)), port)
    for _ in range(100):
        if (await gateway.client.get("/health")).status_code == 200:
            break
        await asyncio.sleep(0.1)
    assert (await gateway.client.post(COMP, json={"prompt": "x"})).status_code == 200
