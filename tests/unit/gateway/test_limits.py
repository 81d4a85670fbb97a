"""Careless and hostile callers: caps on one request, over-long prompts refused before tokenizing
(by /tokenize and /detokenize too), large prompts tokenized off the event loop, a batch's prompts
in flight a few at a time."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from services.limits import INLINE_TOKENIZE_CHARS, RequestLimits
from tests.unit.gateway.conftest import REPLY, FakeScheduler

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
BIG = "hello world, this is a test. " * 170_000  # ~4.9 MB: 1.36M tokens, seconds to tokenize


def error(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def record_encodes(monkeypatch, tokenizer) -> list[tuple[int, str]]:
    """(characters, thread name) of every encode the gateway's tokenizer runs."""
    calls: list[tuple[int, str]] = []
    encode = tokenizer.encode

    def spy(text: str, add_special_tokens: bool = True) -> list[int]:
        calls.append((len(text), threading.current_thread().name))
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", spy)
    return calls


async def test_limits_of_the_served_model(make_gateway):
    h = await make_gateway(FakeScheduler(reply=[1], max_model_len=64), max_stop_token_ids=3, max_logprobs=50)
    limits = h.state.limits()
    assert isinstance(limits.caps, RequestLimits) and limits.caps.max_stop_token_ids == 3
    assert limits.caps.max_logprobs == 20  # lowered to what the scheduler allows
    longest = h.state.served().tokenizer.longest_token_chars
    assert longest > 1 and limits.prompt_chars == 64 * longest


@pytest.mark.parametrize("path", [COMP, CHAT])
async def test_over_long_text_is_refused_without_tokenizing(make_gateway, monkeypatch, path):
    h = await make_gateway(FakeScheduler(reply=[1], max_model_len=64))
    calls = record_encodes(monkeypatch, h.state.served().tokenizer)
    if path == COMP:
        body, param = {"prompt": BIG}, "prompt"
    else:
        parts = [{"type": "text", "text": BIG[:3000]}, {"type": "text", "text": BIG[:3000]}]
        body, param = (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": parts}]},
            "messages",
        )
    start = time.perf_counter()
    err = error(await h.client.post(path, json=body))
    took = time.perf_counter() - start
    assert err["param"] == param and err["code"] == "context_length_exceeded"
    assert "characters" in err["message"]
    assert calls == [] and h.fake.requests == []
    assert took < 1.0, f"{took:.2f} s to refuse"


async def test_batch_is_checked_whole_before_any_tokenizing(make_gateway, monkeypatch):
    h = await make_gateway(FakeScheduler(reply=[1], max_model_len=64))
    calls = record_encodes(monkeypatch, h.state.served().tokenizer)
    err = error(await h.client.post(COMP, json={"prompt": ["fine", "x" * 6000]}))
    assert err["param"] == "prompt[1]" and err["code"] == "context_length_exceeded"
    err = error(await h.client.post(COMP, json={"prompt": [[5] * 10, [5] * 64]}))
    assert err["param"] == "prompt[1]" and err["code"] == "context_length_exceeded"
    err = error(await h.client.post(COMP, json={"prompt": ["fine"], "stop": ["s"] * 17}))
    assert err["param"] == "stop"
    assert calls == [] and h.fake.requests == []


async def test_large_prompts_tokenize_in_a_thread_small_ones_inline(make_gateway, monkeypatch, tokenizer):
    h = await make_gateway(FakeScheduler(reply=[1], max_model_len=8192))
    calls = record_encodes(monkeypatch, h.state.served().tokenizer)
    large = "word " * (INLINE_TOKENIZE_CHARS // 5 + 100)
    r = await h.client.post(COMP, json={"prompt": ["short", large], "max_tokens": 1})
    assert r.status_code == 200, r.text
    (small_len, small_thread), (large_len, large_thread) = calls
    assert small_len == 5 and small_thread == threading.current_thread().name
    assert large_len == len(large) and large_thread.startswith("llmesh-tokenize")
    sent = [list(req.prompt_token_ids.ids) for req in h.fake.requests]
    assert sorted(sent, key=len) == [tokenizer.encode("short"), tokenizer.encode(large)]

    r = await h.client.post(CHAT, json={"messages": [{"role": "user", "content": large}], "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert calls[-1][1].startswith("llmesh-tokenize")
    r = await h.client.post("/tokenize", json={"prompt": large})
    assert r.json()["count"] == len(tokenizer.encode(large)) and calls[-1][1].startswith("llmesh-tokenize")


@pytest.mark.parametrize("path", [COMP, CHAT])
async def test_event_loop_turns_while_a_large_prompt_tokenizes(make_gateway, path):
    h = await make_gateway(FakeScheduler(reply=[1], max_model_len=8192))
    # Just under the character limit: tokenized in full (~0.5 s), then refused as too many tokens.
    text = BIG[: h.state.limits().prompt_chars - 1000]
    body = {"prompt": text} if path == COMP else {"messages": [{"role": "user", "content": text}]}
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.ensure_future(ticker())
    start = time.perf_counter()
    r = await h.client.post(path, json=body)
    took = time.perf_counter() - start
    done.set()
    await tick
    assert error(r)["code"] == "context_length_exceeded"
    # Inline, the loop would stand still for the whole tokenization (the gap would be `took`).
    assert max(gaps) < max(0.15, took / 2), f"loop stalled {max(gaps):.2f} s of a {took:.2f} s request"


async def test_sequences_per_request(make_gateway):
    h = await make_gateway(FakeScheduler(reply=[1]), max_seqs_per_request=4, max_prompts=5)
    err = error(await h.client.post(COMP, json={"prompt": ["a", "b", "c"], "n": 2}))
    assert err["param"] == "n" and "6 sequences" in err["message"]
    assert error(await h.client.post(COMP, json={"prompt": ["a"] * 6}))["param"] == "prompt"
    assert (
        error(await h.client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}], "n": 5}))[
            "param"
        ]
        == "n"
    )
    assert h.fake.requests == []
    r = await h.client.post(COMP, json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


async def test_default_caps(make_gateway):
    h = await make_gateway(FakeScheduler(reply=[1]))
    err = error(await h.client.post(COMP, json={"prompt": ["x"] * 64, "n": 16}))
    assert err["param"] == "n" and "1024 sequences" in err["message"] and "at most 256" in err["message"]
    assert error(await h.client.post(COMP, json={"prompt": ["x"] * 65}))["param"] == "prompt"
    err = error(await h.client.post(COMP, json={"prompt": "x", "stop_token_ids": list(range(65))}))
    assert err["param"] == "stop_token_ids" and "at most 64" in err["message"]
    err = error(await h.client.post(COMP, json={"prompt": "x", "stop_token_ids": [3, 49152]}))
    assert err["param"] == "stop_token_ids" and "49152" in err["message"]
    assert h.fake.requests == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_batch_has_few_prompts_in_flight(make_gateway, tokenizer, stream):
    h = await make_gateway(
        FakeScheduler(reply=tokenizer.encode(REPLY), delay_s=0.005), max_concurrent_prompts=2
    )
    prompts = [f"p{i}" for i in range(5)]
    r = await h.client.post(COMP, json={"prompt": prompts, "n": 2, "max_tokens": 3, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
        texts: dict[int, str] = {}
        finished = set()
        for e in events:
            (c,) = e["choices"]
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                finished.add(c["index"])
        assert finished == set(range(10))
        choices = [{"index": i, "text": texts[i]} for i in sorted(texts)]
    else:
        choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(10))
    assert all(c["text"] == " Paris is the" for c in choices)
    assert len(h.fake.requests) == 10
    assert h.fake.max_active == 4  # 2 prompts x n = 2, never more
    # Prompts start in order: the first four calls are the first two prompts'.
    first = {tuple(req.prompt_token_ids.ids) for req in h.fake.requests[:4]}
    assert first == {tuple(tokenizer.encode(p)) for p in prompts[:2]}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": BIG}, "prompt"),
        ({"messages": [{"role": "user", "content": BIG[:3000]}, {"role": "user", "content": BIG[:3000]}]},
         "messages"),
    ],
)  # fmt: skip
async def test_tokenize_has_the_limits_of_completions(make_gateway, monkeypatch, body, param):
    h = await make_gateway(FakeScheduler(reply=[1], max_model_len=64))
    calls = record_encodes(monkeypatch, h.state.served().tokenizer)
    start = time.perf_counter()
    err = error(await h.client.post("/tokenize", json=body))
    assert err["param"] == param and err["code"] == "context_length_exceeded", err
    assert "characters" in err["message"] and calls == []
    assert time.perf_counter() - start < 1.0
    # Under the limit it answers, a count over the context included (measuring is the route's use).
    r = await h.client.post("/tokenize", json={"prompt": "x " * 100})
    assert r.status_code == 200 and r.json()["count"] > 64 and r.json()["max_model_len"] == 64


async def test_detokenize_has_the_limits_of_completions(make_gateway):
    h = await make_gateway(FakeScheduler(reply=[1], max_model_len=64))
    err = error(await h.client.post("/detokenize", json={"tokens": [5] * 65}))
    assert err["param"] == "tokens" and err["code"] == "context_length_exceeded", err
    assert error(await h.client.post("/detokenize", json={"tokens": [5] * 63 + [49152]}))["param"] == "tokens"
    r = await h.client.post("/detokenize", json={"tokens": [5] * 64})
    assert r.status_code == 200 and isinstance(r.json()["prompt"], str)


async def test_tokenize_bodies_are_capped_like_every_route(make_gateway):
    h = await make_gateway(FakeScheduler(reply=[1]), max_body_bytes=1000)
    for path, body in (("/tokenize", {"prompt": "x" * 2000}), ("/detokenize", {"tokens": [5] * 1000})):
        r = await h.client.post(path, json=body)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
