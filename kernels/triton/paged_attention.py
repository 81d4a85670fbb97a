"""Paged attention over block tables for a mixed varlen batch (twin: `kernels.reference.paged_attention`).

The batch is flat: queries [T, H, D] of several sequences, `query_start_loc` [B + 1] marking
where each sequence's new tokens start, `seq_lens` [B] its context length after this step
(cached prefix + new tokens), `block_tables` [B, max_blocks] the cache blocks holding that
context. The new tokens' K/V are already in the cache. Query j of a sequence with q_len new
tokens sits at absolute position seq_len - q_len + j and sees keys 0..that position: plain
decode (q_len = 1), chunked prefill on top of a cached prefix, and whole prompts are all the
same rule, so one kernel serves the whole mixed batch.

Two launches, in the style of vLLM's triton_unified_attention and flash-decoding:

* unified (prefill, decode, mixed): grid (query blocks, KV heads). A program owns BLOCK_Q
  consecutive query tokens of one sequence times the GROUP query heads that share one KV
  head (GQA), BLOCK_M = BLOCK_Q * GROUP rows, so every K/V tile is loaded once for the whole
  group and fed to tensor cores as one [BLOCK_M, D] x [D, TILE] product. It walks the
  context in tiles of TILE tokens (gathering the physical block of each token from the
  block table) with an online softmax in fp32, and stops at the last key its queries can see.
  Query blocks are numbered per sequence as `query_start_loc[i] // BLOCK_Q + i + local`, which
  gives a grid size known on the host (T // BLOCK_Q + B) and lets a program find its sequence
  by a binary search over `query_start_loc`: no host sync, no per-step index tensor.
* split-K (flash decoding, pure decode with long contexts and too few (sequence, KV head)
  programs to fill the GPU): the same kernel with a third grid axis of NUM_SPLITS segments,
  each covering a contiguous share of the sequence's tiles and writing a normalised partial
  output plus its logsumexp; a second kernel merges the segments.

All arithmetic on scores runs in fp32 in the log2 domain (scale * log2(e) folded into one
multiply, exp2 on the fast path). Tiles that every query row of a program sees in full (the
cached prefix; for decode all but the last tile) run without any mask.

An fp8 cache (float8_e4m3fn, per-tensor scales per layer for K and for V) is loaded as fp8,
half the bytes, and upcast in registers to q's dtype (exact: e4m3 fits in bf16). The scales
never touch the tiles: k_scale folds into the softmax scale (q . k = k_scale * q . k8) and
v_scale into the output (sum p v = v_scale * sum p v8), as FlashInfer's bmm1/bmm2 scales do.

Measured on an H100 (bf16, 32 query / 8 KV heads, D=128, block size 16): decode of 64 x 8k
tokens 712 us (3.0 TB/s of K/V read); 1 x 8k decode 15 us with split-K (212 us unsplit);
causal prefill 4 x 2k 320 TFLOP/s and 1 x 8k 360 TFLOP/s (torch SDPA/flash: ~515).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_metadata import AttentionMetadata
from kernels.triton import dual_jit, is_interpreted
from kernels.triton.paged_decode import paged_decode, rotates_q, takes_decode_kernel
from kernels.triton.pdl import gdc_launch_dependents, gdc_wait

_LOG2E = 1.4426950408889634

# Pure-decode batches with an fp8 cache, large bf16 ones, and long-context ones that leave
# the SMs mostly idle go to `kernels.triton.paged_decode` (`takes_decode_kernel`: configs and
# splits for one wave of resident programs, large batches longest context first, an fp16 path
# for the fp8 cache). LLMESH_PAGED_DECODE=unified keeps all of them on this module's
# unified/split-K kernel, the path before issue 31's decode work, so that a benchmark can run
# both side by side.
_UNIFIED_DECODE = os.environ.get("LLMESH_PAGED_DECODE", "") == "unified"

# Split-K heuristics (pure decode): aim for about this many waves of programs over the SMs,
# never split below this many context tokens per segment, never more than this many segments.
# Measured on an H100 (bf16, 32 query / 8 KV heads, D=128, CUDA-graph timings): 1 sequence
# of 8k tokens went 212 -> 15 us with 32 segments; batches of 64 were best unsplit.
_SPLIT_TARGET_WAVES = 3
_SPLIT_MIN_TOKENS = 128
_SPLIT_MAX = 32


# Triton compiles a variant per combination of integer arguments equal to 1, divisible by 16
# or neither: the batch size and the split count (and the partials' strides, which follow it)
# vary from step to step, and each new combination met mid-run cost a compilation (~1 s).
_VARYING = ["num_seqs", "num_splits", "stride_pt", "stride_ph", "stride_ps", "stride_lt", "stride_lh"]


@dual_jit(pdl=True, do_not_specialize=_VARYING)
def _paged_attn_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [T, H, D] (unified launch)
    part_out_ptr,  # [T, H, NUM_SPLITS, D] fp32 (split launch)
    part_lse_ptr,  # [T, H, NUM_SPLITS] fp32 (split launch)
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    kv_scale_ptr,  # fp32 [4]: k_scale, v_scale, 1 / k_scale, 1 / v_scale (read when KV_FP8)
    scale_log2,  # softmax scale * log2(e)
    num_seqs,
    num_splits,
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
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (>= 16 for tl.dot)
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size (tokens)
    BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q * GROUP, padded to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per program
    TILE: tl.constexpr,  # context tokens per inner iteration
    DECODE_ONLY: tl.constexpr,  # every sequence has exactly one query: program i is sequence i
    SPLIT: tl.constexpr,  # write partials per segment (grid axis 2) instead of the output
    DOT_UPCAST: tl.constexpr,  # feed tl.dot fp32 (interpreter: its bf16 dot is broken)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no silent tf32), else "tf32" (unused)
    KV_FP8: tl.constexpr,  # the cache holds e4m3 codes times the scales at kv_scale_ptr
    PDL: tl.constexpr,
):
    if PDL:  # the grid before this one done and visible (see kernels.triton.pdl_enabled)
        gdc_wait()
        gdc_launch_dependents()
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    # ---- which sequence and which block of its queries this program owns
    if DECODE_ONLY:
        seq_idx = q_block_global
        q_block_local = 0
    else:
        # Largest i with query_start_loc[i] // BLOCK_Q + i <= q_block_global.
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            start_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if start_block <= q_block_global:
                lo = mid + 1
            else:
                hi = mid
        seq_idx = lo - 1
        q_block_local = q_block_global - (tl.load(query_start_loc_ptr + seq_idx) // BLOCK_Q + seq_idx)

    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    # Grid slots between two sequences' block ranges (the grid is an upper bound) own nothing.
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - q_len  # tokens cached before this step's chunk

    # ---- rows: row m is query token (m // GROUP) of the block, head kv_head * GROUP + m % GROUP
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_pos = q_block_local * BLOCK_Q + offs_m // GROUP  # position within the chunk
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_pos < q_len)
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
    # Last key each row may see (inclusive): causal within the chunk, all of the prefix.
    q_abs = context_len + q_pos

    # ---- the context range this program walks
    kv_end = context_len + tl.minimum(q_block_local * BLOCK_Q + BLOCK_Q, q_len)  # exclusive
    num_tiles = tl.cdiv(kv_end, TILE)
    if SPLIT:
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        tile_lo = segment * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        tile_lo = 0
        tile_hi = num_tiles

    if KV_FP8:
        qk_scale = scale_log2 * tl.load(kv_scale_ptr)
    else:
        qk_scale = scale_log2
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    block_table = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    offs_t = tl.arange(0, TILE)
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    # Two passes over the range: first the tiles every query row of the block may see in full
    # (the whole cached prefix, for decode all but the last tile), with no masks at all; then
    # the rest (the causal diagonal, the ragged end), masked. Unmasked loads vectorise and the
    # bulk of the work skips the compare/select on the scores.
    n_full = (context_len + q_block_local * BLOCK_Q + 1) // TILE
    for phase in tl.static_range(2):
        if phase == 0:
            lo = tile_lo
            hi = tl.minimum(tile_hi, n_full)
        else:
            lo = tl.maximum(tile_lo, n_full)
            hi = tile_hi
        for tile in range(lo, hi):
            kv_pos = tile * TILE + offs_t
            kv_valid = kv_pos < kv_end
            # Physical block of every token of the tile (a tile may span several cache blocks).
            if phase == 0:
                phys = tl.load(block_table + kv_pos // BLOCK_SIZE).to(tl.int64)
            else:
                phys = tl.load(block_table + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
            in_block = kv_pos % BLOCK_SIZE
            k_ptrs = k_head + phys[None, :] * stride_kb + in_block[None, :] * stride_ks + offs_d[:, None]
            v_ptrs = v_head + phys[:, None] * stride_vb + in_block[:, None] * stride_vs + offs_d[None, :]
            if phase == 0 and HEAD_PAD == HEAD_DIM:
                k = tl.load(k_ptrs)  # [HEAD_PAD, TILE]
                v = tl.load(v_ptrs)  # [TILE, HEAD_PAD]
            elif phase == 0:
                k = tl.load(k_ptrs, mask=d_valid[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)
            else:
                k = tl.load(k_ptrs, mask=kv_valid[None, :] & d_valid[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=kv_valid[:, None] & d_valid[None, :], other=0.0)
            k = k.to(q.dtype)
            v = v.to(q.dtype)

            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE], log2 units
            if phase == 1:
                # Causality also excludes padding keys, since q_abs < kv_end for every valid row.
                s = tl.where(row_valid[:, None] & (kv_pos[None, :] <= q_abs[:, None]), s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row may see no key yet (a split segment beyond its position, a padding row):
            # keep its max finite so that exp2 gives 0 rather than NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * tl.load(kv_scale_ptr + 1)
    if SPLIT:
        part = part_out_ptr + q_tok[:, None] * stride_pt + head[:, None] * stride_ph + segment * stride_ps
        tl.store(part + offs_d[None, :], o, mask=q_mask)
        # Natural-log logsumexp of the segment's scores; -inf when it saw no key.
        lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(part_lse_ptr + q_tok * stride_lt + head * stride_lh + segment, lse, mask=row_valid)
    else:
        tl.store(
            out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


@dual_jit(pdl=True, do_not_specialize=["num_splits", "stride_pt", "stride_ph", "stride_lt", "stride_lh"])
def _merge_kernel(
    part_out_ptr,  # [T, H, S, D] fp32, normalised per segment
    part_lse_ptr,  # [T, H, S] fp32
    out_ptr,  # [T, H, D]
    num_splits,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # the grid before this one done and visible (see kernels.triton.pdl_enabled)
        gdc_wait()
        gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLIT_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_valid = offs_s < num_splits
    lse_row = part_lse_ptr + tok * stride_lt + head * stride_lh
    lse = tl.load(lse_row + offs_s, mask=s_valid, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp(lse - lse_max)  # 0 for empty segments
    denom = tl.sum(w, axis=0)
    # A segment that saw no key (lse -inf) holds no output: its row is never read (the decode
    # kernel does not write it; a split graph at a short context has mostly such segments).
    seen = s_valid & (lse > float("-inf"))
    o = tl.load(
        part_out_ptr + tok * stride_pt + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=seen[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + offs_d,
        res.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@dataclass(frozen=True)
class _Config:
    block_m: int
    tile: int
    num_warps: int
    num_stages: int


def _pick_config(max_query_len: int, group: int, head_pad: int, kv_fp8: bool = False) -> _Config:
    """Tile shapes by phase. Decode is bandwidth-bound: few rows, wide context tiles.

    Prefill is compute-bound: 64 query rows per program so the tensor cores see real matrix
    products. Swept on an H100 (bf16, D=128, GQA 4): for prefill, BLOCK_M 64 x TILE 64 with 4
    warps and 2 stages was best or within 2% of best of {64,128} x {32,64,128} x {4,8} warps x
    {2,3} stages (8 warps lost up to 2x); for decode every TILE in 16..128 with 2-4 warps sat at
    ~3 TB/s on large batches. An fp8 cache decodes with twice the tile (128 tokens): the same
    bytes per iteration as bf16's 64 (at 1 x 32k on an H200, fp8 with tile 64 took bf16's time
    for half the bytes: each iteration's latency, not its bytes, set the pace).
    """
    rows = max_query_len * group
    if max_query_len == 1 or rows <= 16:
        block_m, tile, warps, stages = 16, 64, 4, 2
    elif rows <= 32:
        block_m, tile, warps, stages = 32, 64, 4, 2
    else:
        block_m, tile, warps, stages = 64, 64, 4, 2
    if kv_fp8 and max_query_len == 1 and head_pad <= 128:
        tile = 128
    if head_pad > 128:  # keep the fp32 accumulator and the K/V tiles within registers/smem
        tile = 32
    # A program must hold at least one query token with all of its group's heads.
    block_m = max(block_m, triton.next_power_of_2(group))
    return _Config(block_m=block_m, tile=tile, num_warps=warps, num_stages=stages)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # the interpreter has no SMs; any plausible count keeps the heuristic testable
    return torch.cuda.get_device_properties(device).multi_processor_count


def _choose_num_splits(meta: AttentionMetadata, num_kv_heads: int, device: torch.device) -> int:
    """Segments per sequence for a pure-decode batch (1 = no split), from host-side lengths only."""
    if not meta.is_pure_decode or meta.num_seqs == 0:
        return 1
    programs = meta.num_seqs * num_kv_heads
    want = triton.cdiv(_SPLIT_TARGET_WAVES * _num_sms(device), programs)
    # Powers of two only (the merge kernel's block shape depends on the count: fewer
    # compilations): `want` rounded to the nearest one, `useful` and the cap rounded down.
    want = 1 << round(math.log2(want))
    useful = meta.max_seq_len // _SPLIT_MIN_TOKENS
    if useful < 2 or want < 2:
        return 1
    return min(want, 1 << (useful.bit_length() - 1), _SPLIT_MAX)


def _takes_decode_kernel(meta: AttentionMetadata, kv_cache: torch.Tensor, num_splits: int | None) -> bool:
    """Whether this batch goes to `kernels.triton.paged_decode` (pure decode, its shapes)."""
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    device = kv_cache.device
    return (
        meta.is_pure_decode
        and not _UNIFIED_DECODE
        and takes_decode_kernel(meta, kv_cache.shape[3], kv_fp8, device, num_splits)
    )


def decode_rotates_q(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, cos_sin_cache: torch.Tensor
) -> bool:
    """Whether `paged_attention` takes this batch with q not rotated yet (`q_rotary`): one the
    decode kernel serves and can rotate q for (`kernels.triton.paged_decode.rotates_q`)."""
    return meta.num_seqs > 0 and _takes_decode_kernel(meta, kv_cache, None) and rotates_q(q, cos_sin_cache)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    kv_scale: torch.Tensor | None = None,
    q_rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of each query token to its sequence's cached context, causal within the chunk.

    q: [T, H, D]; kv_cache: [2, num_blocks, block_size, Hkv, D] holding the new tokens' K/V
    already; returns `out` ([T, H, D], q's dtype; allocated when None). `num_splits` forces
    the split-K decode path with that many segments (pure-decode batches only); by default
    it is chosen from the batch shape. An fp8 cache is read with `kv_scale` (fp32 [4] on q's
    device, `kernels.reference.unit_kv_scale`'s layout; None = every scale 1.0). Reads only
    host-side metadata, never syncs. `q_rotary` = (positions, cos_sin_cache): q is not rotated
    yet, for a batch that `decode_rotates_q` accepts (the decode kernel rotates it).
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
    decode_only = meta.is_pure_decode
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if _takes_decode_kernel(meta, kv_cache, num_splits):
        return paged_decode(
            q, kv_cache, meta, scale, out, num_splits=num_splits, kv_scale=kv_scale, q_rotary=q_rotary
        )
    assert q_rotary is None, "only the decode kernel rotates q (decode_rotates_q)"
    if num_splits is None:
        num_splits = _choose_num_splits(meta, num_kv_heads, q.device)
    elif num_splits > 1:
        assert decode_only, "split-K is for pure-decode batches"
    split = num_splits > 1

    cfg = _pick_config(meta.max_query_len, group, head_pad, kv_fp8)
    block_q = cfg.block_m // group
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    interpreted = is_interpreted(q.device)
    if kv_fp8 and kv_scale is None:
        kv_scale = torch.ones(4, dtype=torch.float32, device=q.device)

    if decode_only:
        num_q_blocks = meta.num_seqs
    else:
        # Upper bound on query_start_loc[i] // BLOCK_Q + i + (blocks of sequence i): no sync.
        num_q_blocks = num_tokens // block_q + meta.num_seqs
    if split:
        part_out = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out, part_lse = out, out  # unused by the unified launch; any pointer does

    _paged_attn_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        q,
        key_cache,
        value_cache,
        out,
        part_out,
        part_lse,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        kv_scale if kv_fp8 else meta.seq_lens,  # any pointer when unused
        scale * _LOG2E,
        meta.num_seqs,
        num_splits,
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
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2) if split else 0,
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=block_q,
        TILE=cfg.tile,
        DECODE_ONLY=decode_only,
        SPLIT=split,
        DOT_UPCAST=interpreted and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        merge_attn_partials(part_out, part_lse, out=out)
    return out


def merge_attn_partials(
    partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Combine split-K segments (twin: `kernels.reference.merge_attn_partials`).

    partial_out: [T, H, S, D] fp32, each segment's softmax-normalised output (not read, so any
    bits, for a segment without keys);
    partial_lse: [T, H, S] fp32, each segment's logsumexp (-inf for a segment without keys).
    Returns out [T, H, D] (fp32 when not given).
    """
    num_tokens, num_heads, num_splits, head_dim = partial_out.shape
    assert partial_lse.shape == (num_tokens, num_heads, num_splits), (partial_lse.shape, partial_out.shape)
    assert partial_out.stride(-1) == 1 and partial_lse.stride(-1) == 1
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.float32, device=partial_out.device)
    assert out.stride(-1) == 1
    if num_tokens == 0:
        return out
    _merge_kernel[(num_tokens, num_heads)](
        partial_out,
        partial_lse,
        out,
        num_splits,
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        SPLIT_PAD=max(2, triton.next_power_of_2(num_splits)),
        num_warps=1 if head_dim * num_splits <= 1024 else 4,
    )
    return out
