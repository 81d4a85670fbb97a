"""The attention-backend seam: the model calls `backend.forward(...)` once per layer.

A batch is a flat run of tokens from several sequences (varlen), mixing chunked
prefills and decodes. Each backend first writes the new K/V into the paged cache
at `slot_mapping`, then attends every query to its sequence's cached context
(causal within the chunk). Writing before attending, per layer, is what lets two
sequences of one step share a prefix block that only the first one computes.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.attention_metadata import AttentionMetadata

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
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k and v into the cache at `meta.slot_mapping`, then attend.

        With `rotary` (positions [T], the [max_pos, D] cos|sin table), q and k are first rotated
        (NeoX rotate-half): the backend may do it in the same kernel as the write, and may
        rotate q and k in place. An fp8 cache (float8_e4m3fn) is written and read with
        `kv_scale`, the layer's fp32 [4] (k_scale, v_scale, 1 / k_scale, 1 / v_scale) on q's
        device (`kernels.reference.unit_kv_scale`; None = every scale 1.0).
        """
        ...
