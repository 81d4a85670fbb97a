"""Our Llama-family model against transformers (fp32, CPU, eager attention) on the same weights.

Every variant runs through a paged KV cache with small, shuffled blocks in three ways:
one full prefill, the same prompt in chunks across calls, and several sequences of
different lengths mixed in one forward (decodes + chunked prefills).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.helpers.paged import PagedKV
from tests.unit.worker_svc.conftest import LLAMA3_ROPE, TINY_VARIANTS
from worker_svc.attention.torch_paged import TorchPagedBackend
from worker_svc.loader import load_model
from worker_svc.models import LlamaForCausalLM, ModelConfig, get_model_class
from worker_svc.models.llama import compute_inv_freq

VARIANTS = [*TINY_VARIANTS, "smollm2"]
# Tiny models match to ~1e-6; SmolLM2's 30 real layers and larger logits (|x| ~ 20) accumulate
# more float32 reordering error between SDPA and transformers' eager attention.
ATOL = {"smollm2": 2e-4}  # measured: ~5e-5


@pytest.fixture(scope="module", params=VARIANTS)
def pair(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, str]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    name = request.param
    path = request.getfixturevalue("smollm2_dir") if name == "smollm2" else tiny_model_dirs[name]
    ours, cfg = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    return {"name": name, "ours": ours, "hf": hf, "cfg": cfg, "atol": ATOL.get(name, 1e-4)}


def tokens(cfg: ModelConfig, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()


@torch.inference_mode()
def hf_logits(hf: torch.nn.Module, toks: list[int]) -> torch.Tensor:
    return hf(torch.tensor([toks])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    assert err <= atol, f"max |logit diff| {err:.3g} > {atol}"


def test_full_prefill(pair: dict[str, Any]) -> None:
    cfg = pair["cfg"]
    toks = tokens(cfg, 23, seed=1)
    kv = PagedKV(cfg)
    (out,) = kv.step(pair["ours"], [("a", toks)])
    assert out.dtype == torch.float32
    assert_close(out, hf_logits(pair["hf"], toks), pair["atol"])


def test_chunked_prefill(pair: dict[str, Any]) -> None:
    """Chunks that start and end mid-block, including a 1-token chunk, reuse the cache."""
    cfg = pair["cfg"]
    toks = tokens(cfg, 23, seed=2)
    kv = PagedKV(cfg, seed=5)
    outs, pos = [], 0
    for n in (1, 6, 3, 8, 5):
        outs += kv.step(pair["ours"], [("a", toks[pos : pos + n])])
        pos += n
    assert_close(torch.cat(outs), hf_logits(pair["hf"], toks), pair["atol"])


def test_mixed_batch(pair: dict[str, Any]) -> None:
    """Decodes first, then chunked prefills, several sequences per forward."""
    cfg = pair["cfg"]
    seqs = {
        s: tokens(cfg, n, seed=10 + i) for i, (s, n) in enumerate({"a": 13, "b": 16, "c": 6, "d": 7}.items())
    }
    done = dict.fromkeys(seqs, 0)
    got: dict[str, list[torch.Tensor]] = {s: [] for s in seqs}
    kv = PagedKV(cfg, seed=7)
    plan = [
        [("a", 11), ("b", 6)],
        [("a", 1), ("b", 9), ("c", 5)],
        [("a", 1), ("b", 1), ("c", 1), ("d", 7)],
    ]
    for step in plan:
        batch = [(s, seqs[s][done[s] : done[s] + n]) for s, n in step]
        for (s, n), out in zip(step, kv.step(pair["ours"], batch), strict=True):
            got[s].append(out)
            done[s] += n
    for s, toks in seqs.items():
        assert done[s] == len(toks)
        assert_close(torch.cat(got[s]), hf_logits(pair["hf"], toks), pair["atol"])


# ---- config, rope, weights, backend -------------------------------------------------------


def test_config_from_transformers5_rope_parameters(tiny_model_dirs: dict[str, str]) -> None:
    cfg = ModelConfig.from_pretrained(tiny_model_dirs["llama3"])
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.rope_theta == 10000.0
    assert cfg.rope_scaling == LLAMA3_ROPE
    assert cfg.eos_token_ids == [2] and cfg.bos_token_id == 1
    assert cfg.torch_dtype == torch.float32
    qwen2 = ModelConfig.from_pretrained(tiny_model_dirs["qwen2"])
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_pretrained(tiny_model_dirs["qwen3"])
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 32
    mistral = ModelConfig.from_pretrained(tiny_model_dirs["mistral"])
    assert mistral.sliding_window == 4096


def legacy_config(**kw: Any) -> dict[str, Any]:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "eos_token_id": [7, 8],
    }
    return {**base, **kw}


def test_config_legacy_fields() -> None:
    cfg = ModelConfig.from_dict(
        legacy_config(rope_scaling={"type": "linear", "factor": 2.0}), {"eos_token_id": [8, 9]}
    )
    assert cfg.head_dim == 8 and cfg.num_kv_heads == 8  # defaults: hidden/heads, MHA
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.eos_token_ids == [7, 8, 9]  # config first, then generation_config, deduplicated
    assert cfg.torch_dtype == torch.bfloat16
    assert ModelConfig.from_dict(legacy_config(rope_scaling={"rope_type": "default"})).rope_scaling is None
    qwen2 = ModelConfig.from_dict(legacy_config(architectures=["Qwen2ForCausalLM"]))
    assert qwen2.attention_bias  # Qwen2 has q/k/v biases although its config never says so


def test_config_unsupported_rope_is_clear() -> None:
    with pytest.raises(NotImplementedError, match="dynamic"):
        ModelConfig.from_dict(legacy_config(rope_scaling={"type": "dynamic", "factor": 2.0}))


def test_generation_config_eos(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text(json.dumps(legacy_config(eos_token_id=2)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5], "bos_token_id": 1}))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.eos_token_ids == [2, 5] and cfg.bos_token_id == 1


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, {**LLAMA3_ROPE, "original_max_position_embeddings": 64}],
)
def test_inv_freq_matches_transformers(scaling: dict[str, Any] | None) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=50000.0, rope_scaling=scaling)
    ours = ModelConfig.from_dict({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    if scaling is None:
        dim = 64
        expected = 1.0 / (50000.0 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
    assert torch.equal(compute_inv_freq(ours), expected)


def test_registry() -> None:
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert get_model_class(arch) is LlamaForCausalLM
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: .*LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")


class RecordingBackend(TorchPagedBackend):
    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []

    def forward(self, q, k, v, kv_cache, meta, scale, rotary=None, kv_scale=None):  # type: ignore[no-untyped-def]
        self.calls.append((q.shape[0], scale))
        return super().forward(q, k, v, kv_cache, meta, scale, rotary, kv_scale)


def test_backend_is_swappable(tiny_model_dirs: dict[str, str]) -> None:
    model, cfg = load_model(tiny_model_dirs["qwen3"])
    toks = tokens(cfg, 9, seed=3)
    (before,) = PagedKV(cfg).step(model, [("a", toks)])
    rec = RecordingBackend()
    model.set_backend(rec)
    (after,) = PagedKV(cfg).step(model, [("a", toks)])
    assert rec.calls == [(9, cfg.head_dim**-0.5)] * cfg.num_layers
    assert torch.equal(before, after)


def test_dtype_change_keeps_fp32_rotary_cache(tiny_model_dirs: dict[str, str]) -> None:
    model, cfg = load_model(tiny_model_dirs["llama3"])
    cache = model.rotary.cos_sin_cache.clone()
    assert cache.shape == (cfg.max_position_embeddings, cfg.head_dim) and cache.dtype == torch.float32
    model.to(torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rotary.cos_sin_cache.dtype == torch.float32
    assert torch.equal(model.rotary.cos_sin_cache, cache)
    bf16, _ = load_model(tiny_model_dirs["llama3"], dtype=torch.bfloat16)
    assert torch.equal(bf16.rotary.cos_sin_cache, cache)  # built from meta via to_empty, not garbage
    toks = tokens(cfg, 12, seed=4)
    (out,) = PagedKV(cfg, dtype=torch.bfloat16).step(bf16, [("a", toks)])
    (ref,) = PagedKV(cfg).step(load_model(tiny_model_dirs["llama3"])[0], [("a", toks)])
    assert (out - ref).abs().max().item() < 0.1  # bf16 rounding, nothing structural


def test_load_weights_rejects_incomplete_or_unknown(tiny_model_dirs: dict[str, str]) -> None:
    from worker_svc.loader import iter_safetensors

    path = tiny_model_dirs["qwen2"]
    model, _ = load_model(path)
    weights = list(iter_safetensors(path))
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        model.load_weights(w for w in weights if w[0] != "model.layers.1.self_attn.k_proj.bias")
    with pytest.raises(KeyError, match="mystery"):
        model.load_weights([*weights, ("model.mystery.weight", torch.zeros(1))])
    assert set(model.expected_weight_names()) == {name for name, _ in weights}
