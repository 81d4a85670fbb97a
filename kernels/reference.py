"""Plain-PyTorch twins of the Triton kernels: the CPU path and the tests' ground truth.

KV cache layout, per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = K, 1 = V). A token's slot is block_id * block_size + offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata

FP8_KV_DTYPE = torch.float8_e4m3fn  # an "fp8" KV cache (vLLM's kv_cache_dtype="fp8")


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == FP8_KV_DTYPE


def unit_kv_scale(device: torch.device | str = "cpu") -> torch.Tensor:
    """The KV scales vector of an uncalibrated fp8 cache (vLLM's default: every scale 1.0).

    KV scales, everywhere below: fp32 [4] = (k_scale, v_scale, 1 / k_scale, 1 / v_scale). A
    cached value is q = e4m3(x * (1 / scale)) and stands for q * scale. The reciprocals travel
    with the scales so that every path quantizes by the same multiply (no division to round).
    """
    return torch.ones(4, dtype=torch.float32, device=device)


def quantize_kv(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """x * inv_scale rounded to e4m3 (to nearest even), saturated at +-448 instead of NaN."""
    return (x.float() * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Scatter new K/V [T, Hkv, D] into the paged cache at `slot_mapping` [T].

    An fp8 cache stores them quantized with `kv_scale` (see `unit_kv_scale`; None = 1.0).
    """
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
    if is_fp8_cache(kv_cache):
        s = kv_scale if kv_scale is not None else unit_kv_scale(k.device)
        # As bytes: torch has no index_copy_ for float8 on the CPU.
        k, v = quantize_kv(k, s[2]).view(torch.uint8), quantize_kv(v, s[3]).view(torch.uint8)
        flat = flat.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the listed blocks, [len(block_ids) * block_size, Hkv, D] each.

    index_select on a [num_blocks, block_bytes] view copies whole blocks at memcpy speed,
    several times faster on the CPU than advanced indexing of the 5-D cache.
    """
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    ids = block_ids.long()
    fp8 = is_fp8_cache(kv_cache)
    src = kv_cache.view(torch.uint8) if fp8 else kv_cache  # float8 has few indexing kernels
    k = src[0].view(num_blocks, -1).index_select(0, ids).view(-1, hkv, d)
    v = src[1].view(num_blocks, -1).index_select(0, ids).view(-1, hkv, d)
    return (k.view(FP8_KV_DTYPE), v.view(FP8_KV_DTYPE)) if fp8 else (k, v)


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of one sequence's first `seq_len` tokens, [seq_len, Hkv, D] each."""
    block_size = kv_cache.shape[2]
    n_blocks = (seq_len + block_size - 1) // block_size
    k, v = gather_blocks(kv_cache, block_table[:n_blocks])
    return k[:seq_len], v[:seq_len]


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each query token to its sequence's cached context, causal within the chunk.

    q: [T, H, D]; returns [T, H, D]. The new tokens' K/V must already be in the cache.
    Decodes (one query each) go through one batched call; prefill chunks one call each.
    An fp8 cache is read upcast to q's dtype and times its scales (`kv_scale`, None = 1.0).
    """
    if is_fp8_cache(kv_cache):
        s = kv_scale if kv_scale is not None else unit_kv_scale(q.device)
        dequant: tuple[torch.Tensor, torch.Tensor] | None = (s[0].to(q.dtype), s[1].to(q.dtype))
    else:
        dequant = None
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist() if meta.query_start_loc.device.type != "cpu" else None
    decodes: list[int] = []
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        if starts is not None:
            start = starts[i]
        if q_len == 1:
            decodes.append(i)
        else:
            k, v = gather_kv(kv_cache, meta.block_tables[i], seq_len)
            out[start : start + q_len] = _attend_chunk(q[start : start + q_len], k, v, scale, dequant)
        start += q_len
    # Decodes in groups: a group's gathered K/V stays in the CPU caches while attention reads it,
    # instead of a round trip to DRAM for the whole batch (2.7x faster at 64 x 400 tokens;
    # groups of 8 measured best end to end on 2 cores).
    for g in range(0, len(decodes), _DECODE_GROUP):
        group = decodes[g : g + _DECODE_GROUP]
        rows = torch.tensor(group, device=q.device)
        token_index = meta.query_start_loc[rows].long()
        out[token_index] = _attend_decodes(q[token_index], kv_cache, meta, rows, group, scale, dequant)
    return out


_DECODE_GROUP = 8


# (k_scale, v_scale) in q's dtype for an fp8 cache, None for a cache in the model's dtype.
Dequant = tuple[torch.Tensor, torch.Tensor] | None


def _upcast(
    k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, dequant: Dequant
) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = k.to(dtype), v.to(dtype)
    if dequant is not None:
        k, v = k * dequant[0], v * dequant[1]
    return k, v


def _attend_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dequant: Dequant = None
) -> torch.Tensor:
    """One sequence's chunk: q [q_len, H, D] against k/v [seq_len, Hkv, D]."""
    q_len, seq_len = q.shape[0], k.shape[0]
    k, v = _upcast(k, v, q.dtype, dequant)
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if q_len == seq_len:  # nothing cached before the chunk: plain causal attention
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query j sits at absolute position seq_len - q_len + j and sees keys 0..that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def _attend_decodes(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    rows: torch.Tensor,
    rows_cpu: list[int],
    scale: float,
    dequant: Dequant = None,
) -> torch.Tensor:
    """All single-query sequences at once: gather their blocks padded to the longest, mask the rest."""
    block_size = kv_cache.shape[2]
    lens = [meta.seq_lens_cpu[i] for i in rows_cpu]
    max_len = max(lens)
    n_blocks = (max_len + block_size - 1) // block_size
    tables = meta.block_tables[rows, :n_blocks]  # [B, n]
    k, v = gather_blocks(kv_cache, tables.flatten())
    hkv, d = k.shape[1], k.shape[2]
    k, v = _upcast(k, v, q.dtype, dequant)
    k = k.view(len(rows_cpu), -1, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
    v = v.view(len(rows_cpu), -1, hkv, d).transpose(1, 2)
    valid = torch.arange(n_blocks * block_size, device=q.device)[None, :] < meta.seq_lens[rows][:, None]
    o = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
    )
    return o[:, :, 0, :]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm fused with the residual add: returns (normed, new_residual).

    new_residual = x + residual rounded once to residual's dtype (x may be wider: an fp32
    all-reduced sum), or x when residual is None; the norm itself runs in fp32, as in Hugging
    Face's LlamaRMSNorm.
    """
    if residual is not None:
        x = (x + residual).to(residual.dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T accumulated in fp32 and rounded once to `out_dtype` (x's dtype by default);
    `scale` ([N]): output column n times scale[n] (FP8 weights' per-channel scales); `x_scale`
    ([M] or [M, 1], x of shape [M, K]): output row m times x_scale[m] (FP8 rows of x)."""
    out = F.linear(x.float(), weight.float())
    if scale is not None:
        out = out * scale.float()
    if x_scale is not None:
        out = out * x_scale.float().reshape(-1, 1)
    return out.to(out_dtype or x.dtype)


FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # an all-zero row still gets a finite, nonzero scale


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32): each row's own scale,
    amax(|row|) / 448, so that x ≈ q * scale (per-token dynamic quantization)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    # Times the fp32 reciprocal, not / 448: torch divides by a scalar that way on CUDA but not on
    # the CPU, and the kernel must have one definition to match on both.
    scale = (x2.abs().amax(dim=-1, keepdim=True) * (1.0 / FP8_MAX)).clamp(min=FP8_MIN_SCALE)
    q = (x2 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate | up) -> [..., I] = SiLU(gate) * up, as Hugging Face's Llama MLP computes it."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style (rotate-half) rotary embedding, as Hugging Face's Llama applies it.

    positions: [T]; q: [T, H, D]; k: [T, Hkv, D]; cos_sin_cache: [max_pos, D] holding
    cos in the first D/2 columns and sin in the last D/2 (fp32).
    """
    cs = cos_sin_cache[positions]
    half = cs.shape[-1] // 2
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(q), rot(k)


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
    """Rotate q (unless not `rotate_q`) and k in place, then write k and v into the paged cache
    (slots < 0 skipped)."""
    q_rot, k_rot = rotary_embedding(positions, q, k, cos_sin_cache)
    if rotate_q:
        q.copy_(q_rot)
    k.copy_(k_rot)
    keep = slot_mapping >= 0
    write_kv_cache(k[keep], v[keep], kv_cache, slot_mapping[keep], kv_scale)


def merge_attn_partials(partial_out: torch.Tensor, partial_lse: torch.Tensor) -> torch.Tensor:
    """Combine split-K (flash-decoding) segments of attention into one output.

    partial_out: [T, H, S, D], each segment's softmax-normalised output over its keys (any
    bits, never read, for a segment that saw no key);
    partial_lse: [T, H, S], each segment's logsumexp of scores (-inf when it saw no key).
    Returns [T, H, D] fp32: sum_s exp(lse_s - logsumexp_s(lse_s)) * out_s.
    """
    lse = partial_lse.float()
    total = torch.logsumexp(lse, dim=-1, keepdim=True)
    # A row whose segments all lack keys would give -inf - -inf = NaN: weight it 0 instead.
    w = torch.exp(lse - total).nan_to_num(0.0)
    out = torch.where((lse > float("-inf")).unsqueeze(-1), partial_out.float(), 0.0)
    return (w.unsqueeze(-1) * out).sum(dim=-2)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: the first column of each row of `x` [rows, cols] holding the row's maximum."""
    return x.argmax(dim=-1)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured outputs: logits of disallowed tokens -> -inf, in place (returns `logits`).

    `bitmask` is int32 [rows, ceil(vocab / 32)] on the logits' device: bit t % 32 of word t // 32
    set = token t allowed (xgrammar's and llguidance's layout). Columns past the mask's 32 * width
    are left alone.
    """
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    tokens = torch.arange(vocab, device=logits.device)
    words = bitmask.index_select(1, tokens >> 5)  # [rows, vocab]: each token's word
    # Arithmetic shift: bit 31 (the sign) still reads as 1 after `& 1`.
    allowed = ((words >> (tokens & 31).to(torch.int32)) & 1) != 0
    logits[:, :vocab].masked_fill_(~allowed, float("-inf"))
    return logits


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Twin of `kernels.triton.prefill_attention`: the same function as `paged_attention`
    (that kernel differs only in its tiles and schedule, for long prefill chunks)."""
    return paged_attention(q, kv_cache, meta, scale, kv_scale)


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rms_norm` with its normed output quantized per token: (q, scale, new_residual), the
    codes and scale of `quantize_fp8_rows(normed)` (twin of the fused Triton pass)."""
    normed, new_residual = rms_norm(x, weight, eps, residual)
    q, scale = quantize_fp8_rows(normed)
    return q, scale, new_residual


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_and_mul` quantized per token: (q [M, I], scale [M, 1]) of its rows (twin of the
    fused Triton pass)."""
    return quantize_fp8_rows(silu_and_mul(x))


def fill_decode_inputs(
    i64: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    src_i64: torch.Tensor,
    src_i32: torch.Tensor,
    b: int,
    w: int,
    patch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Twin of `kernels.triton.pinned_io.fill_decode_inputs`: copies, then the patch."""
    rows = src_i64.shape[1]
    i64[:, :rows].copy_(src_i64)
    seq_lens[:b].copy_(src_i32[:b])
    block_tables[:b, :w].copy_(src_i32[b:].view(b, w))
    if patch is not None:
        moves, sampled = patch
        i64[0].index_copy_(0, moves[0].to(i64.device), sampled[moves[1].to(sampled.device)].to(torch.int64))


def copy_to_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Twin of `kernels.triton.pinned_io.copy_to_host`: dst[:] = src as int32."""
    dst.copy_(src.to(torch.int32))


def top_p_mask_(x: torch.Tensor, top_p: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """Twin of `kernels.triton.top_p.top_p_mask_`: each row keeps the tokens whose logit has less
    than top_p of the row's probability mass strictly above it (ties stay or go together); the
    others become -inf in place. Rows with top_p >= 1 are left alone. One sort of the row."""
    vocab = x.shape[1] if vocab is None else vocab
    rows = (top_p < 1.0).nonzero()[:, 0]
    if rows.numel() == 0 or vocab == 0:
        return x
    logits = x[rows, :vocab]
    probs = logits.double().softmax(dim=-1)  # float64: a long tail's running sum stays exact enough
    vals, order = logits.sort(dim=-1, descending=True)
    incl = probs.gather(1, order).cumsum(dim=-1)
    # The mass strictly above a value: the inclusive sum just before its first occurrence.
    first = torch.searchsorted(-vals, -vals, side="left")  # -vals ascending
    above = torch.where(first > 0, incl.gather(1, (first - 1).clamp_min(0)), 0.0)
    keep = above < top_p[rows, None].double()
    x[rows, :vocab] = torch.full_like(logits, float("-inf")).scatter(
        1, order, torch.where(keep, vals, float("-inf"))
    )
    return x


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Twin of `kernels.triton.exponential_race.exponential_race` given its noise: int64 [R],
    argmax of probs / noise a row (distributed as probs for Exp(1) noise)."""
    return argmax_rows(probs / noise)
