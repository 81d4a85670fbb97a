"""The rows' argmax kernel against its torch twin (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton.argmax import BLOCK, argmax_rows

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [7, BLOCK, 2 * BLOCK + 5])  # one short chunk; one whole; a ragged third
def test_argmax_matches_twin_first_maximum_wins(device: str, dtype: torch.dtype, cols: int) -> None:
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(5, cols, generator=g).to(dtype)
    x[0, cols // 3] = x[0, cols - 1] = 50.0  # a tie across chunks: the first column wins
    x[1] = float("-inf")  # no finite value: column 0, as torch
    x[2, 3] = x[2, 5] = 9.0  # a tie inside a chunk
    x[3, cols - 1] = 60.0  # the last column, in a ragged chunk
    expected = reference.argmax_rows(x)
    got = argmax_rows(x.to(device))
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_reads_a_strided_slice(device: str) -> None:
    """The sampler hands it logits[:, :vocab] of a padded row (its row stride is the padded width)."""
    x = torch.randn(3, 2 * BLOCK + 64).to(device)
    x[:, BLOCK + 100] = 1e4  # the padding's maximum must not be seen
    view = x[:, : BLOCK + 50]
    assert torch.equal(argmax_rows(view).cpu(), view.cpu().argmax(-1))
    assert argmax_rows(x[:0]).shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_writes_int32_when_asked(device: str) -> None:
    """The sampler's greedy rows take int32 ids, what the step's results and the next step's
    patch carry, without a cast kernel."""
    x = torch.randn(4, BLOCK + 9).to(device)
    got = argmax_rows(x, dtype=torch.int32)
    assert got.dtype == torch.int32
    assert torch.equal(got.cpu().long(), reference.argmax_rows(x.cpu()))
