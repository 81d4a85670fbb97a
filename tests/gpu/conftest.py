"""Tests that need a CUDA device: every test in this folder is skipped without one.

A fixture (not a collection hook) does the skipping, so that only this folder's tests are
touched; the modules still import on a CPU-only machine, which keeps them lint- and
import-checked in CI.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
