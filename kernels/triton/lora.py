"""Batched LoRA for a batch that mixes adapters: shrink (x @ A[slot].T) and expand (+= y @ B[slot].T).

Twins: `kernels.lora_reference.lora_shrink` / `lora_expand` (the layout is described there).

Punica / S-LoRA's SGMV, as vLLM's Triton LoRA kernels do it: the rows that use an adapter are
listed sorted by slot (`perm`, with `starts[s]` the first of slot s), and the grid's first axis
is the slot, its second a block of BLOCK_M of that slot's rows. A program past its slot's rows
returns at once, so the grid can be sized by the batch alone (no host read of the counts, and a
CUDA graph may replay it with other counts). Each program gathers its rows of x by `perm`, so
one launch serves every adapter and base rows cost nothing.

* shrink: program (s, m-block, n-block of R x split) walks K in BLOCK_K tiles; with SPLIT_K > 1
  the K range is split among programs (a decode batch has few rows per adapter and R is small,
  so K is where the parallelism is), each writing its partial sum to its own plane of
  y [SPLIT_K, T, R]: no atomics and no zeroed buffer, and the sum is the same every run;
* expand: program (s, m-block, segment x n-block) sums its rows' rank columns of its segment
  over the planes, multiplies them by B[s]'s rows of that segment in one dot (R fits a tile)
  and adds into `out` in place. Every (row, column) of `out` belongs to one program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit, is_interpreted


@dual_jit(do_not_specialize=["K"])
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    perm_ptr,
    starts_ptr,
    N,
    K,
    stride_xm,
    stride_as,
    stride_an,
    stride_yk,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    s = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2) // SPLIT_K
    pid_k = tl.program_id(2) % SPLIT_K
    lo = tl.load(starts_ptr + s)
    hi = tl.load(starts_ptr + s + 1)
    first = lo + pid_m * BLOCK_M
    if first >= hi:
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    m_mask = offs_m < hi
    rows = tl.load(perm_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None] * stride_xm
    a_rows = a_ptr + s.to(tl.int64) * stride_as + offs_n.to(tl.int64)[:, None] * stride_an
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        ks = k0 + offs_k
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_FP32:  # the interpreter's dot reads 16-bit floats as garbage: exact fp32 instead
            acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x.to(a.dtype), tl.trans(a))
    y = y_ptr + pid_k.to(tl.int64) * stride_yk + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc, mask=m_mask[:, None] & n_mask[None, :])


@dual_jit
def _lora_expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    perm_ptr,
    starts_ptr,
    seg_starts_ptr,
    R,
    stride_yk,
    stride_ym,
    stride_bs,
    stride_bn,
    stride_om,
    PLANES: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    s = tl.program_id(0)
    pid_m = tl.program_id(1)
    seg = tl.program_id(2) // N_BLOCKS
    pid_n = tl.program_id(2) % N_BLOCKS
    lo = tl.load(starts_ptr + s)
    hi = tl.load(starts_ptr + s + 1)
    first = lo + pid_m * BLOCK_M
    n_lo = tl.load(seg_starts_ptr + seg)
    n_hi = tl.load(seg_starts_ptr + seg + 1)
    if (first >= hi) | (n_lo + pid_n * BLOCK_N >= n_hi):
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    m_mask = offs_m < hi
    rows = tl.load(perm_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = n_lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_hi
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    y_rows = y_ptr + rows[:, None] * stride_ym + (seg * R + offs_r)[None, :]
    y_mask = m_mask[:, None] & r_mask[None, :]
    y = tl.load(y_rows, mask=y_mask, other=0.0)
    for p in range(1, PLANES):  # the shrink's split-K partial sums, in a fixed order
        y += tl.load(y_rows + p * stride_yk, mask=y_mask, other=0.0)
    b = tl.load(
        b_ptr + s.to(tl.int64) * stride_bs + offs_n.to(tl.int64)[:, None] * stride_bn + offs_r[None, :],
        mask=n_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    y = y.to(b.dtype)  # as the twin: the shrink's fp32 sum is rounded to B's dtype once
    if DOT_FP32:
        delta = tl.dot(y.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        delta = tl.dot(y, tl.trans(b))
    out = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    old = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (old.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


def _block_m(max_rows: int) -> int:
    return 16 if max_rows <= 16 else 32


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    perm: torch.Tensor,
    starts: torch.Tensor,
    max_rows: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """y [P, T, R] fp32: P partial sums (split K) of x[row] @ A[slot(row)].T on the adapters' rows
    (base rows: unspecified); `lora_expand` sums the planes.

    `max_rows`: a bound on the rows of any one slot (default: all rows); it sizes the grid.
    `split_k`: programs sharing each K range (default: by K on the GPU, 1 interpreted).
    """
    t, k = x.shape
    num_slots, n, _ = a.shape
    assert a.stride(-1) == 1 and x.stride(-1) == 1
    max_rows = t if max_rows is None else max_rows
    block_m = _block_m(max_rows)
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    if split_k is None:
        split_k = 1 if is_interpreted(x.device) else max(1, min(8, k // 512))
    # Base rows of y are never read by the expand: left unwritten.
    y = torch.empty((split_k, t, n), dtype=torch.float32, device=x.device)
    if t == 0:
        return y
    grid = (num_slots, triton.cdiv(max_rows, block_m), triton.cdiv(n, block_n) * split_k)
    _lora_shrink_kernel[grid](
        x, a, y, perm, starts, n, k,
        x.stride(0), a.stride(0), a.stride(1), y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64 if is_interpreted(x.device) else 128,
        SPLIT_K=split_k, DOT_FP32=is_interpreted(x.device) or a.dtype == torch.float32,
    )  # fmt: skip
    return y


def lora_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    perm: torch.Tensor,
    starts: torch.Tensor,
    seg_starts: torch.Tensor,
    max_rows: int | None = None,
    max_seg_n: int | None = None,
) -> torch.Tensor:
    """out[row, seg j] += y[:, row, j's rank columns].sum(0) @ B[slot(row), seg j].T, in place;
    returns out. `y`: `lora_shrink`'s [P, T, R] planes.

    `seg_starts`: int32 [num_segments + 1] output offsets; `max_seg_n`: the widest segment
    (default: all of N); `max_rows` as for `lora_shrink`.
    """
    planes, t = y.shape[0], y.shape[1]
    num_slots, n, r = b.shape
    num_segs = seg_starts.shape[0] - 1
    assert b.stride(-1) == 1 and out.stride(-1) == 1 and out.shape[0] == t
    if t == 0:
        return out
    max_rows = t if max_rows is None else max_rows
    block_m = _block_m(max_rows)
    block_n = 64
    n_blocks = triton.cdiv(max_seg_n or n, block_n)
    grid = (num_slots, triton.cdiv(max_rows, block_m), num_segs * n_blocks)
    _lora_expand_kernel[grid](
        y, b, out, perm, starts, seg_starts, r,
        y.stride(0), y.stride(1), b.stride(0), b.stride(1), out.stride(0),
        PLANES=planes, N_BLOCKS=n_blocks, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(r)),
        DOT_FP32=is_interpreted(y.device) or b.dtype == torch.float32,
    )  # fmt: skip
    return out
