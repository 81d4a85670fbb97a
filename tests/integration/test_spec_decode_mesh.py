"""Speculative decoding across the mesh: a worker started with `--speculative-config` (real processes).

Greedy text through the gateway (official `openai` client, streamed and not) equals the
in-process engine's without speculation; the drafts were really verified (the vLLM-named
counters on /metrics say so); sampling requests and an abort mid-stream leave no block behind.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from services.launcher import start_mesh
from tests.integration.conftest import service_logs
from tests.integration.test_gateway_openai import metric
from tests.unit.llmesh.test_spec_decode import NGRAM

MODEL = "SmolLM2-135M-Instruct"
TEXT = "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing."
PROMPT = f"Repeat the text exactly.\nText: {TEXT}\nRepeated: {TEXT[:25]}"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def spec_mesh(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("spec-mesh")
    worker_args = ["--kv-cache-memory", str(64 << 20), "--speculative-config", json.dumps(NGRAM)]
    try:
        mesh = start_mesh(1, gateway_port=0, worker_args=worker_args, log_dir=str(log_dir))
    except Exception as e:
        raise RuntimeError(f"the mesh did not start: {e}\n{service_logs(log_dir)}") from e
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def reference(smollm2) -> str:
    from llmesh import LLM, SamplingParams

    llm = LLM(smollm2, kv_cache_memory=64 << 20)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return out[0].outputs[0].text


@pytest.fixture(scope="module")
def smollm2() -> str:
    from tests.helpers.tiny_models import smollm2_path

    return smollm2_path()


def test_greedy_text_through_the_gateway_equals_the_engine_without_drafts(spec_mesh, reference) -> None:
    import openai

    url = f"http://{spec_mesh.gateway.address}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    extra = {"ignore_eos": True}
    done = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
    )
    assert done.choices[0].text == reference
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body=extra
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == reference

    # Sampling alongside, and a stream dropped after its first tokens.
    sampled = client.completions.create(
        model=MODEL, prompt=[PROMPT] * 3, max_tokens=MAX_TOKENS, temperature=0.9, seed=1, extra_body=extra
    )
    assert len(sampled.choices) == 3
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True},
        timeout=60,
    ) as resp:
        next(resp.iter_lines())

    text = httpx.get(f"{url}/metrics", timeout=30).text
    assert metric(text, "llmesh:spec_decode_num_drafts_total") > 0
    accepted = metric(text, "llmesh:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= metric(text, "llmesh:spec_decode_num_draft_tokens_total")
    # Every block comes back once the dropped stream is aborted.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        if metric(text, "llmesh:kv_cache_free_blocks") == metric(text, "llmesh:kv_cache_num_blocks"):
            break
        time.sleep(0.2)
    assert metric(text, "llmesh:kv_cache_free_blocks") == metric(text, "llmesh:kv_cache_num_blocks")
