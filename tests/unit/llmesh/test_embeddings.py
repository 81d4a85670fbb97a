"""Pooling requests offline (vLLM's LLM.encode / LLM.embed) against HF transformers' final hidden
states (the model's final norm applied) pooled the same way: cosine >= 0.999 on SmolLM2, with the
prompt in one step and in chunks; blocks are freed after, nothing is sampled."""

import math

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from llmesh import LLM
from llmesh.pooling import PoolingParams
from services.sampling_params import SamplingParams, SamplingParamsError
from worker_svc.pooling import default_pooling

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings map text to vectors; " * 6]


@pytest.fixture(scope="module")
def hf_hidden(smollm2):
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModel.from_pretrained(smollm2, dtype=torch.float32, attn_implementation="eager")
    out = []
    with torch.inference_mode():
        for t in TEXTS:
            ids = tok.encode(t)
            out.append((ids, model(torch.tensor([ids])).last_hidden_state[0]))  # after the final norm
    return out


def pooled(hidden: torch.Tensor, kind: str) -> torch.Tensor:
    return {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]


def cosine(a: list[float], b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0).item()


@pytest.mark.parametrize("chunked", [False, True])
def test_encode_and_embed_match_transformers(smollm2, hf_hidden, chunked):
    kw = dict(max_num_batched_tokens=16, long_prefill_token_threshold=7) if chunked else {}
    llm = LLM(smollm2, **kw)
    prompts = [{"prompt_token_ids": ids} for ids, _ in hf_hidden]
    for kind in ("last", "mean", "cls"):
        outs = llm.encode(prompts, PoolingParams(pooling_type=kind), use_tqdm=False)
        for out, (_, hidden) in zip(outs, hf_hidden, strict=True):
            assert len(out.outputs.data) == hidden.shape[1]
            assert cosine(out.outputs.data, pooled(hidden, kind)) >= 0.999
    emb = llm.embed(prompts, PoolingParams(dimensions=64), use_tqdm=False)
    for out, (_, hidden) in zip(emb, hf_hidden, strict=True):
        vec = out.outputs.embedding
        assert len(vec) == 64 and math.isclose(sum(v * v for v in vec), 1.0, rel_tol=1e-5)
        assert cosine(vec, pooled(hidden, "last")[:64]) >= 0.999  # SmolLM2's default: last token
    blocks = llm.engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks and not llm.engine.has_unfinished()
    # Generation still works beside pooling (same engine), and a cached prompt does not feed a pool.
    again = llm.encode(prompts[:1], PoolingParams(pooling_type="mean"), use_tqdm=False)
    assert cosine(again[0].outputs.data, pooled(hf_hidden[0][1], "mean")) >= 0.999
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_pooling_params_are_validated(tmp_path):
    for bad in (dict(pooling="max"), dict(pooling="mean", n=2), dict(pooling="last", logprobs=1)):
        with pytest.raises(SamplingParamsError, match="^pooling: "):
            SamplingParams(**bad)
    assert default_pooling(str(tmp_path)) == "last"
    (tmp_path / "modules.json").write_text(
        '[{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]'
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    assert default_pooling(str(tmp_path)) == "mean"
    assert default_pooling(str(tmp_path), "cls") == "cls"
