"""services.model_files stays torch-free: its numpy RoPE frequencies match the model's torch ones,
and loading a tokenizer through it loads no torch yet gives what AutoTokenizer gives."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from services.model_files import load_tokenizer, resolve_model, rope_inv_freq
from worker_svc.models import ModelConfig
from worker_svc.models.llama import compute_inv_freq

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize(
    "scaling", [None, LLAMA3, {**LLAMA3, "factor": 32.0, "original_max_position_embeddings": 256}]
)
def test_rope_inv_freq_is_the_twin_of_compute_inv_freq(
    head_dim: int, theta: float, scaling: dict | None
) -> None:
    cfg = ModelConfig("x", 1, 1, 1, 1, 1, 1, head_dim, rope_theta=theta, rope_scaling=scaling)
    ours = rope_inv_freq(head_dim, theta, scaling)
    theirs = compute_inv_freq(cfg)
    assert ours.dtype == np.float32 and theirs.dtype == torch.float32
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6, atol=0)


def test_loading_the_tokenizer_loads_no_torch() -> None:
    """transformers' AutoTokenizer would import torch (through its configuration module)."""
    code = (
        "import sys; from services.model_files import load_tokenizer; tok = load_tokenizer(None); "
        "assert tok.encode('hi') and 'torch' not in sys.modules, [m for m in sys.modules if 'torch' in m]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_load_tokenizer_matches_auto_tokenizer() -> None:
    from transformers import AutoTokenizer

    ours = load_tokenizer(None)
    auto = AutoTokenizer.from_pretrained(resolve_model(None), use_fast=True, local_files_only=True)
    assert type(ours) is type(auto)
    chat = [{"role": "user", "content": "Hi there, what's 2+2?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == auto.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert ours.all_special_ids == auto.all_special_ids and len(ours) == len(auto)


def test_tokenizer_class_by_name(tmp_path) -> None:
    import json

    from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

    from services.model_files import _tokenizer_class

    assert _tokenizer_class(str(tmp_path)) is PreTrainedTokenizerFast  # no tokenizer_config.json
    for name, cls in [("Qwen2Tokenizer", Qwen2Tokenizer), ("Qwen2TokenizerFast", Qwen2Tokenizer)]:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": name}))
        assert _tokenizer_class(str(tmp_path)) is cls
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "NoSuchTokenizer"}))
    assert _tokenizer_class(str(tmp_path)) is PreTrainedTokenizerFast
