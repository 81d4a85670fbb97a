"""POST /v1/embeddings on the session mesh through the official `openai` client: each input's
vector equals HF transformers' final hidden states (the final norm applied) pooled the same way
(SmolLM2's default: the last token), cosine >= 0.999; floats and base64, `dimensions`, token-id
inputs, usage, the errors; and over gRPC, every pooling type."""

from __future__ import annotations

import base64
import struct

import grpc
import httpx
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from services.grpc_server import open_sync_channel
from tests.helpers.tiny_models import smollm2_path

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France, and Berlin is the capital of Germany."]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def hf_hidden() -> list[tuple[list[int], torch.Tensor]]:
    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    out = []
    with torch.inference_mode():
        for t in TEXTS:
            ids = tok.encode(t)
            out.append((ids, model(torch.tensor([ids])).last_hidden_state[0]))
    return out


def cosine(a, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float32), b, dim=0).item()


def test_openai_client_embeddings_match_transformers(openai_client, hf_hidden):
    r = openai_client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64
    assert [d.index for d in r.data] == [0, 1]
    for d, (_, hidden) in zip(r.data, hf_hidden, strict=True):
        assert len(d.embedding) == hidden.shape[1]
        assert cosine(d.embedding, hidden[-1]) >= 0.999
        assert sum(v * v for v in d.embedding) == pytest.approx(1.0, rel=1e-4)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(ids) for ids, _ in hf_hidden)
    short = openai_client.embeddings.create(
        model=MODEL, input=hf_hidden[0][0], dimensions=32, encoding_format="float"
    )
    assert len(short.data[0].embedding) == 32
    assert cosine(short.data[0].embedding, hf_hidden[0][1][-1][:32]) >= 0.999


def test_base64_is_little_endian_float32(gateway_http: httpx.Client):
    body = {"input": TEXTS[0], "model": MODEL}
    floats = gateway_http.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
    b64 = gateway_http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(floats, abs=1e-6)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input[1]"),
        ({"input": [[1, 10**9]]}, "input"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": 100000}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_embeddings_errors(gateway_http: httpx.Client, body, param):
    r = gateway_http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"]["param"] or ""), r.json()


def pool_over_grpc(address: str, ids: list[int], pooling: int) -> list[float]:
    req = g.GenerateRequest(
        prompt_token_ids=g.TokenIds(ids=ids), sampling_params=g.SamplingParams(pooling=pooling)
    )
    with open_sync_channel(address) as channel:
        resps = list(gg.SchedulerStub(channel).Generate(req, timeout=120))
    assert len(resps) == 1 and not resps[0].token_ids
    assert resps[0].finish_reason == g.FINISH_REASON_STOP
    return list(resps[0].embedding)


def test_grpc_pooling_types(gateway_mesh, hf_hidden):
    addr = gateway_mesh.scheduler.address
    ids, hidden = hf_hidden[1]
    for pooling, ref in (
        (g.POOLING_LAST, hidden[-1]),
        (g.POOLING_MEAN, hidden.mean(0)),
        (g.POOLING_CLS, hidden[0]),
    ):
        assert cosine(pool_over_grpc(addr, ids, pooling), ref) >= 0.999
    with pytest.raises(grpc.RpcError) as err:  # generation-only parameters are refused
        req = g.GenerateRequest(
            prompt_token_ids=g.TokenIds(ids=ids),
            sampling_params=g.SamplingParams(pooling=g.POOLING_MEAN, n=2),
        )
        with open_sync_channel(addr) as channel:
            list(gg.SchedulerStub(channel).Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("pooling: ")
