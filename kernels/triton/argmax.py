"""Each row's argmax, split over the row (twin: `kernels.reference.argmax_rows`).

A greedy step samples the argmax of each row of logits [rows, vocab]. torch reduces a row in one
block of threads: on an H100 a single 128k-vocabulary row took 37 us, against ~340 us for the
whole lm_head GEMM before it, a tenth of what is left of a batch-1 step above its floor. Here
stage 1 splits each row into chunks of `BLOCK` columns, one program each, which write their
chunk's maximum and its first column; stage 2 (one program a row) takes the first chunk holding
the row's maximum. Ties go to the lowest column, as torch's argmax; NaN counts as +inf (torch
takes NaN as the maximum: the two differ only for a row holding both +inf and, later, NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit
from kernels.triton.pdl import gdc_launch_dependents, gdc_wait

BLOCK = 2048  # columns a stage-1 program reduces (a 128k vocabulary: 63 programs a row)


@dual_jit(pdl=True)
def _chunk_max_kernel(
    x_ptr,
    max_ptr,  # fp32 [rows, chunks]
    idx_ptr,  # int32 [rows, chunks]: the chunk's first column holding its maximum
    stride_x,
    cols,
    chunks,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # the logits are the grid before's (see kernels.triton.pdl_enabled)
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    # Padding reads -inf: past every real column, it loses every tie.
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < cols, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(max_ptr + row * chunks + chunk, best)
    tl.store(idx_ptr + row * chunks + chunk, chunk * BLOCK + at)


@dual_jit(pdl=True)
def _rows_argmax_kernel(
    max_ptr,
    idx_ptr,
    out_ptr,  # int64 / int32 [rows]
    chunks,
    CHUNKS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS_PAD)
    inside = offs < chunks
    best = tl.load(max_ptr + row * chunks + offs, mask=inside, other=float("-inf"))
    _, j = tl.max(best, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * chunks + j).to(out_ptr.dtype.element_ty))


def argmax_rows(x: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[rows] of `dtype` (int64 or int32): the first column of each row of `x` [rows, cols]
    holding the row's maximum."""
    assert x.dim() == 2 and x.stride(-1) == 1, (x.shape, x.stride())
    assert dtype in (torch.int64, torch.int32), dtype
    rows, cols = x.shape
    assert cols > 0 and cols < 2**31, cols
    out = torch.empty(rows, dtype=dtype, device=x.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(cols, BLOCK)
    best = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    at = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(rows, chunks)](x, best, at, x.stride(0), cols, chunks, BLOCK=BLOCK, num_warps=4)
    return first_best_chunk(best, at, out)


def first_best_chunk(best: torch.Tensor, at: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Stage 2, for any stage 1 that writes a row's chunks' best scores `best` [rows, chunks]
    fp32 and the column of each `at` [rows, chunks] int32: out[row] = the column of the row's
    first chunk holding its best (out int64 / int32 [rows]). Returns out."""
    rows, chunks = best.shape
    _rows_argmax_kernel[(rows,)](
        best, at, out, chunks, CHUNKS_PAD=max(2, triton.next_power_of_2(chunks)), num_warps=1
    )
    return out
