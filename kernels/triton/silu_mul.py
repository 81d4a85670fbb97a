"""SiLU(gate) * up in one pass (twin: `kernels.reference.silu_and_mul`).

The MLP's gate|up projection comes out as one [T, 2I] tensor; unfused, SiLU writes a [T, I]
temporary that the multiply reads back, in two launches. Here each program reads a slice of
gate and up once and writes the product once. Rounding follows the twin (torch in the model's
dtype): SiLU is rounded to that dtype before the multiply, so bf16 outputs match bit for bit in
almost every element.

`silu_and_mul_fp8` ends the same math in FP8 for the down projection's W8A8 GEMM (as vLLM's
fused `silu_and_mul` + quant): a row's per-token scale needs the whole row's amax, so one
program owns a row; the product (rounded to the model's dtype, as `silu_and_mul` would write
it) is quantized from registers when the row fits one block, otherwise in two passes over it
(the amax, then the codes: the second reads gate|up again, mostly from L2). Either way the
[T, I] product never goes through memory and the quantization costs no launch of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit
from kernels.triton.pdl import gdc_launch_dependents, gdc_wait

BLOCK = 1024


@dual_jit(pdl=True)
def _silu_and_mul_kernel(
    x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK_N: tl.constexpr, PDL: tl.constexpr
):
    if PDL:  # the grid before this one done and visible (see kernels.triton.pdl_enabled)
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate | up) -> [..., I] = SiLU(gate) * up, in x's dtype."""
    n = x.shape[-1] // 2
    assert x.shape[-1] == 2 * n, x.shape
    rows = x.reshape(-1, 2 * n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = min(BLOCK, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
            rows, out, n, rows.stride(0), out.stride(0), BLOCK_N=block
        )
    return out.reshape(*x.shape[:-1], n)


ROW_BLOCK = 16384  # one block holds a row of up to this many outputs (the 8B MLP's 14,336)


@dual_jit(pdl=True)
def _silu_and_mul_fp8_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    n_cols,
    stride_x,
    stride_q,
    fp8_max,
    inv_fp8_max,
    min_scale,
    OUT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # the grid before this one done and visible (see kernels.triton.pdl_enabled)
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK_N)
    if ONE_BLOCK:
        mask = offs < n_cols
        gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        # `_silu_and_mul_kernel`'s rounding: SiLU, then the product, each in the model's dtype.
        silu = (gate / (1.0 + tl.exp(-gate))).to(OUT_DTYPE).to(tl.float32)
        y = (silu * up).to(OUT_DTYPE).to(tl.float32)
        amax = tl.max(tl.abs(y), axis=0)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + offs
            mask = cols < n_cols
            gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(x_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(OUT_DTYPE).to(tl.float32)
            acc = tl.maximum(acc, tl.abs((silu * up).to(OUT_DTYPE).to(tl.float32)))
        amax = tl.max(acc, axis=0)
    # `kernels.triton.fp8_quant`'s scale and rounding (kept in step with it; see there why).
    scale = tl.maximum(amax * inv_fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + offs
        mask = cols < n_cols
        if not ONE_BLOCK:
            gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(x_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(OUT_DTYPE).to(tl.float32)
            y = (silu * up).to(OUT_DTYPE).to(tl.float32)
        q = tl.clamp(tl.div_rn(y, scale), -fp8_max, fp8_max)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _fp8_warps(rows: int, block: int) -> int:
    """Warps a row's program: eight for many rows (a prefill: more programs resident an SM, so
    one's loads overlap another's reduction and stores), 32 for few (each row sooner).
    H100, 8B's 14,336-wide rows: 16k rows 466 us with 8 against 501 with 16; 752 rows 29.0 us
    with 32 against 30.6 with 16; at 4,096 rows all within 2 %."""
    if block < 8192:
        return min(max(block // 512, 1), 16)
    return 8 if rows >= 2048 else 32


def silu_and_mul_fp8(x: torch.Tensor, row_block: int = ROW_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2I] (gate | up) -> (q [M, I] float8_e4m3fn, scale [M, 1] fp32), M = rows of x:
    `silu_and_mul(x)` (in x's dtype) quantized per token as `quantize_fp8_rows` does.
    `row_block`: the widest row one block holds (wider rows take two passes)."""
    from kernels.triton.fp8_quant import FP8_MAX, MIN_SCALE

    n = x.shape[-1] // 2
    assert x.shape[-1] == 2 * n, x.shape
    rows = x.reshape(-1, 2 * n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    q = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    one_block = n <= row_block
    block = triton.next_power_of_2(n) if one_block else min(BLOCK * 4, row_block)
    _silu_and_mul_fp8_kernel[(m,)](
        rows,
        q,
        scale,
        n,
        rows.stride(0),
        q.stride(0),
        FP8_MAX,
        1.0 / FP8_MAX,
        MIN_SCALE,
        OUT_DTYPE=_TL_DTYPES[x.dtype],
        BLOCK_N=block,
        ONE_BLOCK=one_block,
        num_warps=_fp8_warps(m, block),
    )
    return q, scale
