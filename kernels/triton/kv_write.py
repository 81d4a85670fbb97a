"""Scatter the new tokens' K/V into the paged cache (twin: `kernels.reference.write_kv_cache`).

One program per token copies all of its KV heads (Hkv * D elements, a few KiB) for both K
and V: contiguous rows in, contiguous rows out, so it is a pure bandwidth kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit


@dual_jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
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
):
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
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + tok64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # k/v are often column slices of a fused qkv projection: rows strided, head_dim contiguous,
    # which the kernel takes as is.
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V [T, Hkv, D] into `kv_cache` [2, num_blocks, block_size, Hkv, D] at `slot_mapping` [T].

    Slots < 0 are skipped (padding tokens). Values are cast to the cache's dtype.
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
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping,
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
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
