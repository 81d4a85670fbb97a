"""Paged attention for pure-decode batches (one query per sequence), split over the context.

Twin: `kernels.reference.paged_attention` (the decode rows). `kernels.triton.paged_attention`
sends the pure-decode batches that `takes_decode_kernel` accepts here (every one with an fp8
cache; bf16 ones at long contexts on nearly idle grids and batches past a few programs an SM,
where this was measured faster); mixed, prefill and the other decode batches stay on its
unified kernel. A batch's grid rows take its sequences longest context first
(`longest_first_order`).

Decode at a long context is a stream over the KV cache: each (sequence, KV head) reads its
whole context once and does a few FLOPs per byte. The kernel's only job is to keep enough
bytes in flight. One program owns one KV head of one sequence for a contiguous segment of
its context (grid: KV heads, sequences, segments; KV heads vary fastest, so the programs that
read the same cache pages start together) and all GROUP query heads of that KV head as the
rows of one tensor-core product, so each K/V tile is read once per group. Segments write a
normalised partial output and its logsumexp; `merge_attn_partials` combines them (or, with
`DecodeConfig.fused_merge`, the segment that finishes last: off, slower on an H100). Long
segments over an fp8 cache split each tile between the program's warps too (`with_warp_split`):
each warp keeps its own softmax state and writes its own partial.

What sets the pace, found on the compiled kernel (sm_90 TTGIR; see `pick_decode_config`):

* Pipelining depth. The K/V loads depend on a block-table load in the same loop, and Triton's
  pipeliner splits `num_stages - 2` stages between the two loads of such a chain: 2 to 5
  stages leave ONE K/V buffer, i.e. every tile's DRAM latency is exposed; 6 gives two tiles
  in flight, 8 three. At batch 1 there are only a few programs per SM to hide latency.
* One wave. Every program must be resident at once (about two an SM): a second wave pays the
  programs' dependent start (sequence length -> block table -> first tile) again, so 64 or
  128 segments a sequence ran slower than 32, and so did configs too large for two an SM.
* An fp8 cache is converted once per tile, to fp16 rather than bf16: e4m3 -> f16 is one
  `cvt.rn.f16x2.e4m3x2` per two codes, -> bf16 one more convert per element. The dots then
  run in fp16 (q cast to fp16, clamped to its range: exact for every bf16 q in fp16's normal
  range; p in [0, 1] gets 3 more mantissa bits than bf16) with fp32 accumulation. The scales
  never touch the tiles: k_scale folds into the softmax scale, v_scale into the output.
* Its start. The kernel before it rotates q and k and writes the step's K/V; with PDL the
  decode kernel had to wait for it (and the launch latency) before its first load. Given the
  raw q (`q_rotary`, `rotates_q`) it rotates q itself, so it needs that kernel only for each
  sequence's newest tile: it walks every older tile first and waits just before the newest
  (the 8B's batch-1 decode graph, fp8 cache: 40-50 us a step faster at 128 and at 32k tokens,
  docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.attention_metadata import AttentionMetadata
from kernels.triton import dual_jit, is_interpreted
from kernels.triton.pdl import gdc_launch_dependents, gdc_wait
from kernels.triton.rounding import mul_rn

_LOG2E = 1.4426950408889634

# Split heuristics: aim for this many programs per SM (one wave of resident programs: a
# second wave pays every program's start-up chain again; at 1 x 32k bf16 on an H200, 64 or 128
# splits took 1.1-2.5x the time of 32), never split below this many context tokens per
# segment, never more than this many segments.
_SPLIT_PROGRAMS_PER_SM = 2
_SPLIT_MIN_TOKENS = 256
# A cache in the model's dtype takes this kernel from this context length on, split at least
# this many ways (see `takes_decode_kernel`): measured at 1 x 32k (32 splits), not at 8k.
_LONG_CONTEXT = 16384
_MIN_SPLITS = 32
_SPLIT_MAX = 64
# Batches (`plan_decode`), by (sequence, KV head) programs an SM: past the first, a bf16 batch
# takes this kernel (`takes_decode_kernel`); past the second, smaller programs; past the third,
# smaller still (fp8).
_FEW_PROGRAMS_PER_SM = 4
_MID_PROGRAMS_PER_SM = 12
_MANY_PROGRAMS_PER_SM = 40
# Pure-decode batches whose attention rotates q itself (`rotates_q`); 0: the cache-write kernel
# rotates it, as before (benchmarks A/B the two).
_DECODE_ROTATES_Q = os.environ.get("LLMESH_DECODE_ROTATES_Q", "1") != "0"
# Split launches over an fp8 cache take warp-split programs (`with_warp_split`); 0: the plain
# ones, as before (benchmarks A/B the two).
_DECODE_WARP_SPLIT = os.environ.get("LLMESH_DECODE_WARP_SPLIT", "1") != "0"
_WARP_SPLIT_PROGRAM = (64, 4, 5)  # tile, warps, pipelining depth
_WARP_SPLIT_MIN_SEGMENT = 1024  # tokens of the longest context a segment
# The merge holds a head's partials in registers at once: 256 of them (64 segments x 4 warps)
# spilled, 139 us a layer at 1 x 32k against 44.6 for the plain programs' 64.
_MERGE_MAX_PARTS = 128
# A program's query rows (its group) padded to a power of two, at least this many. Triton pads
# a dot's M to the MMA's 16 itself; left at 4 (an 8B's group) the softmax works on the 4 real rows
# only, where padded to 16 three quarters of its max, exp2 and sums were on zeros: the 8B's
# batch-1 decode graph, fp8 cache, 5,944 -> 5,902 us at 32k tokens, 5,116 -> 5,097 at 128.
_DOT_MIN_ROWS = 4


# Four e4m3 codes (one int32 word, code i in byte i) -> four fp16: two packed conversions.
_E4M3_WORD_TO_F16_ASM = tl.constexpr(
    "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; "
    "cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }"
)


@dual_jit(
    pdl=True,
    do_not_specialize=["num_splits", "stride_pt", "stride_ph", "stride_ps", "stride_lt", "stride_lh"],
)
def _paged_decode_kernel(
    q_ptr,  # [B, H, D]: one query token per sequence
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [B, H, D] (unsplit launch)
    part_out_ptr,  # [B, H, NUM_SPLITS, D] fp32 (split launch)
    part_lse_ptr,  # [B, H, NUM_SPLITS] fp32 (split launch)
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32 (token of sequence i: query_start_loc[i])
    counter_ptr,  # [B * Hkv] int32, zero between launches (FUSED_MERGE): segments finished
    kv_scale_ptr,  # fp32 [4]: k_scale, v_scale, 1 / k_scale, 1 / v_scale (read when KV_FP8)
    order_ptr,  # [B] int32: the sequence of grid row i (LONGEST_FIRST)
    positions_ptr,  # [T] int64: each query token's position (ROTATE_Q)
    cos_sin_ptr,  # [max_pos, HEAD_DIM] fp32: cos then sin (ROTATE_Q)
    stride_cs,
    scale_log2,  # softmax scale * log2(e)
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
    ROWS: tl.constexpr,  # GROUP padded to a power of two >= _DOT_MIN_ROWS
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (>= 16)
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size (tokens)
    TILE: tl.constexpr,  # context tokens per iteration
    SPLIT: tl.constexpr,  # write partials per segment (grid axis 2) instead of the output
    KV_FP8: tl.constexpr,  # the cache holds e4m3 codes times the scales at kv_scale_ptr
    DOT_F16: tl.constexpr,  # run both dots in fp16 (the fp8 cache's cheap conversion)
    KV_WORDS: tl.constexpr,  # fp8 cache read as int32 words of four codes (k/v_cache_ptr: int32)
    CVT_ASM: tl.constexpr,  # KV_WORDS: convert with PTX (GPU), else with integer ops (interpreter)
    LONGEST_FIRST: tl.constexpr,  # grid rows take sequences in order_ptr's order
    DOT_UPCAST: tl.constexpr,  # feed tl.dot fp32 (interpreter: its bf16/fp16 dot is broken)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no silent tf32)
    FUSED_MERGE: tl.constexpr,  # the last segment of each (sequence, KV head) merges them all
    SPLIT_PAD: tl.constexpr,  # num_splits rounded up to a power of two (FUSED_MERGE)
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two (FUSED_MERGE)
    ROTATE_Q: tl.constexpr,  # q is not rotated yet: rotate it here and start before the grid before
    WARP_SPLIT: tl.constexpr,  # KV_WORDS: each warp walks its own slice of every tile, own partial
    WARPS: tl.constexpr,  # num_warps (WARP_SPLIT)
    PDL: tl.constexpr,
):
    if PDL:
        # The grid before this one done and visible (see kernels.triton.pdl_enabled). With
        # ROTATE_Q that grid is the one writing this step's K/V (and rotating k), and only a
        # sequence's newest tile needs it: the wait moves to that tile (phase 1, below).
        if not ROTATE_Q:
            gdc_wait()
        gdc_launch_dependents()
    kv_head = tl.program_id(0)
    if LONGEST_FIRST:  # the block scheduler starts low rows first: long contexts lead, no tail
        seq = tl.load(order_ptr + tl.program_id(1))
    else:
        seq = tl.program_id(1)
    segment = tl.program_id(2)
    num_kv_heads = tl.num_programs(0)

    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE)
    if SPLIT:
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        tile_lo = segment * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        tile_lo = 0
        tile_hi = num_tiles

    offs_g = tl.arange(0, ROWS)
    offs_d = tl.arange(0, HEAD_PAD)
    row_valid = offs_g < GROUP
    d_valid = offs_d < HEAD_DIM
    head = kv_head * GROUP + offs_g
    tok = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_mask = row_valid[:, None] & d_valid[None, :]
    q_rows = q_ptr + tok * stride_qt + head[:, None] * stride_qh
    if ROTATE_Q:
        # q is the grid before the grid before's (the qkv GEMM's, or the q norm's), finished
        # once this grid may start: read from L2 (.cg), never from a stale L1 line. Rotated as
        # `_rotary_kv_write_kernel` rotates it, each product rounded on its own (CVT_ASM: on the
        # GPU, where the compiler would otherwise contract them; left to it, the two kernels
        # contracted differently, 1 ulp apart), then rounded to q's dtype.
        half = HEAD_DIM // 2
        pos = tl.load(positions_ptr + tok, cache_modifier=".cg").to(tl.int64)
        x = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        partner = (offs_d + half) % HEAD_DIM  # d's pair in the rotation: d + half, or d - half
        xp = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d % half).to(tl.float32)[None, :]
        sin = tl.load(cos_sin_ptr + pos * stride_cs + half + offs_d % half).to(tl.float32)[None, :]
        first = (offs_d < half)[None, :]
        if CVT_ASM:
            x_cos, xp_sin = mul_rn(x, cos), mul_rn(xp, sin)
        else:
            x_cos, xp_sin = x * cos, xp * sin
        q = tl.where(first, x_cos - xp_sin, x_cos + xp_sin).to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)
    if DOT_F16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    if DOT_UPCAST:
        q = q.to(tl.float32)
    # WARP_SPLIT: a tile is [WARPS, TILE // WARPS] tokens, warp w owning row w, and the softmax
    # state has a leading WARPS axis. The dots are batched over it, and a batched dot's
    # warps split its batch axis (Triton's MMA layout for rank 3): each warp's max, sums and
    # p stay in its own registers, where a plain dot splits the tile's tokens across the warps
    # and every row's max, sum and p crosses them through shared memory (4x the barriers of an
    # iteration). Each warp writes its own partial; the merge combines them.
    if WARP_SPLIT:
        q = tl.broadcast_to(q[None, :, :], (WARPS, ROWS, HEAD_PAD))

    if KV_FP8:
        qk_scale = scale_log2 * tl.load(kv_scale_ptr)
    else:
        qk_scale = scale_log2
    if WARP_SPLIT:
        m_i = tl.full([WARPS, ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([WARPS, ROWS], dtype=tl.float32)
        acc = tl.zeros([WARPS, ROWS, HEAD_PAD], dtype=tl.float32)
        offs_t = tl.arange(0, WARPS)[:, None] * (TILE // WARPS) + tl.arange(0, TILE // WARPS)[None, :]
    else:
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_PAD], dtype=tl.float32)
        offs_t = tl.arange(0, TILE)

    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    # The query sits at position seq_len - 1 and sees every key: only the last tile, which
    # holds that position (the key and value this step wrote), needs a mask. Phase 0 walks the
    # tiles before it with no mask at all (with ROTATE_Q before the grid before has finished:
    # no kernel of this step writes them), phase 1 the last one.
    n_before = tl.maximum(seq_len - 1, 0) // TILE
    for phase in tl.static_range(2):
        if phase == 0:
            lo = tile_lo
            hi = tl.minimum(tile_hi, n_before)
        else:
            lo = tl.maximum(tile_lo, n_before)
            hi = tile_hi
            if PDL and ROTATE_Q:  # every program, so that this grid ends after the one before
                gdc_wait()
        for tile in range(lo, hi):
            kv_pos = tile * TILE + offs_t
            kv_valid = kv_pos < seq_len
            if phase == 0:
                phys = tl.load(block_table + kv_pos // BLOCK_SIZE).to(tl.int64)
            else:
                phys = tl.load(block_table + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
            in_block = kv_pos % BLOCK_SIZE
            if KV_WORDS:
                # Both tiles token-major, [TILE, HEAD_DIM // 4] words ([W, SUB, ...] split by
                # warp), converted in the load's own (blocked) layout; tl.dot then reads fp16
                # through shared memory.
                offs_w = tl.arange(0, HEAD_PAD // 4)
                kw_ptrs = k_head + tl.expand_dims(phys * stride_kb + in_block * stride_ks, -1) + offs_w
                vw_ptrs = v_head + tl.expand_dims(phys * stride_vb + in_block * stride_vs, -1) + offs_w
                if phase == 0:
                    kw = tl.load(kw_ptrs)
                    vw = tl.load(vw_ptrs)
                else:
                    kw = tl.load(kw_ptrs, mask=tl.expand_dims(kv_valid, -1), other=0)
                    vw = tl.load(vw_ptrs, mask=tl.expand_dims(kv_valid, -1), other=0)
                # Each word -> four fp16 (c0..c3): PTX on the GPU; integer ops in the
                # interpreter (e4m3 is fp16 with the exponent rebiased by 8, subnormals too:
                # shift the 7 magnitude bits into place, keep the sign, times 2^8).
                for which in tl.static_range(2):
                    words = kw if which == 0 else vw
                    if CVT_ASM:
                        c0, c1, c2, c3 = tl.inline_asm_elementwise(
                            asm=_E4M3_WORD_TO_F16_ASM,
                            constraints="=h,=h,=h,=h,r",
                            args=[words],
                            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                            is_pure=True,
                            pack=1,
                        )
                    else:
                        b0, b1, b2, b3 = words, words >> 8, words >> 16, words >> 24
                        c0 = ((b0 << 8) & 0x8000) | ((b0 & 0x7F) << 7)
                        c1 = ((b1 << 8) & 0x8000) | ((b1 & 0x7F) << 7)
                        c2 = ((b2 << 8) & 0x8000) | ((b2 & 0x7F) << 7)
                        c3 = ((b3 << 8) & 0x8000) | ((b3 & 0x7F) << 7)
                        c0 = c0.to(tl.uint16).to(tl.float16, bitcast=True) * 256.0
                        c1 = c1.to(tl.uint16).to(tl.float16, bitcast=True) * 256.0
                        c2 = c2.to(tl.uint16).to(tl.float16, bitcast=True) * 256.0
                        c3 = c3.to(tl.uint16).to(tl.float16, bitcast=True) * 256.0
                    # join appends a minor axis: [token, word, j, k] holds code 2j + k.
                    codes = tl.join(tl.join(c0, c2), tl.join(c1, c3))
                    if WARP_SPLIT:
                        codes = tl.reshape(codes, (WARPS, TILE // WARPS, HEAD_PAD))
                        if which == 0:
                            k = tl.permute(codes, (0, 2, 1))  # [WARPS, HEAD_PAD, TILE // WARPS]
                        else:
                            v = codes
                    else:
                        codes = tl.reshape(codes, (TILE, HEAD_PAD))
                        if which == 0:
                            k = tl.trans(codes)  # [HEAD_PAD, TILE]
                        else:
                            v = codes
            else:
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

            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [(W,) ROWS, TILE], log2 units
            if phase == 1:
                s = tl.where(tl.expand_dims(kv_valid, -2), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=-1))
            # Padding rows see only zeros (finite); a row with no key keeps m = -inf, made safe.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - tl.expand_dims(m_safe, -1))
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=-1)
            acc = tl.dot(p.to(v.dtype), v, acc * tl.expand_dims(alpha, -1), input_precision=DOT_PRECISION)
            m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / tl.expand_dims(l_safe, -1)
    if KV_FP8:
        o = o * tl.load(kv_scale_ptr + 1)
    # Natural-log logsumexp of the segment's scores; -inf when it saw no key.
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    # A partial that saw no key writes only its lse (-inf): the merge never reads its output.
    # A split graph at a short context is mostly such partials (1 x 128 tokens, 32 segments).
    if WARP_SPLIT:  # always split: warp w of segment i writes partial i * WARPS + w
        parts = segment * WARPS + tl.arange(0, WARPS)
        part = part_out_ptr + tok * stride_pt + head[None, :, None] * stride_ph
        part += parts[:, None, None] * stride_ps + offs_d[None, None, :]
        tl.store(part, o, mask=q_mask[None, :, :] & has_keys[:, :, None])
        lse_ptrs = part_lse_ptr + tok * stride_lt + head[None, :] * stride_lh + parts[:, None]
        tl.store(lse_ptrs, lse, mask=row_valid[None, :])
    elif SPLIT:
        part = part_out_ptr + tok * stride_pt + head[:, None] * stride_ph + segment * stride_ps
        tl.store(part + offs_d[None, :], o, mask=q_mask & has_keys[:, None])
        tl.store(part_lse_ptr + tok * stride_lt + head * stride_lh + segment, lse, mask=row_valid)
        if FUSED_MERGE:
            # Split-K's serial reduction (CUTLASS's semaphore): every thread's partials are
            # stored before the barrier, the counter's release publishes them GPU-wide, and the
            # segment that finishes last (acquire) merges the group's segments itself: no
            # second launch. It then zeroes the counter for the next launch (graph replay).
            tl.debug_barrier()
            counter = counter_ptr + seq * num_kv_heads + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == num_splits - 1:
                # Every head of the group at once: a loop over the heads (four dependent load
                # chains in the one program every other segment waits for) cost ~19 us a layer.
                offs_s = tl.arange(0, SPLIT_PAD)
                offs_gm = tl.arange(0, GROUP_PAD)
                group_heads = kv_head * GROUP + offs_gm
                g_ok = offs_gm < GROUP
                s_ok = offs_s < num_splits
                lse_s = tl.load(
                    part_lse_ptr + tok * stride_lt + group_heads[:, None] * stride_lh + offs_s[None, :],
                    mask=g_ok[:, None] & s_ok[None, :],
                    other=float("-inf"),
                    cache_modifier=".cg",
                )
                o_s = tl.load(
                    part_out_ptr
                    + tok * stride_pt
                    + group_heads[:, None, None] * stride_ph
                    + offs_s[None, :, None] * stride_ps
                    + offs_d[None, None, :],
                    mask=(lse_s > float("-inf"))[:, :, None] & d_valid[None, None, :],
                    other=0.0,
                    cache_modifier=".cg",
                )
                lse_max = tl.max(lse_s, axis=1)
                lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
                w = tl.exp(lse_s - lse_max[:, None])
                denom = tl.sum(w, axis=1)
                res = tl.sum(w[:, :, None] * o_s, axis=1) / tl.where(denom > 0.0, denom, 1.0)[:, None]
                tl.store(
                    out_ptr + tok * stride_ot + group_heads[:, None] * stride_oh + offs_d[None, :],
                    res.to(out_ptr.dtype.element_ty),
                    mask=g_ok[:, None] & d_valid[None, :],
                )
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(
            out_ptr + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


@dataclass(frozen=True)
class DecodeConfig:
    tile: int
    num_warps: int
    num_stages: int
    dot_f16: bool  # fp8 cache only: convert to fp16 and run the dots in fp16
    fused_merge: bool = False  # the last segment merges (no merge launch); see the kernel
    kv_words: bool = False  # fp8 cache only: load int32 words of four codes, convert in place
    # Grid rows take the sequences longest context first (`longest_first_order`): a launch lasts
    # as long as its last program, and the block scheduler starts low rows first, so the long
    # contexts start first instead of finishing last. On for every batch (`plan_decode`).
    longest_first: bool = False
    # kv_words only: each warp walks its own slice of every tile and writes its own partial
    # (the kernel's WARP_SPLIT), so a launch always merges, split or not.
    warp_split: bool = False


def pick_decode_config(head_pad: int, kv_fp8: bool) -> DecodeConfig:
    """Tile, warps, pipelining depth and code reading of the decode kernel for few programs
    (batch 1 to a few dozen sequences, split to about two programs an SM).

    Swept on H100s (docs/benchmarks.md, "Decode attention at long contexts" and "The fp8 codes
    as words"): every program must be resident at once (a second wave costs each program's whole
    start-up chain again), and then the more bytes each has in flight the better. bf16:
    128-token tiles, one buffer (depth 4: 64 KiB of K/V per iteration, ~2 programs an SM at 223
    registers) 43.6 us at 1 x 32k against 45.7 for 64-token tiles two deep. fp8: 128-token
    tiles two deep, fp16 dots, the codes read as int32 words: 35.1-35.8 us at 1 x 32k against
    36.8-37.7 read as bytes, 102.1 against 106.6 at 1 x 120k. The fused merge is off: correct on
    the GPU (tests/gpu/test_kernels_gpu.py) but no faster on an H100. In the 8B's batch-1 decode
    graph (32 splits, fp8 cache) a step took 5,140 us against 5,117 with the merge kernel at 128
    tokens, 5,950 against 5,933 at 32k: the atomic and the last segment's merge cost what the
    launch boundary does. (Merging a group's heads one after another, it cost ~19 us a layer.)
    """
    if head_pad > 128:  # keep the fp32 accumulator and the K/V tiles within registers/smem
        return DecodeConfig(tile=32, num_warps=4, num_stages=2, dot_f16=kv_fp8)
    if kv_fp8:
        return DecodeConfig(tile=128, num_warps=4, num_stages=6, dot_f16=True, kv_words=True)
    return DecodeConfig(tile=128, num_warps=4, num_stages=4, dot_f16=False)


def plan_decode(
    meta: AttentionMetadata,
    num_kv_heads: int,
    head_pad: int,
    kv_fp8: bool,
    device: torch.device,
    num_splits: int | None = None,
) -> tuple[DecodeConfig, int]:
    """Config and segments per sequence of a launch, from host-side lengths only (in a CUDA
    graph, its size: the real rows' count is not known at capture). `num_splits` forces the
    segments (tests, benchmarks): the programs are then the ones for that split.

    Batch 1: `pick_decode_config` with `choose_decode_splits`. A batch's contexts are uneven, and
    a launch lasts as long as its longest program, so a batch launches its longest contexts
    first (`longest_first`), with programs sized by (sequence, KV head) programs an SM:
    * up to `_MID_PROGRAMS_PER_SM`: the batch-1 config and its splits (none from ~3 an SM on);
    * beyond: 64-token tiles two buffers deep, four warps for an fp8 cache, two for bf16,
      unsplit; past `_MANY_PROGRAMS_PER_SM`, an fp8 cache takes one-warp 32-token programs.

    Kernel alone on an H100, one layer, fp8 cache, contexts lognormal around the mean at the
    spread of the engine's steps of that size (ShareGPT: the large batches come first, their
    contexts mostly prompt; by 64 sequences each has generated hundreds of tokens), the plan
    before -> this (`decode_attention.py --uneven S`; docs/benchmarks.md, "Longest contexts
    first"): sigma 0.35, 64 x 850 70.7 -> 58.4 us; 0.45, 128 x 600 106.4 -> 84.5; 0.6, 192 x 450
    153.1 -> 101.3; 0.8, 512 x 500 329.7 -> 231.8, 1,000 x 400 439.0 -> 334.4. bf16 cache, the
    unified kernel -> this: 0.8, 64 x 1,000 159.1 -> 119.2; 512 x 500 432.4 -> 362.2.

    Splitting a batch's contexts did not pay in the engine: with the longest first, the batch-1
    config split at least two ways won the widest spread (0.8: 32 x 900 93.2 -> 54.6 us) and lost
    at the engine's (0.35: 64 x 850 58.4 unsplit against 69.2; ShareGPT's 17-64 sequence steps
    5.28 -> 5.51 ms).
    """
    programs_per_sm = meta.num_seqs * num_kv_heads / _num_sms(device)
    base = pick_decode_config(head_pad, kv_fp8)
    if meta.num_seqs == 1:
        n = num_splits or choose_decode_splits(meta, num_kv_heads, device)
        return with_warp_split(base, n, meta.max_seq_len), n
    if head_pad > 128 or programs_per_sm <= _MID_PROGRAMS_PER_SM:
        n = num_splits or choose_decode_splits(meta, num_kv_heads, device)
        return with_warp_split(replace(base, longest_first=True), n, meta.max_seq_len), n
    if kv_fp8 and programs_per_sm > _MANY_PROGRAMS_PER_SM:
        return DecodeConfig(32, 1, 2, dot_f16=True, kv_words=True, longest_first=True), num_splits or 1
    warps = 4 if kv_fp8 else 2
    return DecodeConfig(64, warps, 2, dot_f16=kv_fp8, kv_words=kv_fp8, longest_first=True), num_splits or 1


def with_warp_split(config: DecodeConfig, num_splits: int, max_seq_len: int) -> DecodeConfig:
    """`config` as warp-split programs (`DecodeConfig.warp_split`: 64-token tiles, a 16-token
    slice for each of 4 warps, depth 5) where it is split over an fp8 cache read as words into
    segments of at least `_WARP_SPLIT_MIN_SEGMENT` tokens of the longest context.

    Each warp keeps its own softmax state, so an iteration needs a quarter of the barriers (3
    against 12 in the sm_90 PTX), and each warp writes its own partial. On an H100 (one layer
    alone; then the 8B's decode graphs, PDL, q rotated in the kernel), against the plain
    128-token programs:
    * alone: 1 x 32k 34.2 against 35.8 us, 1 x 120k 98.8 against 116.8, 4 x 32k 105.1 against
      127.2, 16 x 8k 105.3 against 127.8;
    * graph steps: 1 x 120k 7,870 against 8,000 us, 4 x 32k 8,023 against 8,190, 16 x 8k 8,215
      against 8,312; level at 1 x 32k (5,884 against 5,881); 12 us slower at 1 x 128 tokens
      (5,100 against 5,088), where most partials are empty and the newest tokens' program
      walks a 64-token tile.
    So short segments (a graph captured for short contexts) keep the plain programs, and so does
    an unsplit launch (warp-split ones would add the merge's launch).
    """
    if num_splits <= 1 or not config.kv_words or not _DECODE_WARP_SPLIT:
        return config
    tile, warps, stages = _WARP_SPLIT_PROGRAM
    if num_splits * warps > _MERGE_MAX_PARTS or max_seq_len < num_splits * _WARP_SPLIT_MIN_SEGMENT:
        return config
    return replace(config, tile=tile, num_warps=warps, num_stages=stages, warp_split=True)


def takes_decode_kernel(
    meta: AttentionMetadata, num_kv_heads: int, kv_fp8: bool, device: torch.device, num_splits: int | None
) -> bool:
    """Whether a pure-decode batch goes to this kernel rather than the unified one.

    An fp8 cache always (faster at every shape measured: 1 x 8k-120k, 4 x 32k, 16 x 8k,
    64 x 2k). A cache in the model's dtype where this kernel was measured faster:
    * a batch of more than `_FEW_PROGRAMS_PER_SM` programs an SM, launched longest context
      first (`plan_decode`): with uneven contexts the unified kernel's last programs walk the
      longest contexts alone (lognormal, sigma 0.8: 64 x 1,000 119.2 against 159.1 us;
      1,000 x 400 562.6 against 605.7);
    * long contexts split at least `_MIN_SPLITS` ways into at most `_SPLIT_PROGRAMS_PER_SM`
      programs an SM (batch 1 at 32k: 43.6 against 49.8 us).
    """
    if kv_fp8:
        return True
    programs = meta.num_seqs * num_kv_heads
    if num_splits is None and programs > _FEW_PROGRAMS_PER_SM * _num_sms(device):
        return True
    if meta.max_seq_len < _LONG_CONTEXT:
        return False
    n = num_splits or choose_decode_splits(meta, num_kv_heads, device)
    return n >= _MIN_SPLITS and programs * n <= _SPLIT_PROGRAMS_PER_SM * _num_sms(device)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # the interpreter has no SMs; any plausible count keeps the heuristic testable
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_decode_splits(meta: AttentionMetadata, num_kv_heads: int, device: torch.device) -> int:
    """Segments per sequence (1 = no split) for `pick_decode_config`'s programs.

    About `_SPLIT_PROGRAMS_PER_SM` (sequence, KV head, segment) programs per SM: the power of
    two nearest that ratio, not its ceiling's (32 sequences x 8 KV heads on 132 SMs ran unsplit
    at 33.7 us, in two segments, two waves, at 43.5: fp8, 1k tokens each); each segment at least
    `_SPLIT_MIN_TOKENS` of the longest context (segments split a context's tiles evenly: 33
    segments of 256 tiles leave one empty); at most `_SPLIT_MAX`.
    """
    programs = meta.num_seqs * num_kv_heads
    if programs == 0:
        return 1
    want = 1 << max(0, round(math.log2(_SPLIT_PROGRAMS_PER_SM * _num_sms(device) / programs)))
    useful = meta.max_seq_len // _SPLIT_MIN_TOKENS
    if useful < 2 or want < 2:
        return 1
    return min(want, 1 << (useful.bit_length() - 1), _SPLIT_MAX)


def rotates_q(q: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
    """Whether `paged_decode` can rotate this q itself (`q_rotary`): a rotary over the whole head
    dim, a power of two, the table's rows contiguous, and not switched off (LLMESH_DECODE_ROTATES_Q=0,
    for benchmarks)."""
    head_dim = q.shape[-1]
    return (
        _DECODE_ROTATES_Q
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
        and cos_sin_cache.shape[-1] == head_dim
        and cos_sin_cache.stride(-1) == 1
    )


def longest_first_order(meta: AttentionMetadata) -> torch.Tensor:
    """[B] int32: the batch's sequences by context length, longest first, sorted on the device
    once a step (the first layer to ask; every layer shares `meta`), so a CUDA graph replays the
    sort with the step's lengths."""
    if meta.decode_order is None:
        meta.decode_order = torch.argsort(meta.seq_lens, descending=True, stable=True).to(torch.int32)
    return meta.decode_order


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_COUNTERS_MIN = 1 << 14


def _counters(device: torch.device, n: int) -> torch.Tensor | None:
    """A zeroed int32 scratch of >= n counters for FUSED_MERGE, one per device, kept for good:
    every launch leaves it zeroed again. None when it would have to be allocated during a CUDA
    graph capture (the caller then merges in a second launch)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(max(n, _COUNTERS_MIN), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    *,
    num_splits: int | None = None,
    kv_scale: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    q_rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode attention into `out` ([B, H, D]) for a pure-decode batch (one query a sequence).

    Arguments as `kernels.triton.paged_attention.paged_attention` (checked there); `config`
    and `num_splits` override `plan_decode`'s choice (benchmarks, tests). Reads host-side metadata only.

    `q_rotary` = (positions [T], cos_sin_cache [max_pos, D]): q is not rotated yet (the cache
    write rotated only k: `rotary_and_write_kv(..., rotate_q=False)`, the kernel just before
    this one); the kernel rotates it as that kernel would have, bit for bit, and under PDL walks
    every tile but each sequence's last while that kernel still runs (`rotates_q`).
    """
    from kernels.triton.paged_attention import merge_attn_partials

    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_dim))
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    planned, num_splits = plan_decode(meta, num_kv_heads, head_pad, kv_fp8, q.device, num_splits)
    cfg = config or planned
    dot_f16 = cfg.dot_f16 and kv_fp8 and q.dtype != torch.float32  # fp32 q: fp32 dots, exact
    split = num_splits > 1
    if kv_fp8 and kv_scale is None:
        kv_scale = torch.ones(4, dtype=torch.float32, device=q.device)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    # Words need whole, aligned rows of codes: a head dim that is its own power of two.
    kv_words = cfg.kv_words and kv_fp8 and head_dim == head_pad and key_cache.stride(-1) == 1
    if kv_words:
        key_cache, value_cache = key_cache.view(torch.int32), value_cache.view(torch.int32)
    # A warp's slice is the p.V dot's K: at least 16 (tl.dot's smallest K for 16-bit inputs).
    warp_split = cfg.warp_split and kv_words and cfg.tile // cfg.num_warps >= 16
    num_parts = num_splits * cfg.num_warps if warp_split else num_splits
    if num_parts > 1:
        shape = (num_tokens, num_heads, num_parts)
        part_out = torch.empty((*shape, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    else:
        part_out, part_lse = out, out  # unused by the unsplit launch; any pointer does
    interpreted = is_interpreted(q.device)
    fused = split and cfg.fused_merge and not warp_split
    counters = _counters(q.device, meta.num_seqs * num_kv_heads) if fused else None
    order = longest_first_order(meta) if cfg.longest_first else None
    if q_rotary is not None:
        assert rotates_q(q, q_rotary[1]), (q.shape, q_rotary[1].shape)
        positions, cos_sin = q_rotary
        assert positions.shape == (num_tokens,), (positions.shape, q.shape)
    else:
        positions = cos_sin = meta.seq_lens  # any pointer when unused
    _paged_decode_kernel[(num_kv_heads, meta.num_seqs, num_splits)](
        q,
        key_cache,
        value_cache,
        out,
        part_out,
        part_lse,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        counters if counters is not None else meta.seq_lens,  # any pointer when unused
        kv_scale if kv_fp8 else meta.seq_lens,  # any pointer when unused
        order if order is not None else meta.seq_lens,  # any pointer when unused
        positions,
        cos_sin,
        cos_sin.stride(0),
        scale * _LOG2E,
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
        part_out.stride(2) if num_parts > 1 else 0,
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        ROWS=max(_DOT_MIN_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        TILE=cfg.tile,
        SPLIT=split,
        KV_FP8=kv_fp8,
        DOT_F16=dot_f16,
        KV_WORDS=kv_words,
        CVT_ASM=not interpreted,
        LONGEST_FIRST=order is not None,
        DOT_UPCAST=interpreted and (q.dtype == torch.bfloat16 or dot_f16),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 and not dot_f16 else "tf32",
        FUSED_MERGE=counters is not None,
        SPLIT_PAD=max(2, triton.next_power_of_2(num_splits)) if counters is not None else 2,
        GROUP_PAD=triton.next_power_of_2(group),
        ROTATE_Q=q_rotary is not None,
        WARP_SPLIT=warp_split,
        WARPS=cfg.num_warps,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if num_parts > 1 and counters is None:
        merge_attn_partials(part_out, part_lse, out=out)
    return out
