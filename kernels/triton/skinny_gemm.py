"""y = x @ W.T for a few rows of x: the decode steps' GEMMs (twin: `kernels.reference.linear`).

At batch 1-16 a decode GEMM only streams its weight matrix: the work is the matrix's bytes, the
arithmetic is nothing. cuBLAS picks kernels tuned for general shapes; on some decode shapes
(an 8B model's o_proj on an H100 reached half the copy bandwidth) it leaves bandwidth unused.
Here one program owns BLOCK_N output columns for every row of x and walks K in BLOCK_K tiles,
so each weight element is read once, by one program, in contiguous rows (W is [N, K] as
`nn.Linear` stores it). Accumulation is fp32; the output is rounded once to out's dtype (fp32
out keeps the sum unrounded, as the tensor-parallel row-parallel layers want).

Two bodies, one kernel: with DOT the rows are padded to BLOCK_M >= 16 and multiplied on the
tensor cores (padding rows cost no bandwidth); without, BLOCK_M is 1 and the tile is reduced
with a plain multiply and sum (no padding, fewer registers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit, is_interpreted


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True

    def __str__(self) -> str:
        body = "dot" if self.dot else "sum"
        return f"{body} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}"


# N and K are fixed per layer (Triton specialising on them lets it prove the K loop needs no
# mask); M varies step to step and the body pads it anyway, so it is not specialised.
@dual_jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    scale_ptr,
    x_scale_ptr,
    HAS_SCALE: tl.constexpr,
    HAS_X_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_FP32:  # the interpreter's dot reads 16-bit floats as garbage: exact fp32 instead
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif DOT and HAS_SCALE and not HAS_X_SCALE:  # FP8 W, 16-bit x: W widened
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        elif DOT:  # same dtypes (FP8 x FP8 included: Hopper's FP8 tensor cores)
            acc += tl.dot(x.to(w.dtype), tl.trans(w))
        else:  # BLOCK_M == 1: [1, K] * [N, K] summed over K
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
    if HAS_SCALE:  # the weight's per-output-channel scales, applied once to the fp32 sums
        acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_X_SCALE:  # FP8 rows of x: each row's own scale
        acc *= tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    config: SkinnyConfig | None = None,
    scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T -> [..., N] in `out_dtype` (x's by default), fp32 accumulation.

    For few rows (the body pads them to BLOCK_M): meant for M <= 16; any M is computed right.
    `scale` ([N] fp32): FP8 weights' per-output-channel scales (W8A16: x is not quantized, the
    GEMM only streams the weight's bytes, one per element), output column n times scale[n].
    `x_scale` ([M] or [M, 1] fp32): x is FP8 too, quantized per row (W8A8, the FP8 tensor
    cores), output row m times x_scale[m]; `out_dtype` must then be given.
    """
    cfg = config or SkinnyConfig()
    n, k = weight.shape
    assert x.shape[-1] == k, (x.shape, weight.shape)
    assert weight.stride(-1) == 1, "the weight's rows must be contiguous"
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    dot = cfg.dot or m > 1
    block_m = max(16, triton.next_power_of_2(m)) if dot else 1
    _skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
        rows,
        weight,
        out,
        m,
        n,
        k,
        rows.stride(0),
        weight.stride(0),
        out.stride(0),
        scale if scale is not None else out,
        x_scale if x_scale is not None else out,
        HAS_SCALE=scale is not None,
        HAS_X_SCALE=x_scale is not None,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT=dot,
        DOT_FP32=dot
        and (is_interpreted(x.device) or x.dtype == torch.float32 or weight.dtype == torch.float32),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out.reshape(*x.shape[:-1], n)
