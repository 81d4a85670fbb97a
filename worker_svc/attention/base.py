"""The attention-backend seam: the model calls `backend.forward(...)` once per layer.

A batch is a flat run of tokens from several sequences (varlen), mixing chunked
prefills and decodes. Each backend first writes the new K/V into the paged cache
at `slot_mapping`, then attends every query to its sequence's cached context
(causal within the chunk). Writing before attending, per layer, is what lets two
sequences of one step share a prefix block that only the first one computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Where each token of a flat batch lives in the paged KV cache.

    Shapes: T = total new tokens, B = sequences in the batch.
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies, so that the reference path never syncs with the device.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # CUDA events, one per layer, of a KV load running beside the forward (worker_svc.kv_tiers):
    # layer i must not touch its cache before event i fires. None: nothing loading.
    layer_ready: list | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


# (positions [T], cos|sin table [max_pos, head_dim] fp32): the rotary a backend applies to q and k.
RotaryInputs = tuple[torch.Tensor, torch.Tensor]


class AttentionBackend(Protocol):
    """One implementation per device path: `torch` (reference, CPU) and `triton` (GPU)."""

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        rotary: RotaryInputs | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k and v into the cache at `meta.slot_mapping`, then attend.

        With `rotary` (positions [T], the [max_pos, D] cos|sin table), q and k are first rotated
        (NeoX rotate-half): the backend may do it in the same kernel as the write, and may
        rotate q and k in place.
        """
        ...
