"""The structured-outputs mask kernel against its torch twin (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton.token_bitmask import apply_token_bitmask_

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [2085, 4096])  # past a block and a word's end; whole blocks
def test_bitmask_kernel_matches_twin(device: str, dtype: torch.dtype, vocab: int) -> None:
    rows, width = 3, (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31, (rows, width), dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # a free row: all ones
    bitmask[2, 0] = -(2**31)  # only bit 31 of the first word: token 31 allowed, 0-30 refused
    logits = torch.randn(rows, vocab, dtype=dtype)
    expected = reference.apply_token_bitmask_(logits.clone(), bitmask)
    got = apply_token_bitmask_(logits.to(device), bitmask.to(device)).cpu()
    assert torch.equal(got, expected)
    assert torch.equal(got[1], logits[1])
    assert got[2, 31] == logits[2, 31] and torch.isinf(got[2, :31]).all()


def test_twin_reads_the_packed_layout() -> None:
    """Bit t % 32 of word t // 32 allows token t (xgrammar's and llguidance's layout)."""
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5
    bitmask[0, 1] = 1 << 2
    logits = reference.apply_token_bitmask_(torch.zeros(1, 40), bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5, 34]
