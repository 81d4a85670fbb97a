"""Nucleus filtering without a sort against its sorting twin (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton.top_p import top_p_mask_

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _mass_above(x: torch.Tensor) -> torch.Tensor:
    """float64 [R, V]: the probability mass strictly above each token's logit."""
    probs = x.double().softmax(-1)
    vals, order = x.sort(dim=-1, descending=True)
    incl = probs.gather(1, order).cumsum(-1)
    first = torch.searchsorted(-vals, -vals, side="left")
    above_sorted = torch.where(first > 0, incl.gather(1, (first - 1).clamp_min(0)), 0.0)
    return torch.empty_like(above_sorted).scatter_(1, order, above_sorted)


def _logits(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * 2.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cols", [7, 300, 5000])  # one short block; a ragged one; several
def test_top_p_mask_matches_twin(device: str, cols: int) -> None:
    x = _logits(6, cols, cols)
    x[1, :3] = x[1, 3]  # ties: stay or go together
    x[2, cols // 2] = float("-inf")  # a token a grammar forbids
    x[3, 0] = -0.0
    top_p = torch.tensor([0.9, 0.5, 0.99, 1e-6, 1.0, 0.7])  # 1e-6: the top token alone; 1.0: untouched
    want = reference.top_p_mask_(x.clone(), top_p)
    got = top_p_mask_(x.to(device), top_p.to(device)).cpu()
    assert torch.equal(got, want)
    assert torch.equal(got[4], x[4])
    assert (got[3] > float("-inf")).sum() == 1


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_mask_reads_only_the_vocabulary(device: str) -> None:
    """Padded lm_head columns past the vocabulary are neither weighed nor written."""
    x = _logits(3, 40, 1)
    x[:, 32:] = 1e4
    got = top_p_mask_(x.clone().to(device), torch.full((3,), 0.8, device=device), vocab=32).cpu()
    want = reference.top_p_mask_(x.clone(), torch.full((3,), 0.8), vocab=32)
    assert torch.equal(got, want)
    assert torch.equal(got[:, 32:], x[:, 32:])


def test_twin_keeps_the_nucleus() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])  # mass above: 0.95, 0, 0.8, 0.5
    for p, kept in ((0.75, {1, 3}), (0.85, {1, 2, 3}), (0.5, {1}), (0.51, {1, 3})):
        out = reference.top_p_mask_(probs.log(), torch.tensor([p]))
        assert set((out[0] > float("-inf")).nonzero()[:, 0].tolist()) == kept, p


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a 128k vocabulary is for the compiled kernel")
def test_top_p_mask_at_a_llama_3_vocabulary_on_gpu() -> None:
    """Over 128k columns the kernel's fp32 sums and the twin's float64 ones may part only on a
    token whose mass above sits within rounding of top_p."""
    x = _logits(8, 128256, 3) * 2  # spread out: nuclei of a few to thousands of tokens
    x[5] = x[5].to(torch.bfloat16).float()  # bf16 logits: many exact ties
    top_p = torch.tensor([0.9, 0.95, 0.5, 0.99, 0.999, 0.9, 0.2, 1.0])
    want = reference.top_p_mask_(x.clone(), top_p) > float("-inf")
    got = top_p_mask_(x.cuda(), top_p.cuda()).cpu() > float("-inf")
    near = (_mass_above(x) - top_p[:, None].double()).abs() < 1e-5
    assert ((got != want) & ~near).sum() == 0
    assert (got != want).sum() <= 2
