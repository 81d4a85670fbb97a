"""RMSNorm fused with the residual add (twin: `kernels.reference.rms_norm`).

One program per row: the row is read once, the residual sum is written once, and the norm
runs in fp32 from registers — the fusion saves a full read+write of the hidden state per
layer compared with a separate add.

The residual stream's dtype rules: `x` may be wider than the residual (a tensor-parallel
row-parallel projection hands over its fp32 all-reduced sum), and the sum is rounded once, to
the residual's dtype, here, instead of by a cast kernel of its own before the add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit


@dual_jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    # The stream's dtype: the residual's (residual_out aliases x when there is none).
    stream = residual_out_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # Add in fp32 and round once to the stream's dtype: what torch does for
        # `(x + residual).to(residual.dtype)` (for equal dtypes, just `x + residual`).
        x = (x.to(tl.float32) + r.to(tl.float32)).to(stream)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    # Round the normed value to the stream's dtype before the weight multiply, as the twin
    # (and Hugging Face's LlamaRMSNorm) does, so bf16 outputs match bit for bit in most elements.
    h = (xf * rstd).to(stream).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (h * w).to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, fused with the residual add: returns (normed, new_residual).

    new_residual = x + residual rounded once to residual's dtype (x itself when residual is
    None); the norm runs in fp32; normed has dtype promote(weight.dtype, new_residual.dtype),
    as in the twin. `residual` must have x's shape; x may be wider (an fp32 sum). `out`, when
    given, receives normed.
    """
    n = x.shape[-1]
    assert weight.shape == (n,), (weight.shape, n)
    if residual is not None:
        assert residual.shape == x.shape, (residual.shape, x.shape)
    stream = x.dtype if residual is None else residual.dtype
    out_dtype = torch.promote_types(weight.dtype, stream)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == out_dtype and out.is_contiguous()
    new_residual = x if residual is None else torch.empty(x.shape, dtype=stream, device=x.device)
    if x.numel() == 0:
        return out, new_residual

    x2 = _as_rows(x, n)
    r2 = _as_rows(residual, n) if residual is not None else x2
    o2 = out.view(-1, n)
    ro2 = new_residual.view(-1, n) if residual is not None else x2
    block_n = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight if weight.is_contiguous() else weight.contiguous(),
        o2,
        ro2,
        x2.stride(0),
        r2.stride(0),
        o2.stride(0),
        ro2.stride(0),
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block_n,
        num_warps=min(max(block_n // 256, 1), 8),
    )
    return out, new_residual
