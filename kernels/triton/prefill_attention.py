"""Causal attention of long prefill chunks over the paged cache (twin: `reference.prefill_attention`).

The same function as `paged_attention` (same arguments, same metadata, same results): query j
of a sequence with q_len new tokens sits at absolute position seq_len - q_len + j and sees keys
0..that position, read from the paged cache through the block table (the chunk's own K/V are
already written there). What differs is the shape of the work, tuned for chunks of thousands
of tokens on top of prefixes of up to 128k (issue 31), in the FlashAttention-2 style of
Triton's fused-attention tutorial:

* big tiles: a program owns BLOCK_Q query tokens times the GROUP query heads of one KV head
  (GQA packing: BLOCK_M = BLOCK_Q * GROUP rows, 128 by default), so each K/V tile loaded
  feeds one [BLOCK_M, D] x [D, BLOCK_N] product on the tensor cores for the whole group;
* causal block skipping: the keys a program walks stop at its last query's position; tiles
  that every row sees in full (the prefix, the chunk below the diagonal) run with no mask
  and no bounds checks, only the one or two tiles on the diagonal are masked;
* the softmax in the log2 domain, scale * log2(e) folded into one multiply, exp2, the
  running max subtracted in the same fused multiply-add (the tutorial's form);
* longest rows first: program 0 takes the last query block of the batch (for one long
  prompt the rows with the most keys), so the short blocks fill the tail of the launch
  instead of one long block running alone at the end.

Measured on an H200 (docs/benchmarks.md, issue 31; bf16 matmul peak 772-784 TFLOP/s; 32 query /
8 KV heads, D=128): one causal prompt of 16k-128k tokens at 403-416 TFLOP/s (51-54 %), in 8k
chunks over the cached prefix 396-416, against the unified kernel's 358-384. Triton's warp
specialisation (`tl.range(warp_specialize=True)`) changed nothing on Hopper (414 vs 416).
torch SDPA (cuDNN) runs the same causal prompts at 555-645 TFLOP/s, which is why the backend
gives it the long chunks over long contexts and keeps this kernel for the others.

`paged_attention` stays the kernel of decodes and short chunks. Every row of any batch is
correct here too (a decode's block of BLOCK_Q tokens holds one real row), but the backend
gives this kernel only the chunks of `PREFILL_MIN_QUERY` tokens or more (`min_query_len`), and
only where FlashAttention is not taken (worker_svc/attention/long_prefill.py).

`merge_two`, at the end, is that module's other kernel: it joins SDPA's two calls for a chunk
over a cached prefix (prefix, causal square) by their logsumexps in one pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_metadata import AttentionMetadata
from kernels.triton import dual_jit, is_interpreted

_LOG2E = 1.4426950408889634

# Chunks of at least this many query tokens are "long": the attention backend sends them to
# SDPA on CUDA, or to this kernel (worker_svc/attention/long_prefill.py). Shorter rows stay with
# the unified kernel, whose smaller tiles waste less on ragged short rows.
PREFILL_MIN_QUERY = 1024
# ... in batches that reach a context of this many tokens: below it the new path gained ~3 %
# (a 4k prompt on an H200: 102 ms against 105), not worth a first-use compilation in the middle
# of a short-prompt workload (ShareGPT-shaped batches keep the unified kernel, as before).
PREFILL_MIN_CONTEXT = 8192

# Per-step integers: a new divisibility-by-16 combination met mid-run would cost a compilation.
_VARYING = ["num_seqs", "num_q_blocks", "min_query_len", "stride_bt"]


@dual_jit(do_not_specialize=_VARYING)
def _prefill_attn_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [T, H, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    kv_scale_ptr,  # fp32 [4]: k_scale, v_scale, ... (read when KV_FP8)
    scale_log2,  # softmax scale * log2(e)
    num_seqs,
    num_q_blocks,  # the grid's size: program p owns global query block num_q_blocks - 1 - p
    min_query_len,  # sequences with fewer query tokens are left to another kernel
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (>= 16)
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size (tokens)
    BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q * GROUP (a power of two)
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # keys per inner iteration
    DOT_UPCAST: tl.constexpr,  # feed tl.dot fp32 (interpreter: its bf16 dot is broken)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no silent tf32)
    KV_FP8: tl.constexpr,  # the cache holds e4m3 codes times the scales at kv_scale_ptr
    WARP_SPEC: tl.constexpr,  # Triton's warp specialisation of the unmasked loop (loads vs math)
):
    # Longest rows first: the last query block of the batch is program 0.
    q_block_global = num_q_blocks - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)

    # ---- sequence and local query block: largest i with query_start_loc[i] // BLOCK_Q + i <= block
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    seq_idx = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_block_local = q_block_global - (q_start // BLOCK_Q + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    if q_block_local * BLOCK_Q >= q_len:  # a slot of the grid's upper bound that owns nothing
        return
    if q_len < min_query_len:
        return
    context_len = tl.load(seq_lens_ptr + seq_idx) - q_len  # tokens cached before this chunk

    # ---- rows: row m is query token m // GROUP of the block, head kv_head * GROUP + m % GROUP
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    q_pos = q_block_local * BLOCK_Q + offs_m // GROUP  # within the chunk
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = q_pos < q_len
    d_valid = offs_d < HEAD_DIM
    q_tok = (q_start + q_pos).to(tl.int64)
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(
        q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )
    if DOT_UPCAST:
        q = q.to(tl.float32)
    q_abs = context_len + q_pos  # last key each row sees (inclusive)

    qk_scale = scale_log2
    if KV_FP8:
        qk_scale = scale_log2 * tl.load(kv_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    block_table = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    # Keys [0, kv_end): the block's last query sees them all. Tiles below n_full are seen in
    # full by the block's first query, hence by every row: no mask. The rest (the diagonal, at
    # most cdiv(BLOCK_Q, BLOCK_N) + 1 tiles) is masked.
    kv_end = context_len + tl.minimum(q_block_local * BLOCK_Q + BLOCK_Q, q_len)
    n_full = (context_len + q_block_local * BLOCK_Q + 1) // BLOCK_N
    n_tiles = tl.cdiv(kv_end, BLOCK_N)
    for phase in tl.static_range(2):
        if phase == 0:
            t_lo = 0
            t_hi = n_full
        else:
            t_lo = n_full
            t_hi = n_tiles
        for tile in tl.range(t_lo, t_hi, warp_specialize=WARP_SPEC):
            kv_pos = tile * BLOCK_N + offs_n
            if phase == 0:
                phys = tl.load(block_table + kv_pos // BLOCK_SIZE).to(tl.int64)
            else:
                phys = tl.load(block_table + kv_pos // BLOCK_SIZE, mask=kv_pos < kv_end, other=0).to(tl.int64)
            slot_k = phys * stride_kb + (kv_pos % BLOCK_SIZE) * stride_ks
            slot_v = phys * stride_vb + (kv_pos % BLOCK_SIZE) * stride_vs
            k_ptrs = k_head + slot_k[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_PAD]
            v_ptrs = v_head + slot_v[:, None] + offs_d[None, :]
            if phase == 0 and HEAD_PAD == HEAD_DIM:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            elif phase == 0:
                k = tl.load(k_ptrs, mask=d_valid[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)
            else:
                # Padding keys read zeros, not a slot's junk: a NaN there would reach p @ v.
                kv_mask = (kv_pos < kv_end)[:, None] & d_valid[None, :]
                k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
                v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
            k = k.to(q.dtype)
            v = v.to(q.dtype)

            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
            if phase == 0:
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                qk = qk * qk_scale - m_new[:, None]
            else:
                # Causality also hides the padding keys past kv_end (every row's q_abs < kv_end);
                # a padding row (past q_len) sees finite junk that is never stored.
                visible = kv_pos[None, :] <= q_abs[:, None]
                qk = tl.where(visible, qk * qk_scale, -1.0e6)
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                qk = qk - m_new[:, None]
            p = tl.exp2(qk)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new

    o = acc / l_i[:, None]
    if KV_FP8:
        o = o * tl.load(kv_scale_ptr + 1)
    tl.store(
        out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False


def default_config(head_pad: int, group: int) -> PrefillConfig:
    """Tile shape for head dims up to 128: 128 rows x 128 keys, 8 warps, 3 stages. Swept on an
    H200 (bf16, 32/8 heads, D=128, one 32k prompt): 417 TFLOP/s; 128 x 64 with 8 warps 360, with
    4 warps 373; 64 x 64 373; 256 x 64 379 (docs/benchmarks.md, issue 31)."""
    if head_pad > 128:  # the fp32 accumulator and the K/V stages must fit
        cfg = PrefillConfig(64, 32, 4, 2)
    else:
        cfg = PrefillConfig(128, 128, 8, 3)
    # A program holds at least one query token with all of its group's heads.
    return dataclasses.replace(cfg, block_m=max(cfg.block_m, triton.next_power_of_2(group)))


def use_prefill_kernel(meta: AttentionMetadata) -> bool:
    """True when the batch holds a long chunk and a long context (the benchmark sets
    PREFILL_MIN_QUERY past any chunk to time the unified kernel alone, the path before issue 31)."""
    return meta.max_query_len >= PREFILL_MIN_QUERY and meta.max_seq_len >= PREFILL_MIN_CONTEXT


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    kv_scale: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
    min_query_len: int = 0,
) -> torch.Tensor:
    """`paged_attention`'s function with prefill-shaped tiles: each query token attends to its
    sequence's cached context, causal within the chunk.

    q: [T, H, D]; kv_cache: [2, num_blocks, block_size, Hkv, D] holding the new tokens' K/V
    already; returns `out` ([T, H, D], q's dtype). An fp8 cache is read with `kv_scale` (fp32
    [4], `kernels.reference.unit_kv_scale`'s layout; None = every scale 1.0). Reads only
    host-side metadata, never syncs. Rows of sequences with fewer than `min_query_len` query
    tokens are not written (`worker_svc.attention.long_prefill` leaves them to the unified kernel).
    """
    num_tokens, num_heads, head_dim = q.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0, (q.shape, kv_cache.shape)
    assert kv_cache.stride(-1) == 1
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(-1) == 1, (out.shape, out.stride())
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()

    group = num_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_dim))
    assert head_pad <= 256, "head_dim > 256 is not supported"
    cfg = config or default_config(head_pad, group)
    assert cfg.block_m % group == 0, (cfg, group)
    block_q = cfg.block_m // group
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if kv_fp8 and kv_scale is None:
        kv_scale = torch.ones(4, dtype=torch.float32, device=q.device)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    # Upper bound on query_start_loc[i] // BLOCK_Q + i + (blocks of sequence i): no sync.
    num_q_blocks = num_tokens // block_q + meta.num_seqs
    _prefill_attn_kernel[(num_q_blocks, num_kv_heads)](
        q,
        key_cache,
        value_cache,
        out,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        kv_scale if kv_fp8 else meta.seq_lens,  # any pointer when unused
        scale * _LOG2E,
        meta.num_seqs,
        num_q_blocks,
        min_query_len,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        meta.block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=block_q,
        BLOCK_N=cfg.block_n,
        DOT_UPCAST=is_interpreted(q.device) and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        WARP_SPEC=cfg.warp_specialize and not is_interpreted(q.device),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


@dual_jit(do_not_specialize=["num_rows", "stride_at", "stride_ah", "stride_bt", "stride_bh", "stride_ot"])
def _merge_two_kernel(
    a_ptr,  # [T, H, D]: attention over one key set, normalised
    lse_a_ptr,  # [H, T] fp32 (any strides): its natural logsumexp per row
    b_ptr,  # [T, H, D]: over the other key set
    lse_b_ptr,
    out_ptr,  # [T, H, D]
    num_rows,
    stride_at,
    stride_ah,
    stride_lah,
    stride_lat,
    stride_bt,
    stride_bh,
    stride_lbh,
    stride_lbt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_PAD)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows64 = rows.to(tl.int64)
    lse_a = tl.load(lse_a_ptr + head * stride_lah + rows64 * stride_lat, mask=row_ok, other=0.0)
    lse_b = tl.load(lse_b_ptr + head * stride_lbh + rows64 * stride_lbt, mask=row_ok, other=0.0)
    m = tl.maximum(lse_a, lse_b)
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    inv = 1.0 / (w_a + w_b)
    a = tl.load(
        a_ptr + rows64[:, None] * stride_at + head * stride_ah + offs_d[None, :], mask=mask, other=0.0
    )
    b = tl.load(
        b_ptr + rows64[:, None] * stride_bt + head * stride_bh + offs_d[None, :], mask=mask, other=0.0
    )
    o = (a.to(tl.float32) * (w_a * inv)[:, None]) + (b.to(tl.float32) * (w_b * inv)[:, None])
    tl.store(
        out_ptr + rows64[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def merge_two(
    a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Attention over two disjoint key sets joined into attention over both, written into `out`
    in one pass (twin: `kernels.reference.merge_attn_partials` over the two stacked).

    a, b: [T, H, D] (any strides, the last 1), each normalised over its keys; lse_a, lse_b:
    [H, T] fp32 logsumexps of the rows' scores (any strides; every row saw a key in each set);
    out: [T, H, D]. out = (e^lse_a a + e^lse_b b) / (e^lse_a + e^lse_b), in fp32 registers:
    the torch form of `worker_svc.attention.long_prefill` took five passes over the chunk
    (fp32 copies of both, the weights, the blend, a cast) and a sixth to copy into the batch.
    """
    num_rows, num_heads, head_dim = out.shape
    assert a.shape == b.shape == out.shape, (a.shape, b.shape, out.shape)
    assert lse_a.shape == lse_b.shape == (num_heads, num_rows), (lse_a.shape, lse_b.shape)
    assert a.stride(-1) == b.stride(-1) == out.stride(-1) == 1
    if num_rows == 0:
        return out
    block_t = 32
    _merge_two_kernel[(triton.cdiv(num_rows, block_t), num_heads)](
        a,
        lse_a,
        b,
        lse_b,
        out,
        num_rows,
        a.stride(0),
        a.stride(1),
        lse_a.stride(0),
        lse_a.stride(1),
        b.stride(0),
        b.stride(1),
        lse_b.stride(0),
        lse_b.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_T=block_t,
        num_warps=4,
    )
    return out
