"""Loading: safetensors (single and sharded), dummy weights, fingerprints, model resolution
and GGUF conversion (a synthetic GGUF per family, and the real default SmolLM2)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from services.model_files import convert_gguf, load_tokenizer, resolve_model
from tests.helpers.paged import PagedKV
from tests.helpers.tiny_models import make_tiny_model
from worker_svc.loader import load_model, model_fingerprint, safetensors_files
from worker_svc.models import ModelConfig
from worker_svc.models.llama import compute_inv_freq


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def test_sharded_safetensors(tiny_model_dirs: dict[str, str], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = tiny_model_dirs["qwen2"]
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(str(tmp_path))) > 2
    sharded, _ = load_model(tmp_path)
    single, _ = load_model(src)
    a, b = params_of(sharded), params_of(single)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dummy_weights_need_only_config(tiny_model_dirs: dict[str, str], tmp_path: Path) -> None:
    shutil.copy(os.path.join(tiny_model_dirs["qwen3"], "config.json"), tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)
    model, cfg = load_model(tmp_path, load_format="dummy")
    real, _ = load_model(tiny_model_dirs["qwen3"])
    assert {k: v.shape for k, v in params_of(model).items()} == {
        k: v.shape for k, v in params_of(real).items()
    }
    assert torch.equal(model.norm.weight, torch.ones(cfg.hidden_size))
    (logits,) = PagedKV(cfg).step(model, [("a", [5, 6, 7, 8, 9])])
    assert torch.isfinite(logits).all()
    assert len(model_fingerprint(tmp_path)) == 32  # config-only folders have an identity too


def test_pickle_checkpoints_are_refused(tiny_model_dirs: dict[str, str], tmp_path: Path) -> None:
    shutil.copy(os.path.join(tiny_model_dirs["llama3"], "config.json"), tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="pickle"):
        load_model(tmp_path)


def test_fingerprint(tiny_model_dirs: dict[str, str], tmp_path: Path) -> None:
    llama = model_fingerprint(tiny_model_dirs["llama3"])
    assert isinstance(llama, bytes) and len(llama) == 32
    assert model_fingerprint(tiny_model_dirs["llama3"]) == llama
    assert model_fingerprint(tiny_model_dirs["qwen2"]) != llama
    # Same architecture and config, different weights (a "fine-tune"): still different.
    a = model_fingerprint(make_tiny_model(tmp_path / "a", "llama", seed=1))
    b = model_fingerprint(make_tiny_model(tmp_path / "b", "llama", seed=2))
    assert a != b


def test_resolve_model_never_downloads(tiny_model_dirs: dict[str, str], tmp_path: Path) -> None:
    assert resolve_model(tiny_model_dirs["qwen2"]) == tiny_model_dirs["qwen2"]
    with pytest.raises(ValueError, match="never downloads"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(tmp_path, cache_dir=str(tmp_path))


# ---- synthetic GGUF: a tiny HF model written the way llama.cpp's converter writes it -------

_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in top:
        return top[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{suffix}"


def write_gguf(hf_dir: str, path: Path, arch: str) -> Path:
    from gguf import GGUFWriter

    cfg = ModelConfig.from_pretrained(hf_dir)
    weights = load_file(os.path.join(hf_dir, "model.safetensors"))
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if arch == "llama":
        w.add_rope_dimension_count(cfg.head_dim)
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
    if cfg.rope_scaling is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
        scaled = compute_inv_freq(cfg)
        cfg.rope_scaling = None
        factors = (compute_inv_freq(cfg) / scaled).numpy().astype(np.float32)
        w.add_rope_scaling_orig_ctx_len(256)
        w.add_tensor("rope_freqs.weight", factors)
    for name, t in weights.items():
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            t = llama_cpp_permute(t, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(("variant", "arch"), [("llama3", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_gguf_roundtrip_is_exact(
    tiny_model_dirs: dict[str, str], tmp_path: Path, variant: str, arch: str
) -> None:
    """Undoing llama.cpp's Q/K permutation and its rope_freqs gives back the original exactly."""
    src = tiny_model_dirs[variant]
    gguf = write_gguf(src, tmp_path / f"{variant}.gguf", arch)
    out = resolve_model(gguf, cache_dir=str(tmp_path / "cache"))
    original = load_file(os.path.join(src, "model.safetensors"))
    converted = load_file(os.path.join(out, "model.safetensors"))
    assert converted.keys() == original.keys()
    for name, t in original.items():
        assert np.array_equal(converted[name], t), name
    assert dataclasses.asdict(ModelConfig.from_pretrained(out)) == dataclasses.asdict(
        ModelConfig.from_pretrained(src)
    )
    assert model_fingerprint(gguf, cache_dir=str(tmp_path / "cache")) == model_fingerprint(out)


def test_parallel_conversions_do_not_collide(tiny_model_dirs: dict[str, str], tmp_path: Path) -> None:
    gguf = write_gguf(tiny_model_dirs["qwen2"], tmp_path / "m.gguf", "qwen2")
    cache = str(tmp_path / "cache")
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: convert_gguf(str(gguf), cache), range(4)))
    assert len(set(outs)) == 1
    assert os.listdir(os.path.join(cache, "gguf")) == [os.path.basename(outs[0])]  # no temp leftovers
    t0 = time.perf_counter()
    assert resolve_model(gguf, cache_dir=cache) == outs[0]
    assert time.perf_counter() - t0 < 1.0
    # A folder holding just the .gguf resolves to the same conversion.
    assert resolve_model(tmp_path, cache_dir=cache) == outs[0]


# ---- the default model: SmolLM2-135M-Instruct Q4_1 GGUF ---------------------------------


def test_smollm2_converted_folder(smollm2_dir: str) -> None:
    files = set(os.listdir(smollm2_dir))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files
    cfg = ModelConfig.from_pretrained(smollm2_dir)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        "LlamaForCausalLM",
        30,
        9,
        3,
    )
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [2] and cfg.rms_norm_eps == 1e-5
    tok = load_tokenizer(smollm2_dir)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    t0 = time.perf_counter()
    assert resolve_model(None) == smollm2_dir  # cached: no second conversion
    assert time.perf_counter() - t0 < 1.0


def test_smollm2_greedy_matches_transformers(smollm2_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(smollm2_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tok(text, add_special_tokens=False).input_ids
    n_new = 10
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False)[0, len(prompt) :]
    model, cfg = load_model(smollm2_dir)
    kv = PagedKV(cfg, num_blocks=32, block_size=16)
    out: list[int] = []
    step = prompt
    while len(out) < n_new:
        (logits,) = kv.step(model, [("a", step)])
        out.append(int(logits[-1].argmax()))
        step = out[-1:]
        if out[-1] in cfg.eos_token_ids:
            break
    assert out == ref.tolist()[: len(out)]
    assert "Paris" in tok.decode(out)
