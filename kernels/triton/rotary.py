"""NeoX-style (rotate-half) rotary embedding for q and k (twin: `kernels.reference.rotary_embedding`).

One program per token rotates all of its query and key heads: the token's cos/sin row is
loaded once and reused for every head. Works in place (q/k may be strided views into a fused
qkv projection) or out of place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit


@dual_jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    H_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[
        None, :
    ]

    # Queries. (Written out twice rather than as a helper: see DualKernel on nested functions.)
    offs_h = tl.arange(0, H_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & d_mask[None, :]
    src = q_ptr + tok * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = q_out_ptr + tok * stride_qot + offs_h[:, None] * stride_qoh + offs_d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)

    # Keys.
    offs_h = tl.arange(0, HKV_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & d_mask[None, :]
    src = k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = k_out_ptr + tok * stride_kot + offs_h[:, None] * stride_koh + offs_d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(k_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(k_out_ptr.dtype.element_ty), mask=mask)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by `positions` [T]; returns (q_rot, k_rot).

    cos_sin_cache: [max_pos, D], cos in the first D/2 columns, sin in the last D/2 (fp32).
    With `inplace=True` q and k are overwritten and returned (they may be strided views, e.g.
    slices of a fused qkv output, as long as head_dim is contiguous).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim), (q.shape, k.shape)
    assert cos_sin_cache.shape[1] == head_dim and head_dim % 2 == 0, (cos_sin_cache.shape, head_dim)
    assert positions.shape == (num_tokens,), positions.shape
    if inplace:
        assert q.stride(-1) == 1 and k.stride(-1) == 1, "in-place rotary needs a contiguous head_dim"
        q_out, k_out = q, k
    else:
        q = q if q.stride(-1) == 1 else q.contiguous()
        k = k if k.stride(-1) == 1 else k.contiguous()
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    cos_sin = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        H_PAD=triton.next_power_of_2(num_heads),
        HKV_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=4 if num_heads * head_dim >= 2048 else 1,
    )
    return q_out, k_out
