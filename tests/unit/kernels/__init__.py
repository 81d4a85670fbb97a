"""Kernel tests: each Triton kernel against its PyTorch twin (CPU: Triton's interpreter).

`make_paged_batch` is shared with tests/gpu, which runs the same checks at real sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]: the new tokens' keys (already written into kv_cache)
    v: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata


def make_paged_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    spare_blocks: int = 3,
) -> PagedBatch:
    """A flat varlen batch: `seqs` lists (new tokens, context length after the step) per sequence.

    Blocks are scattered over the cache in random order (so a wrong block-table lookup
    cannot pass by accident), and the cache is filled with random K/V everywhere, the new
    tokens' slots included — as after the backend's write step. Seed torch for reproducibility.
    """
    need = [(seq_len + block_size - 1) // block_size for _, seq_len in seqs]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks)
    block_tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    first = 0
    for i, n in enumerate(need):
        block_tables[i, :n] = perm[first : first + n].to(torch.int32)
        first += n
    query_lens = [q_len for q_len, _ in seqs]
    seq_lens = [seq_len for _, seq_len in seqs]
    assert all(0 < q <= s for q, s in seqs), seqs
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    slots = [
        int(block_tables[i, pos // block_size]) * block_size + pos % block_size
        for i, (q_len, seq_len) in enumerate(seqs)
        for pos in range(seq_len - q_len, seq_len)
    ]
    num_tokens = sum(query_lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(dtype)

    kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    k = flat[0][slot_mapping.to(device)].clone()
    v = flat[1][slot_mapping.to(device)].clone()
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return PagedBatch(q=randn(num_tokens, num_heads, head_dim), k=k, v=v, kv_cache=kv_cache, meta=meta)


def rope_cache(max_pos: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """cos/sin cache in the layout `reference.rotary_embedding` documents: [max_pos, D], fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
