"""Reference paged-attention backend in plain PyTorch (the CPU path)."""

from __future__ import annotations

import torch

from kernels import reference
from kernels.attention_metadata import AttentionMetadata
from worker_svc.attention.base import RotaryInputs


class TorchPagedBackend:
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        rotary: RotaryInputs | None = None,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if rotary is not None:  # the fused Triton kernel's twin: q and k rotated in place
            reference.rotary_and_write_kv(
                rotary[0], q, k, v, rotary[1], kv_cache, meta.slot_mapping, kv_scale
            )
        else:
            reference.write_kv_cache(k, v, kv_cache, meta.slot_mapping, kv_scale)
        return reference.paged_attention(q, kv_cache, meta, scale, kv_scale)
