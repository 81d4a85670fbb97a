"""Sampling a row of probabilities by the exponential race, its noise made in the kernel
(twin: `kernels.reference.exponential_race`, given the noise).

argmax_i p_i / E_i with E_i ~ Exp(1) independent is distributed as p (the first of independent
exponential clocks of rates p_i to ring). The sampler drew E as a [rows, vocab] tensor, then
clamped it, divided and took the argmax: five passes over a 128k vocabulary's rows, ~0.7 ms a
step at 256 rows on an H100. Here one pass: each program draws its chunk's noise from Philox
(`tl.rand`), keyed by the row's seed and the column, so a row's noise depends on its seed
alone, not on the batch it is in or the chunking. Stage 1: a program a (row, chunk of BLOCK
columns) writes the chunk's best score and its first column; stage 2, a program a row, takes
the first chunk holding the row's best (`kernels.triton.argmax.first_best_chunk`, the argmax's own).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit
from kernels.triton.argmax import first_best_chunk

BLOCK = 2048  # columns a stage-1 program races


@dual_jit()
def _race_chunk_kernel(
    p_ptr,  # [R, >= cols] fp32 probabilities
    seed_ptr,  # [R] int64: each row's Philox seed (NOISE: unused)
    noise_ptr,  # [R, >= cols] fp32 Exp(1) noise (NOISE only)
    best_ptr,  # fp32 [R, chunks]
    idx_ptr,  # int32 [R, chunks]
    stride_p,
    stride_n,
    cols,
    chunks,
    BLOCK: tl.constexpr,
    NOISE: tl.constexpr,  # the noise given (tests against the twin), else drawn here
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = offs < cols
    p = tl.load(p_ptr + row * stride_p + offs, mask=inside, other=0.0)
    if NOISE:
        e = tl.load(noise_ptr + row * stride_n + offs, mask=inside, other=1.0)
    else:
        u = tl.rand(tl.load(seed_ptr + row), offs)  # [0, 1)
        # Exp(1); 0 (u = 0) clamped to the smallest normal as the sampler's noise was: a
        # probability of 0 must score 0, never 0 / 0.
        e = tl.maximum(-tl.log(1.0 - u), 1.1754943508222875e-38)
    score = p / e
    score = tl.where(score != score, float("inf"), score)  # NaN counts as the largest, as argmax
    score = tl.where(inside, score, float("-inf"))
    best, at = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_ptr + row * chunks + chunk, best)
    tl.store(idx_ptr + row * chunks + chunk, chunk * BLOCK + at)


def exponential_race(
    probs: torch.Tensor,
    seeds: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    cols: int | None = None,
) -> torch.Tensor:
    """int64 [R]: a sample of each row of probs [R, >= cols] fp32 (over its first `cols`
    columns, default all). The noise is Philox's from each row's int64 seed in `seeds` [R], or
    `noise` [R, >= cols] fp32 itself when given."""
    assert probs.dim() == 2 and probs.dtype == torch.float32 and probs.stride(-1) == 1, (
        probs.shape,
        probs.dtype,
    )
    assert (seeds is None) != (noise is None), "either seeds or noise"
    rows = probs.shape[0]
    cols = probs.shape[1] if cols is None else cols
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows == 0:
        return out
    assert cols > 0, cols
    if noise is not None:
        assert noise.shape[0] == rows and noise.shape[1] >= cols and noise.stride(-1) == 1, noise.shape
        assert noise.dtype == torch.float32, noise.dtype
    else:
        assert seeds is not None and seeds.shape == (rows,) and seeds.dtype == torch.int64, seeds
    chunks = triton.cdiv(cols, BLOCK)
    best = torch.empty((rows, chunks), dtype=torch.float32, device=probs.device)
    at = torch.empty((rows, chunks), dtype=torch.int32, device=probs.device)
    _race_chunk_kernel[(rows, chunks)](
        probs,
        seeds if seeds is not None else at,  # any pointer when unused
        noise if noise is not None else probs,
        best,
        at,
        probs.stride(0),
        noise.stride(0) if noise is not None else 0,
        cols,
        chunks,
        BLOCK=BLOCK,
        NOISE=noise is not None,
        num_warps=4,
    )
    return first_best_chunk(best, at, out)
