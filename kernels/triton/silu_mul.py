"""SiLU(gate) * up in one pass (twin: `kernels.reference.silu_and_mul`).

The MLP's gate|up projection comes out as one [T, 2I] tensor; unfused, SiLU writes a [T, I]
temporary that the multiply reads back, in two launches. Here each program reads a slice of
gate and up once and writes the product once. Rounding follows the twin (torch in the model's
dtype): SiLU is rounded to that dtype before the multiply, so bf16 outputs match bit for bit in
almost every element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit

BLOCK = 1024


@dual_jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK_N: tl.constexpr):
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
