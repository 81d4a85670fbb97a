"""Rotary embedding and the KV-cache write in one kernel (twin: `kernels.reference.rotary_and_write_kv`).

An attention layer rotates q and k, then scatters k and v into the paged cache: two launches
and a round trip of k through memory. Fused, one program per token loads its cos/sin row,
rotates its query heads in place, rotates its key heads (written back in place too, so q and
k end as `kernels.reference.rotary_embedding` returns them) and stores the rotated keys and
the values at the token's cache slot. A negative slot (a padding row of a CUDA-graph batch)
rotates but writes no cache. At batch 1 this saves a launch per layer; in a prefill it saves
reading k back.

An fp8 cache (float8_e4m3fn) stores the rotated keys (rounded to k's dtype first, as the
unfused path does) and the values times their reciprocal scales, rounded to e4m3 and
saturated at +-448 (`kernels.reference.unit_kv_scale` documents the scales vector).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit, is_interpreted
from kernels.triton.pdl import gdc_launch_dependents, gdc_wait
from kernels.triton.rounding import mul_rn


@dual_jit(pdl=True)
def _rotary_kv_write_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    kv_scale_ptr,  # fp32 [4]: k_scale, v_scale, 1 / k_scale, 1 / v_scale (read when QUANT)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_cb,  # cache strides: [num_blocks, block_size, Hkv, D], K and V halves alike
    stride_cbs,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    H_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    QUANT: tl.constexpr,  # the cache is fp8: scale, saturate and round to e4m3
    ROTATE_Q: tl.constexpr,  # else q is left as it is (the decode kernel after this one rotates it)
    ROUND_PRODUCTS: tl.constexpr,  # GPU: each product rounded on its own (the interpreter never fuses)
    PDL: tl.constexpr,
):
    if PDL:  # the grid before this one done and visible (see kernels.triton.pdl_enabled)
        gdc_wait()
        gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[
        None, :
    ]

    # Queries, in place. (Keys below repeat the pattern rather than share a helper: see
    # DualKernel on nested functions.) Each product is rounded before the sum, never contracted
    # into an fma: the twin's bits, and the decode kernel's when it rotates q itself
    # (paged_decode's ROTATE_Q). Left to the compiler, the two kernels contracted differently.
    if ROTATE_Q:
        offs_h = tl.arange(0, H_PAD)
        mask = (offs_h[:, None] < NUM_HEADS) & d_mask[None, :]
        at = q_ptr + tok * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
        x1 = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(at + HALF, mask=mask, other=0.0).to(tl.float32)
        if ROUND_PRODUCTS:
            r1 = mul_rn(x1, cos) - mul_rn(x2, sin)
            r2 = mul_rn(x2, cos) + mul_rn(x1, sin)
        else:
            r1 = x1 * cos - x2 * sin
            r2 = x2 * cos + x1 * sin
        tl.store(at, r1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(at + HALF, r2.to(q_ptr.dtype.element_ty), mask=mask)

    # Keys, in place, rounded to k's dtype as the unfused path rounds them before the write.
    offs_h = tl.arange(0, HKV_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & d_mask[None, :]
    at = k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    x1 = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=mask, other=0.0).to(tl.float32)
    if ROUND_PRODUCTS:
        k1 = (mul_rn(x1, cos) - mul_rn(x2, sin)).to(k_ptr.dtype.element_ty)
        k2 = (mul_rn(x2, cos) + mul_rn(x1, sin)).to(k_ptr.dtype.element_ty)
    else:
        k1 = (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty)
        k2 = (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty)
    tl.store(at, k1, mask=mask)
    tl.store(at + HALF, k2, mask=mask)

    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        dst = block * stride_cb + offset * stride_cbs + offs_h[:, None] * stride_ch + offs_d[None, :]
        at = v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        v1 = tl.load(at, mask=mask, other=0.0)
        v2 = tl.load(at + HALF, mask=mask, other=0.0)
        if QUANT:
            # The four halves as one [H, HALF, 2, 2] pass, saturated; the cast below rounds to
            # nearest even. New names: the compiler refuses a variable whose type changes
            # inside the `if slot` block.
            kk = tl.join(k1.to(tl.float32), k2.to(tl.float32)) * tl.load(kv_scale_ptr + 2)
            vv = tl.join(v1.to(tl.float32), v2.to(tl.float32)) * tl.load(kv_scale_ptr + 3)
            kq, vq = tl.split(tl.clamp(tl.join(kk, vv), -448.0, 448.0))
            kq1, kq2 = tl.split(kq)
            vq1, vq2 = tl.split(vq)
            tl.store(k_cache_ptr + dst, kq1.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(k_cache_ptr + dst + HALF, kq2.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst, vq1.to(v_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst + HALF, vq2.to(v_cache_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(k_cache_ptr + dst, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(k_cache_ptr + dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotary_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    rotate_q: bool = True,
) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place by `positions` [T], then write the rotated
    k and v [T, Hkv, D] into `kv_cache` [2, num_blocks, block_size, Hkv, D] at `slot_mapping`
    [T] (slots < 0 are skipped). q, k and v may be strided views (slices of a fused qkv output)
    with a contiguous head_dim. cos_sin_cache: [max_pos, D], cos then sin (fp32). An fp8 cache
    quantizes with `kv_scale` (fp32 [4] on q's device; None = every scale 1.0). With
    `rotate_q=False` q is left alone: the decode attention after this kernel rotates it
    (`kernels.triton.paged_attention.decode_rotates_q`).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (q.shape, k.shape, v.shape)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    assert cos_sin_cache.shape[1] == head_dim and head_dim % 2 == 0, (cos_sin_cache.shape, head_dim)
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    assert kv_cache.shape[3] == num_kv_heads and kv_cache.shape[4] == head_dim, (kv_cache.shape, k.shape)
    assert kv_cache.stride(-1) == 1
    assert positions.shape == slot_mapping.shape == (num_tokens,), (positions.shape, slot_mapping.shape)
    if num_tokens == 0:
        return
    cos_sin = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    half = head_dim // 2
    quant = kv_cache.dtype == torch.float8_e4m3fn
    if quant and kv_scale is None:
        kv_scale = torch.ones(4, dtype=torch.float32, device=q.device)
    _rotary_kv_write_kernel[(num_tokens,)](
        positions,
        q,
        k,
        v,
        cos_sin,
        key_cache,
        value_cache,
        slot_mapping,
        kv_scale if quant else slot_mapping,  # any pointer when unused
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_SIZE=kv_cache.shape[2],
        H_PAD=triton.next_power_of_2(num_heads),
        HKV_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(half),
        QUANT=quant,
        ROTATE_Q=rotate_q,
        ROUND_PRODUCTS=not is_interpreted(q.device),
        num_warps=4 if num_heads * head_dim >= 2048 else 1,
    )
