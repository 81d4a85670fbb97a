"""Paged-attention backend on the Triton kernels (the GPU path).

A drop-in for `TorchPagedBackend`: same `forward`, same cache layout, same results within
floating-point tolerance. On CPU tensors the kernels run under Triton's interpreter, which is
how the tests compare the two backends without a GPU.
"""

from __future__ import annotations

import torch

import kernels.triton as triton_kernels
from kernels.attention_metadata import AttentionMetadata
from kernels.triton.prefill_attention import use_prefill_kernel
from worker_svc.attention.base import RotaryInputs
from worker_svc.attention.long_prefill import long_prefill_attention


class TritonPagedBackend:
    name = "triton"

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
        # Write first, then attend: the new tokens must see themselves (and a sequence may
        # read a prefix block another sequence of this step just wrote).
        if rotary is not None:  # one kernel rotates q and k in place and writes the cache
            positions, cos_sin = rotary
            triton_kernels.rotary_and_write_kv(
                positions, q, k, v, cos_sin, kv_cache, meta.slot_mapping, kv_scale
            )
        else:
            triton_kernels.write_kv_cache(k, v, kv_cache, meta.slot_mapping, kv_scale)
        if use_prefill_kernel(meta):  # long chunks, long contexts: SDPA / Triton prefill (issue 31)
            return long_prefill_attention(q, kv_cache, meta, scale, kv_scale=kv_scale)
        return triton_kernels.paged_attention(q, kv_cache, meta, scale, kv_scale=kv_scale)
