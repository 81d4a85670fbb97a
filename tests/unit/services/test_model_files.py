"""services.model_files stays torch-free: its numpy RoPE frequencies match the model's torch ones,
and importing it (with resolve_model) loads no torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from services.model_files import rope_inv_freq
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


def test_model_files_imports_no_torch() -> None:
    code = "import sys, services.model_files; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)
