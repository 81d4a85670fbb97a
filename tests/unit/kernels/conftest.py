"""Kernel tests on CPU run the Triton kernels under Triton's interpreter.

No TRITON_INTERPRET dance is needed here: `kernels.triton.dual_jit` interprets any launch
whose tensors live on the CPU and compiles for CUDA tensors, deciding per launch. So nothing
is set in the environment, nothing leaks into other test folders (or their subprocesses), and
the order in which modules import triton does not matter.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

# Without triton (a CPU-only install without the `test` extra) there is nothing to test here.
collect_ignore_glob = [] if importlib.util.find_spec("triton") else ["test_*.py"]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
