"""Scatter the new tokens' K/V into the paged cache (twin: `kernels.reference.write_kv_cache`).

One program per token copies all of its KV heads (Hkv * D elements, a few KiB) for both K
and V: contiguous rows in, contiguous rows out, so it is a pure bandwidth kernel.

An fp8 cache (float8_e4m3fn) stores x * (1 / scale) rounded to e4m3, saturated at +-448, with
the layer's K and V scales (`kernels.reference.unit_kv_scale` documents the [4] vector).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit
from kernels.triton.pdl import gdc_launch_dependents, gdc_wait


@dual_jit(pdl=True)
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    kv_scale_ptr,  # fp32 [4]: k_scale, v_scale, 1 / k_scale, 1 / v_scale (read when QUANT)
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides: [num_blocks, block_size, Hkv, D], K and V halves alike
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    QUANT: tl.constexpr,  # the cache is fp8: scale, saturate and round to e4m3
    PDL: tl.constexpr,
):
    if PDL:  # the grid before this one done and visible (see kernels.triton.pdl_enabled)
        gdc_wait()
        gdc_launch_dependents()
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    # A negative slot marks a padding token (e.g. a CUDA-graph batch padded to its captured
    # size): nothing to write.
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    dst = block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]

    tok64 = tok.to(tl.int64)
    k = tl.load(k_ptr + tok64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + tok64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if QUANT:
        # K and V as one [2, ...] pass: row 0 keys, row 1 values, each times its reciprocal
        # scale, saturated; the cast rounds to nearest even.
        x = tl.join(
            k.to(tl.float32) * tl.load(kv_scale_ptr + 2), v.to(tl.float32) * tl.load(kv_scale_ptr + 3)
        )
        kq, vq = tl.split(tl.clamp(x, -448.0, 448.0))
        tl.store(k_cache_ptr + dst, kq.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, vq.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # k/v are often column slices of a fused qkv projection: rows strided, head_dim contiguous,
    # which the kernel takes as is.
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Scatter new K/V [T, Hkv, D] into `kv_cache` [2, num_blocks, block_size, Hkv, D] at `slot_mapping` [T].

    Slots < 0 are skipped (padding tokens). Values are cast to the cache's dtype; an fp8 cache
    quantizes them with `kv_scale` (fp32 [4] on k's device; None = every scale 1.0).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, (v.shape, k.shape)
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    assert kv_cache.shape[3] == num_kv_heads and kv_cache.shape[4] == head_dim, (kv_cache.shape, k.shape)
    assert kv_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    k = _last_dim_contiguous(k)
    v = _last_dim_contiguous(v)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    quant = kv_cache.dtype == torch.float8_e4m3fn
    if quant and kv_scale is None:
        kv_scale = torch.ones(4, dtype=torch.float32, device=k.device)
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping,
        kv_scale if quant else slot_mapping,  # any pointer when unused
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
        QUANT=quant,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
