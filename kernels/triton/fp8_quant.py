"""Per-token dynamic FP8 (e4m3) quantization of activations (twin: `kernels.reference.quantize_fp8_rows`).

W8A8's activation side: every row (token) gets its own scale, amax(|x|) / 448, so one outlier
token does not flatten the others' precision (per-tensor scales would need a calibration pass,
and a static one breaks on inputs unlike the calibration set). One program per row, two
passes over it: the amax, then the scaled cast; a row of up to ROW_BLOCK columns (every hidden
size here: o_proj's input is 4,096 wide in the 8B model) is loaded once and quantized from
registers, a wider one is read twice (the second read mostly from L2). The kernel costs one
read and a half-width write of the activations, where torch's ops (abs, amax, div, clamp,
cast) cost five round trips. (Most GEMMs get their rows quantized by the kernel before them:
`rms_norm_fp8`, `silu_and_mul_fp8`; this one serves o_proj's input, the attention output.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit
from kernels.triton.pdl import gdc_launch_dependents, gdc_wait

ROW_BLOCK = 16384  # the widest row quantized from registers in one load
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # an all-zero row still gets a finite, nonzero scale
# The columns of a row each program quantizes when its amax came in parts: the 8B MLP's 14,336
# in 14 programs. H100, the batch-1 decode graph with FP8 weights: 3,294 us against 3,307 with
# 2,048 columns a program and 3,347 with 4,096 (16 rows: 3,501, 3,510, 3,564).
PART_COLUMNS = 1024


@dual_jit(pdl=True)
def _quantize_fp8_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stride_x,
    stride_q,
    n_cols,
    fp8_max,
    inv_fp8_max,
    min_scale,
    BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # the grid before this one done and visible (see kernels.triton.pdl_enabled)
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    if ONE_BLOCK:  # the whole row in one load, kept for the cast below
        offs = tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
        amax = tl.abs(x)
    else:
        amax = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            x = tl.load(x_ptr + row * stride_x + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
    # The scale is amax times the fp32 reciprocal of 448 (what torch computes for a division by
    # a scalar on CUDA), and x / scale an IEEE division (div_rn, torch's tensor / tensor):
    # Triton's `/` on fp32 is approximate, and a last-bit difference moves a value across one of
    # e4m3's rounding points (the twin's result is the definition).
    scale = tl.maximum(tl.max(amax, axis=0) * inv_fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        mask = offs < n_cols
        if not ONE_BLOCK:
            x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, scale), -fp8_max, fp8_max)
        # The cast rounds to nearest even and the clamp saturates, as torch's cast does (under
        # the interpreter too: kernels.triton._torch_e4m3_cast).
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@dual_jit(pdl=True)
def _quantize_fp8_rows_by_parts_kernel(
    x_ptr,
    parts_ptr,
    q_ptr,
    scale_ptr,
    stride_x,
    stride_q,
    n_cols,
    n_parts,
    fp8_max,
    inv_fp8_max,
    min_scale,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """`_quantize_fp8_rows_kernel` for rows whose amax came in parts (by the kernel that wrote
    them): a row's programs each take the max of its parts and quantize their own BLOCK_N
    columns, no pass for the amax; the first writes the scale. Same scale, same codes."""
    if PDL:  # the grid before this one done and visible (see kernels.triton.pdl_enabled)
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_P], dtype=tl.float32)
    for start in range(0, n_parts, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        amax = tl.maximum(amax, tl.load(parts_ptr + row * n_parts + p, mask=p < n_parts, other=0.0))
    scale = tl.maximum(tl.max(amax, axis=0) * inv_fp8_max, min_scale)  # as the kernel above
    if tl.program_id(1) == 0:
        tl.store(scale_ptr + row, scale)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    q = tl.clamp(tl.div_rn(x, scale), -fp8_max, fp8_max)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_fp8_rows(
    x: torch.Tensor, row_block: int = ROW_BLOCK, partial_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32), M = rows of x, x ≈ q * scale.
    `row_block`: the widest row loaded once (wider rows take two passes). `partial_amax`
    ([M, P] fp32, the max over P of each row being amax(|row|)): the rows' amax in parts, from
    the kernel that wrote x (the gated skinny GEMM's `row_amax`); then a row is quantized by
    several programs in one pass."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    q = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    if partial_amax is not None:
        assert partial_amax.shape[0] == m and partial_amax.is_contiguous(), partial_amax.shape
        block_n = min(PART_COLUMNS, triton.next_power_of_2(n))
        n_parts = partial_amax.shape[1]
        _quantize_fp8_rows_by_parts_kernel[(m, triton.cdiv(n, block_n))](
            x2,
            partial_amax,
            q,
            scale,
            x2.stride(0),
            q.stride(0),
            n,
            n_parts,
            FP8_MAX,
            1.0 / FP8_MAX,
            MIN_SCALE,
            BLOCK_P=min(1024, triton.next_power_of_2(n_parts)),
            BLOCK_N=block_n,
            num_warps=4,
        )
        return q, scale
    one_block = n <= row_block
    block_n = triton.next_power_of_2(n) if one_block else min(2048, row_block)
    _quantize_fp8_rows_kernel[(m,)](
        x2,
        q,
        scale,
        x2.stride(0),
        q.stride(0),
        n,
        FP8_MAX,
        1.0 / FP8_MAX,
        MIN_SCALE,
        BLOCK_N=block_n,
        ONE_BLOCK=one_block,
        # o_proj's 4,096-wide rows on an H100: 16k rows 66.9 us with 8 warps against 80.9 with
        # 16; 752 rows 4.6 us with 16 against 4.8 with 8.
        num_warps=min(max(block_n // 256, 1), 8 if m >= 2048 else 16),
    )
    return q, scale
