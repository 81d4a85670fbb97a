"""Prompt logprobs on the session mesh against HF transformers' log-softmax (fp32, CPU, 1e-4):
over gRPC (`SamplingParams.prompt_logprobs`) and as /v1/completions serves them to evaluation
harnesses (`echo` + `logprobs`, `max_tokens: 0`), through the official `openai` client."""

from __future__ import annotations

import grpc
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from services.convert import prompt_logprobs_from_proto
from services.grpc_server import open_sync_channel
from tests.helpers.tiny_models import smollm2_path

TEXT = "Question: What is the capital of France?\nAnswer: The capital of France is Paris."
COMP = "/v1/completions"


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], torch.Tensor]:
    path = smollm2_path()
    ids = AutoTokenizer.from_pretrained(path).encode(TEXT)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)  # row p predicts token p + 1


def generate(address: str, prompt: list[int], **sampling) -> list[g.GenerateResponse]:
    req = g.GenerateRequest(
        prompt_token_ids=g.TokenIds(ids=prompt), sampling_params=g.SamplingParams(**sampling)
    )
    with open_sync_channel(address) as channel:
        return list(gg.SchedulerStub(channel).Generate(req, timeout=120))


def test_grpc_prompt_logprobs_match_transformers(gateway_mesh, reference):
    ids, ref = reference
    addr = gateway_mesh.scheduler.address
    generate(addr, ids, temperature=0, max_tokens=1)  # warm the prefix cache: it must not be used
    resps = generate(addr, ids, temperature=0, max_tokens=2, prompt_logprobs=2, n=2)
    carrying = [r for r in resps if r.HasField("prompt_logprobs")]
    assert len(carrying) == 1 and carrying[0].index == 0  # once, on choice 0's first response
    entries = prompt_logprobs_from_proto(carrying[0].prompt_logprobs, ids)
    assert entries[0] is None
    for p in range(1, len(ids)):
        e, row = entries[p], ref[p - 1]
        assert e.token_id == ids[p]
        assert e.logprob == pytest.approx(row[ids[p]].item(), abs=1e-4)
        assert e.rank == int((row > row[ids[p]]).sum()) + 1
        top = torch.topk(row, 2)
        assert e.top_token_ids == top.indices.tolist()
        assert e.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
    # Choice 1 wants none: it may take the cached prefix (usage reports the most any choice hit).
    assert resps[-1].usage.cached_prompt_tokens == 16


@pytest.mark.parametrize("k", [21, 10**6])
def test_grpc_prompt_logprobs_out_of_range(gateway_mesh, k):
    with pytest.raises(grpc.RpcError) as err:
        generate(gateway_mesh.scheduler.address, [504, 3458], max_tokens=1, prompt_logprobs=k)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prompt_logprobs: ")


def check_echo(lp, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """The legacy logprobs object of an echoed prompt: null first, then HF's values."""
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        row = ref[p - 1]
        assert lp.token_logprobs[p] == pytest.approx(row[ids[p]].item(), abs=1e-4)
        best = torch.topk(row, k).values.tolist()
        assert sorted(lp.top_logprobs[p].values(), reverse=True)[:k] == pytest.approx(best, abs=1e-4)
    assert lp.text_offset[0] == 0


def test_completions_echo_with_logprobs_and_no_generation(openai_client, reference):
    ids, ref = reference
    r = openai_client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=TEXT, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    c = r.choices[0]
    assert c.text == TEXT and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(ids)
    check_echo(c.logprobs, ids, ref, 1)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    # With one generated token (lm-evaluation-harness's request): the prompt's, then the token's.
    r = openai_client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=ids, echo=True, logprobs=2, max_tokens=1, temperature=0
    )
    c = r.choices[0]
    assert len(c.logprobs.tokens) == len(ids) + 1 and c.text.startswith(TEXT)
    check_echo(c.logprobs, ids, ref, 2)
    assert c.logprobs.token_logprobs[-1] is not None


def test_completions_echo_streamed(openai_client, reference):
    ids, ref = reference
    stream = openai_client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=TEXT, echo=True, logprobs=1, max_tokens=0, stream=True
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == TEXT
    with_lp = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert len(with_lp) == 1
    check_echo(with_lp[0], ids, ref, 1)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_vllm_prompt_logprobs_field(gateway_http, reference):
    ids, ref = reference
    r = gateway_http.post(COMP, json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    entry = plp[3][str(ids[3])]
    assert entry["logprob"] == pytest.approx(ref[2][ids[3]].item(), abs=1e-4)
    assert entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 0}, "max_tokens"),  # nothing to return without echo
        ({"max_tokens": 0, "echo": True, "logprobs": 21}, "logprobs"),
        ({"max_tokens": 1, "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"max_tokens": 1, "prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_completions_refuse_bad_prompt_logprobs(gateway_http: httpx.Client, body, param):
    r = gateway_http.post(COMP, json={"prompt": "Hello", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
