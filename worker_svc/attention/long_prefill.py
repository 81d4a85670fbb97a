"""Attention of a batch holding long prefill chunks (issue 31): which rows go to which kernel.

The Triton backend sends a batch here when it holds a chunk of `PREFILL_MIN_QUERY` or more
query tokens and a context of `PREFILL_MIN_CONTEXT` or more (`use_prefill_kernel` in
kernels/triton/prefill_attention.py). Such a chunk is "long". Over a context of
`FLASH_MIN_CONTEXT` tokens or more, or with no cached prefix (a first chunk), on a CUDA device,
it is computed by torch SDPA's fused attention (cuDNN's on Hopper, FlashAttention-3 class) on
its context gathered from the paged cache into contiguous K/V. SDPA cannot read our block
table, and the gather is cheap next to the attention it feeds: a chunk of C tokens over a
context of S does 4 * H * D * C * S FLOPs for 2 * S * Hkv * D elements copied (at C = 8k,
D = 128, GQA 4, ~16,000 FLOPs per byte; measured: 1.0 % of a 120k prefill's GPU time on an
H100). Query j of a chunk over a cached prefix of P tokens sees keys 0..P + j (causal from the
bottom right), which SDPA runs fast only as two calls: see `_flash_chunk`.

The other long chunks (short contexts, no CUDA as in the tests, or `LONG_ROWS = "triton"`, the
benchmark's switch) go through the Triton prefill kernel; decodes and short chunks riding in
the same batch through the unified `paged_attention` kernel, as they would alone. Each run of
consecutive sequences going the same way is one launch on its slice of the batch.

Measured on an H200 (docs/benchmarks.md, issue 31; 784 TFLOP/s bf16 matmul peak): one 128k
prompt in 8k chunks, 582 TFLOP/s here (74 %), 396 in the Triton prefill kernel, 358 in the
unified kernel; the 120,000-token prefill of an 8B model 9.88 s against 13.23 s before. On an
H100 (781 TFLOP/s), with the bounded shapes and the one-pass merge: 120k 9.31 s (9.38 before
them), attention 581 TFLOP/s and 70 % of the prefill's GPU time; 32k 1.26 s (1.28).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels.triton as triton_kernels
from kernels.attention_metadata import AttentionMetadata
from kernels.reference import gather_kv, is_fp8_cache, unit_kv_scale
from kernels.triton import prefill_attention as prefill_mod

# "flash": long rows through FlashAttention (CUDA); "triton": through the Triton prefill kernel.
LONG_ROWS = "flash"
# torch caches cuDNN's execution plans per (queries, keys) shape and thread; a new shape costs
# ~40-60 ms of host time (H100), mostly hidden behind the GPU work the step thread queued
# before it. True: the shapes are bounded (squares padded, below) and the two calls are merged
# in one kernel; False: the path before (every chunk's own shapes, a torch merge), kept as the
# benchmark's baseline.
BUCKETED = True
# A chunk's causal square (its queries against its own keys) is padded to a multiple of this
# many rows (zero queries, zero keys past the context): padded rows see only padding and are
# dropped, real rows see the same keys, so a prompt's last (ragged) chunk reuses one of
# C / SQUARE_ALIGN square plans instead of building its own.
SQUARE_ALIGN = 1024
# A long chunk takes FlashAttention only over a context of at least this many tokens. cuDNN
# builds an execution plan per new (chunk, context) shape on each thread (tens of ms: a fresh
# 4k prompt took 143 ms through it against 102 ms through the Triton kernel on an H200, whose
# attention there is ~10 ms); over long contexts a chunk's attention is long enough to pay that.
FLASH_MIN_CONTEXT = 16384

_SHORT, _TRITON, _FLASH = "short", "triton", "flash"


def long_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention`'s function for a batch with long chunks: q [T, H, D] against the paged
    cache [2, num_blocks, block_size, Hkv, D] (new K/V already written); returns [T, H, D]."""
    out = torch.empty_like(q)
    kinds = _route(meta, LONG_ROWS == "flash" and _flash_available(q.device))
    starts = [0]
    for n in meta.query_lens_cpu:
        starts.append(starts[-1] + n)
    a = 0
    while a < meta.num_seqs:  # runs of consecutive sequences going the same way
        b = a + 1
        while b < meta.num_seqs and kinds[b] == kinds[a]:
            b += 1
        rows = slice(starts[a], starts[b])
        if kinds[a] == _FLASH:
            for i in range(a, b):
                seq_rows = slice(starts[i], starts[i + 1])
                if BUCKETED:
                    _flash_chunk(q[seq_rows], kv_cache, meta, i, scale, kv_scale, out[seq_rows])
                else:
                    out[seq_rows] = _flash_chunk_unbucketed(q[seq_rows], kv_cache, meta, i, scale, kv_scale)
        elif kinds[a] == _TRITON:
            sub = _sub_batch(meta, a, b, starts)
            prefill_mod.prefill_attention(q[rows], kv_cache, sub, scale, out=out[rows], kv_scale=kv_scale)
        else:
            sub = _sub_batch(meta, a, b, starts)
            triton_kernels.paged_attention(q[rows], kv_cache, sub, scale, out=out[rows], kv_scale=kv_scale)
        a = b
    return out


def _route(meta: AttentionMetadata, flash: bool) -> list[str]:
    """Per sequence: the unified kernel (short chunks, decodes), FlashAttention (long chunks over
    long contexts, and first chunks, when available) or the Triton prefill kernel (the other
    long chunks). A first chunk (no cached prefix) is one causal square of an aligned size
    (C / SQUARE_ALIGN shapes in all, each planned once per process): cuDNN's rate for a few
    plans (an 8k first chunk of the 8B model: ~29 ms of attention, ~44 in the Triton kernel,
    at 580 / 400 TFLOP/s). Chunks over a short cached prefix meet a new prefix shape per
    prefix length, hence FLASH_MIN_CONTEXT."""
    min_long = prefill_mod.PREFILL_MIN_QUERY
    kinds = []
    for q_len, seq_len in zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True):
        if q_len < min_long:
            kinds.append(_SHORT)
        elif flash and (seq_len >= FLASH_MIN_CONTEXT or (BUCKETED and q_len == seq_len)):
            kinds.append(_FLASH)
        else:
            kinds.append(_TRITON)
    return kinds


def _sub_batch(meta: AttentionMetadata, a: int, b: int, starts: list[int]) -> AttentionMetadata:
    """The metadata of sequences [a, b) alone (their tokens start at row starts[a])."""
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[starts[a] : starts[b]],
        query_start_loc=meta.query_start_loc[a : b + 1] - starts[a],
        seq_lens=meta.seq_lens[a:b],
        block_tables=meta.block_tables[a:b],
        max_query_len=max(meta.query_lens_cpu[a:b]),
        max_seq_len=max(meta.seq_lens_cpu[a:b]),
        query_lens_cpu=meta.query_lens_cpu[a:b],
        seq_lens_cpu=meta.seq_lens_cpu[a:b],
    )


def _flash_available(device: torch.device) -> bool:
    return device.type == "cuda"  # tests patch this to run the flash side on the CPU


def _flash_chunk(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    seq: int,
    scale: float,
    kv_scale: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """One sequence's chunk q [C, H, D] over its whole context (cached prefix of P tokens + the
    chunk), written into out [C, H, D]: the two calls of `_flash_chunk_unbucketed` in a bounded
    set of shapes, merged in one pass.

    * The causal square takes R = C rounded up to `SQUARE_ALIGN` rows (q copied into a zero-
      padded buffer when C is not aligned) against keys P..P + R, the context gathered into
      [P + R] keys, zero past P + C: real row j sees keys P..P + j, all real, and the padding
      only padded rows. The prefix call takes the C real rows against keys 0..P. A chunked
      prompt's full chunks meet (C, k * C) and (C, C), the same for every prompt; its last
      chunk an aligned square and its own prefix shape.
    * The two outputs are joined by their logsumexps in one kernel (`merge_two`) that writes
      the batch's rows: the torch merge took five passes over the chunk and a copy (H100, one
      120k prompt in 8k chunks: 0.23 s of the attention's 6.4 s, against 0.10 s).
    """
    q_len, seq_len = q.shape[0], meta.seq_lens_cpu[seq]
    prefix = seq_len - q_len
    rows = -(-q_len // SQUARE_ALIGN) * SQUARE_ALIGN
    k, v = _gather_padded(kv_cache, meta.block_tables[seq], seq_len, prefix + rows)
    if is_fp8_cache(kv_cache):
        s = (kv_scale if kv_scale is not None else unit_kv_scale(q.device)).to(q.dtype)
        k, v = k.to(q.dtype) * s[0], v.to(q.dtype) * s[1]
    qp = q
    if rows != q_len:  # a full chunk is used in place (a strided view of the QKV output)
        qp = torch.empty((rows, q.shape[1], q.shape[2]), dtype=q.dtype, device=q.device)
        qp[:q_len].copy_(q)
        qp[q_len:].zero_()
    # [1, heads, tokens, D] views: SDPA needs only the last dim contiguous.
    qh, kh, vh = qp.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    o_new, lse_new = _attend_with_lse(qh, kh[:, :, prefix:], vh[:, :, prefix:], True, scale)
    o_new = o_new[0].transpose(0, 1)[:q_len]  # [C, H, D]
    if prefix == 0:
        out.copy_(o_new)
        return
    o_pre, lse_pre = _attend_with_lse(qh[:, :, :q_len], kh[:, :, :prefix], vh[:, :, :prefix], False, scale)
    prefill_mod.merge_two(o_pre[0].transpose(0, 1), lse_pre[0], o_new, lse_new[0, :, :q_len], out)


def _gather_padded(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_kv` into buffers of `rows` >= seq_len tokens, [rows, Hkv, D] each, zero past
    seq_len (finite: a padded key's weight is exactly 0, but 0 * NaN would not be)."""
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    n = -(-seq_len // block_size)
    src = kv_cache.view(torch.uint8) if is_fp8_cache(kv_cache) else kv_cache
    buf = torch.empty((2, max(rows, n * block_size), hkv, d), dtype=src.dtype, device=src.device)
    ids = block_table[:n].long()
    for i in range(2):  # whole blocks at memcpy speed, as gather_blocks
        torch.index_select(src[i].view(num_blocks, -1), 0, ids, out=buf[i, : n * block_size].view(n, -1))
    buf[:, seq_len:rows].zero_()
    k, v = buf[0, :rows], buf[1, :rows]
    return (k.view(kv_cache.dtype), v.view(kv_cache.dtype)) if src is not kv_cache else (k, v)


def _flash_chunk_unbucketed(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    seq: int,
    scale: float,
    kv_scale: torch.Tensor | None,
) -> torch.Tensor:
    """One sequence's chunk q [C, H, D] over its whole context (cached prefix + the chunk), as
    it ran before plan reuse (`BUCKETED = False`; the benchmark's "before").

    A chunk over a cached prefix of P tokens is two causal-free pieces of work plus one square
    causal one: the chunk against the prefix (no mask) and against itself (causal, where top-left
    and bottom-right alignment agree), merged by their logsumexps. SDPA's fast path on Hopper
    (cuDNN) takes only those two shapes; its bottom-right causal mask (`causal_lower_right`) runs
    FlashAttention-2 instead, at about half the rate (H200: 330-370 against 560-630 TFLOP/s).
    """
    q_len, seq_len = q.shape[0], meta.seq_lens_cpu[seq]
    k, v = gather_kv(kv_cache, meta.block_tables[seq], seq_len)  # [S, Hkv, D] each
    if is_fp8_cache(kv_cache):
        s = (kv_scale if kv_scale is not None else unit_kv_scale(q.device)).to(q.dtype)
        k, v = k.to(q.dtype) * s[0], v.to(q.dtype) * s[1]
    # [1, heads, tokens, D] views: SDPA needs only the last dim contiguous.
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    prefix = seq_len - q_len
    if prefix == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    o_pre, lse_pre = _attend_with_lse(qh, kh[:, :, :prefix], vh[:, :, :prefix], False, scale)
    o_new, lse_new = _attend_with_lse(qh, kh[:, :, prefix:], vh[:, :, prefix:], True, scale)
    # softmax over both key sets = the two normalised parts weighted by their exp(lse) shares.
    w_pre = torch.sigmoid(lse_pre - lse_new)[..., None]  # [1, H, C, 1]
    o = torch.lerp(o_new.float(), o_pre.float(), w_pre)
    return o[0].transpose(0, 1).to(q.dtype)


def _attend_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [1, H, L, D] to k, v [1, Hkv, S, D] (causal: square, L == S) and the
    natural logsumexp of each row's scores, [1, H, L] fp32."""
    if q.device.type == "cuda":
        global _CUDNN_NEEDS_HEADS
        cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
        if not _CUDNN_NEEDS_HEADS:
            try:
                res = cudnn(q, k, v, None, True, 0.0, causal, False, scale=scale)
                return res[0], res[1].reshape(q.shape[:3]).float()
            except RuntimeError:  # this cuDNN takes no GQA: expand K/V from now on
                _CUDNN_NEEDS_HEADS = True
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        res = cudnn(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return res[0], res[1].reshape(q.shape[:3]).float()
    # The CPU (tests): the same function spelled out.
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).float()
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1).float()
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.softmax(scores, dim=-1) @ v).to(q.dtype), lse


# Set when cuDNN refused K/V with fewer heads than q (GQA): they are expanded from then on.
_CUDNN_NEEDS_HEADS = False
