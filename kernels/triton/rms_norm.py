"""RMSNorm fused with the residual add (twin: `kernels.reference.rms_norm`).

One program per row: the row is read once, the residual sum is written once, and the norm
runs in fp32 from registers — the fusion saves a full read+write of the hidden state per
layer compared with a separate add.

The residual stream's dtype rules: `x` may be wider than the residual (a tensor-parallel
row-parallel projection hands over its fp32 all-reduced sum), and the sum is rounded once, to
the residual's dtype, here, instead of by a cast kernel of its own before the add.

`rms_norm_fp8` is the same pass ending in FP8 (W8A8's activation side, as vLLM's fused
`rms_norm_dynamic_per_token_quant`): the normed row, rounded to the model's dtype as
`rms_norm` would write it, is quantized per token (amax / 448) from registers, so the next
FP8 GEMM's input costs no kernel of its own and no round trip of the normed row through
memory. Its codes and scale are exactly `quantize_fp8_rows(rms_norm(...)[0])`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit
from kernels.triton.pdl import gdc_launch_dependents, gdc_wait


@dual_jit(pdl=True)
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
    PDL: tl.constexpr,
):
    if PDL:  # the grid before this one done and visible (see kernels.triton.pdl_enabled)
        gdc_wait()
        gdc_launch_dependents()
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


@dual_jit(pdl=True)
def _rms_norm_fp8_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    q_ptr,
    scale_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_q,
    stride_ro,
    n_cols,
    eps,
    fp8_max,
    inv_fp8_max,
    min_scale,
    HAS_RESIDUAL: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # the grid before this one done and visible (see kernels.triton.pdl_enabled)
        gdc_wait()
        gdc_launch_dependents()
    # The add and the norm: `_rms_norm_kernel`'s body (kept in step with it).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    stream = residual_out_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(stream)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    h = (xf * rstd).to(stream).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # The value `rms_norm` would store (rounded to its output dtype), quantized from registers:
    # `kernels.triton.fp8_quant`'s scale and rounding (kept in step with it; see there why the
    # division is div_rn).
    y = (h * w).to(OUT_DTYPE).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) * inv_fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    q = tl.clamp(tl.div_rn(y, scale), -fp8_max, fp8_max)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


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
        # As `rms_norm_fp8` (the same sum in the same order): 752 rows of 4,096 5.1 us with 16
        # warps against 6.9 with 8 (H100); 1 and 16k rows equal.
        num_warps=min(max(block_n // 256, 1), 16),
    )
    return out, new_residual


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rms_norm` whose normed output is quantized per token to FP8 in the same pass:
    returns (q [M, n] float8_e4m3fn, scale [M, 1] fp32, new_residual), M = rows of x.

    q * scale ≈ the normed row `rms_norm` returns (rounded to its dtype, then quantized as
    `kernels.triton.fp8_quant.quantize_fp8_rows` does); new_residual as in `rms_norm`.
    """
    from kernels.triton.fp8_quant import FP8_MAX, MIN_SCALE

    n = x.shape[-1]
    assert weight.shape == (n,), (weight.shape, n)
    if residual is not None:
        assert residual.shape == x.shape, (residual.shape, x.shape)
    stream = x.dtype if residual is None else residual.dtype
    out_dtype = torch.promote_types(weight.dtype, stream)
    x2 = _as_rows(x, n)
    m = x2.shape[0]
    q = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    new_residual = x if residual is None else torch.empty(x.shape, dtype=stream, device=x.device)
    if m == 0:
        return q, scale, new_residual
    r2 = _as_rows(residual, n) if residual is not None else x2
    ro2 = new_residual.view(-1, n) if residual is not None else x2
    block_n = triton.next_power_of_2(n)
    _rms_norm_fp8_kernel[(m,)](
        x2,
        r2,
        weight if weight.is_contiguous() else weight.contiguous(),
        q,
        scale,
        ro2,
        x2.stride(0),
        r2.stride(0),
        q.stride(0),
        ro2.stride(0),
        n,
        eps,
        FP8_MAX,
        1.0 / FP8_MAX,
        MIN_SCALE,
        HAS_RESIDUAL=residual is not None,
        OUT_DTYPE=_TL_DTYPES[out_dtype],
        BLOCK_N=block_n,
        # 16 warps for a 4,096-wide row: 1 row 2.4 us against 2.8 with 8, 752 rows 6.5 against
        # 6.8 (H100); 16k rows equal (at the copy bandwidth either way). As `rms_norm`'s.
        num_warps=min(max(block_n // 256, 1), 16),
    )
    return q, scale, new_residual
