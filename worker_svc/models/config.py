"""`ModelConfig`: the few fields of a Hugging Face config.json that our models need.

Parsed from the JSON directly (not through transformers' config classes) so that the
worker depends on one stable schema of ours, whichever transformers version wrote the
file: 4.x writes `rope_theta` + `rope_scaling`, 5.x writes a `rope_parameters` dict.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

# Architectures whose attention has a q/k/v bias even though their config has no
# `attention_bias` field (Qwen2 hard-codes it), and whose output projection never has one.
_QKV_BIAS_ALWAYS = {"Qwen2ForCausalLM"}
# Architectures with a per-head RMSNorm on q and k before rotary.
_QK_NORM = {"Qwen3ForCausalLM"}
# Rope types we compute inv_freq for; "default" is stored as rope_scaling=None.
SUPPORTED_ROPE_TYPES = ("linear", "llama3")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Normalised to carry "rope_type"; None means plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False
    qk_norm: bool = False
    # Recorded, not applied: our models run full attention (see llama.py).
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: torch.dtype | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read `path`/config.json, plus generation_config.json for extra EOS ids."""
        path = os.fspath(path)
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise FileNotFoundError(f"no config.json in {path!r}")
        with open(cfg_file, encoding="utf-8") as f:
            cfg = json.load(f)
        gen: dict[str, Any] = {}
        gen_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_file):
            with open(gen_file, encoding="utf-8") as f:
                gen = json.load(f)
        return cls.from_dict(cfg, gen)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = cfg.get("head_dim") or hidden // num_heads

        rope_theta, rope_scaling = _parse_rope(cfg)

        qkv_bias = bool(cfg.get("attention_bias", False)) or arch in _QKV_BIAS_ALWAYS
        # Llama/Qwen3's `attention_bias` covers o_proj too; Qwen2's built-in bias does not.
        o_bias = bool(cfg.get("attention_bias", False)) and arch not in _QKV_BIAS_ALWAYS

        sliding_window = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            sliding_window = None

        eos: list[int] = []
        for source in (cfg, generation or {}):
            for tok in _as_int_list(source.get("eos_token_id")):
                if tok not in eos:
                    eos.append(tok)
        bos = cfg.get("bos_token_id")
        if bos is None and generation:
            bos = generation.get("bos_token_id")

        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype")
        torch_dtype = _DTYPES.get(str(dtype_name).removeprefix("torch.")) if dtype_name else None

        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in _QK_NORM,
            sliding_window=int(sliding_window) if sliding_window else None,
            eos_token_ids=eos,
            bos_token_id=int(bos) if bos is not None else None,
            torch_dtype=torch_dtype,
        )


def _as_int_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return [int(v) for v in value]
    return [int(value)]


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the 4.x or the 5.x layout."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # Per-layer-type dicts (e.g. {"full_attention": {...}}): our families use one kind.
        params = params.get("full_attention") or next(iter(params.values()))
    scaling = params if isinstance(params, dict) else cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if theta is None and isinstance(scaling, dict):
        theta = scaling.get("rope_theta")
    theta = float(theta) if theta is not None else 10000.0

    if not scaling:
        return theta, None
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope scaling type {rope_type!r} is not supported (supported: default, "
            f"{', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1 is not supported")
    scaling["rope_type"] = rope_type
    if rope_type == "llama3":
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return theta, scaling
