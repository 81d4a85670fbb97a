"""The gateway against the real mesh, through the official `openai` client (unchanged but for base_url)."""

from __future__ import annotations

import re
import time

import httpx
import pytest

FACT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


def metric(text: str, name: str, labels: str = "") -> float:
    """Sum of a metric's samples (optionally only those whose labels contain `labels`)."""
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.eE+-]+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
            found = True
    assert found, f"metric {name}{{{labels}}} not exported"
    return total


def tokens_of(gateway_http: httpx.Client, **body) -> int:
    r = gateway_http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["count"]


# ---------------------------------------------------------------------------- basics


def test_models_health_version(openai_client, gateway_http):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    assert openai_client.models.retrieve("SmolLM2-135M-Instruct").id == "SmolLM2-135M-Instruct"
    assert gateway_http.get("/health").status_code == 200
    assert gateway_http.get("/version").json()["version"]


def test_chat_answers_a_factual_question(openai_client, gateway_http):
    resp = openai_client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=FACT, max_tokens=16, temperature=0
    )
    choice = resp.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    # usage is right: the prompt is the chat template's rendering, the completion what came back.
    assert resp.usage.prompt_tokens == tokens_of(gateway_http, messages=FACT)
    assert 1 <= resp.usage.completion_tokens <= 16
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_length_and_usage(openai_client, gateway_http):
    resp = openai_client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5
    assert resp.usage.prompt_tokens == tokens_of(gateway_http, prompt=PROMPT)
    assert "Paris" in resp.choices[0].text


def test_token_id_prompts_and_batches(openai_client, gateway_http):
    ids = gateway_http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = openai_client.completions.create(model=None, prompt=PROMPT, max_tokens=4, temperature=0)
    by_ids = openai_client.completions.create(model=None, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = openai_client.completions.create(
        model=None, prompt=[PROMPT, "1, 2, 3,"], max_tokens=3, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text[: len(batch.choices[0].text)]
    assert batch.usage.prompt_tokens == len(ids) + tokens_of(gateway_http, prompt="1, 2, 3,")


def test_echo(openai_client):
    resp = openai_client.completions.create(model=None, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert resp.choices[0].text.startswith(PROMPT)
    assert len(resp.choices[0].text) > len(PROMPT)


def test_max_completion_tokens_and_ignore_eos(openai_client):
    resp = openai_client.chat.completions.create(
        model=None, messages=FACT, max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.usage.completion_tokens == 3
    assert resp.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------------- streaming


def test_chat_stream_matches_whole_and_reports_usage(openai_client):
    kw = {"model": None, "messages": FACT, "max_tokens": 12, "temperature": 0}
    whole = openai_client.chat.completions.create(**kw)
    chunks = list(
        openai_client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_and_done_marker(gateway_http):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    with gateway_http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    whole = gateway_http.post("/v1/completions", json={**body, "stream": False}).json()
    import json

    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == whole["choices"][0]["text"]


@pytest.mark.parametrize("content", ["Write three emoji about food.", "Répète exactement: «Ça coûte 5€»"])
def test_stream_has_no_mojibake(openai_client, content):
    """Multi-byte characters split over tokens (an emoji is 3 tokens here) come out whole in every delta."""
    kw = {
        "model": None,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24,
        "temperature": 0,
    }
    whole = openai_client.chat.completions.create(**kw).choices[0].message.content
    deltas = [
        c.choices[0].delta.content or ""
        for c in openai_client.chat.completions.create(**kw, stream=True)
        if c.choices
    ]
    assert "".join(deltas) == whole
    assert any(ord(ch) > 127 for ch in whole), whole  # the model did produce multi-byte characters
    # Only the very last delta may hold U+FFFD: a character that max_tokens cut in half.
    assert not any("\ufffd" in d for d in deltas[:-1]), deltas


# ---------------------------------------------------------------------------- sampling


def test_n2_and_seed_reproducibility(openai_client):
    kw = {"model": None, "messages": FACT, "max_tokens": 8, "temperature": 1.0, "n": 2}
    a = openai_client.chat.completions.create(**kw, seed=1234)
    b = openai_client.chat.completions.create(**kw, seed=1234)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == b.usage.completion_tokens <= 16
    others = [openai_client.chat.completions.create(**kw, seed=s).choices[0].message.content for s in (1, 2)]
    assert any(o != a.choices[0].message.content for o in others)


def test_n2_stream(openai_client):
    chunks = list(
        openai_client.completions.create(
            model=None,
            prompt=PROMPT,
            max_tokens=4,
            n=2,
            seed=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    assert chunks[-1].usage.completion_tokens <= 8


def test_chat_logprobs(openai_client):
    resp = openai_client.chat.completions.create(
        model=None, messages=FACT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # greedy: the sampled token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert text.startswith(resp.choices[0].message.content)


def test_completion_logprobs(openai_client):
    resp = openai_client.completions.create(
        model=None, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert all(len(t) >= 2 for t in lp.top_logprobs)


# ---------------------------------------------------------------------------- stop strings


def test_stop_strings_cut_and_abort(openai_client):
    kw = {"model": None, "prompt": PROMPT, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = openai_client.completions.create(**kw, max_tokens=12)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = openai_client.completions.create(**kw, max_tokens=12, stop=[stop, "never-appears"])
    choice = cut.choices[0]
    assert choice.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    # The request ended upstream where the stop string completed, not at max_tokens.
    assert cut.usage.completion_tokens < full.usage.completion_tokens
    streamed = openai_client.completions.create(**kw, max_tokens=12, stop=stop, stream=True)
    parts = [c.choices[0].text for c in streamed if c.choices]
    assert "".join(parts) == choice.text


def test_stop_string_in_chat_stream(openai_client):
    kw = {"model": None, "messages": FACT, "max_tokens": 16, "temperature": 0}
    whole = openai_client.chat.completions.create(**kw).choices[0].message.content
    assert "Paris" in whole
    chunks = list(openai_client.chat.completions.create(**kw, stop=["Paris"], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole[: whole.index("Paris")]
    assert chunks[-1].choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------- chat template


def test_multi_turn_chat(openai_client, gateway_http):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "My name is Alice. Please remember it."},
        {"role": "assistant", "content": "Nice to meet you, Alice! I will remember your name."},
        {"role": "user", "content": "What is my name?"},
    ]
    resp = openai_client.chat.completions.create(model=None, messages=messages, max_tokens=16, temperature=0)
    assert "Alice" in resp.choices[0].message.content
    assert resp.usage.prompt_tokens == tokens_of(gateway_http, messages=messages)
    # Every turn is in the rendered prompt: more turns, more tokens.
    assert resp.usage.prompt_tokens > tokens_of(gateway_http, messages=messages[-1:]) + 20


def test_tokenize_detokenize_roundtrip(gateway_http):
    ids = gateway_http.post("/tokenize", json={"prompt": "héllo wörld 😀"}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 8192
    text = gateway_http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == "héllo wörld 😀"


# ---------------------------------------------------------------------------- metrics and disconnects


def test_metrics_count_requests_and_tokens(gateway_http, openai_client):
    before = gateway_http.get("/metrics").text
    openai_client.completions.create(model=None, prompt=PROMPT, max_tokens=3, temperature=0)
    name = "llmesh:generation_tokens_total"
    # Before any request, a process's counters may not be exported yet (multiprocess mode), and
    # a request's counters are written as its response ends: read until they show.
    try:
        start = metric(before, name)
    except AssertionError:  # declared, no sample yet
        start = 0.0
    deadline = time.monotonic() + 10
    while True:
        after = gateway_http.get("/metrics").text
        try:
            if metric(after, name) - start >= 1:
                break
        except AssertionError:
            pass
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert metric(after, name) - start >= 1
    ok = 'route="/v1/completions",status="200"'
    assert (
        metric(after, "llmesh:http_requests_total", ok)
        == metric(before, "llmesh:http_requests_total", ok) + 1
    )
    for m in (
        "llmesh:time_to_first_token_seconds_count",
        "llmesh:inter_token_latency_seconds_count",
        "llmesh:e2e_request_latency_seconds_count",
        "llmesh:prompt_tokens_total",
        "llmesh:request_success_total",
        "llmesh:num_requests_running",
        "llmesh:num_requests_waiting",
        "llmesh:kv_cache_usage_perc",
        "llmesh:kv_offload_hit_tokens_total",
        "llmesh:external_prefix_cache_hits_total",
        "llmesh:kv_store_failed_loads_total",
        "llmesh:scheduler_refused_requests_total",
        "llmesh:scheduler_backlog",
    ):
        metric(after, m)


def _kv(gateway_http: httpx.Client) -> tuple[float, float, float]:
    text = gateway_http.get("/metrics").text
    return (
        metric(text, "llmesh:kv_cache_free_blocks"),
        metric(text, "llmesh:num_requests_running"),
        metric(text, "llmesh:scheduler_active_requests"),
    )


def _wait_idle(gateway_http: httpx.Client, free: float, timeout: float = 15.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now_free, running, active = _kv(gateway_http)
        if now_free == free and running == 0 and active == 0:
            return time.monotonic()
        time.sleep(0.1)
    pytest.fail(f"blocks not returned: {_kv(gateway_http)}, expected {free} free and no running request")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_blocks(gateway_http, gateway_url, stream):
    free_before, _, _ = _kv(gateway_http)
    long_prompt = "Tell me a very long story about a dragon. " * 30  # ~300 tokens: many blocks
    body = {"prompt": long_prompt, "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.Client(base_url=gateway_url, timeout=120) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                for _ in range(6):
                    next(lines)
                free_during, running, _ = _kv(gateway_http)
                assert running == 1 and free_during < free_before
            # leaving the block closes the connection mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=httpx.Timeout(120, read=2.0))
    t0 = time.monotonic()
    _wait_idle(gateway_http, free_before)
    # 4000 tokens would take minutes on the CPU: the request was aborted, not finished.
    assert time.monotonic() - t0 < 15
