"""Paged-attention backend on the Triton kernels (the GPU path).

A drop-in for `TorchPagedBackend`: same `forward`, same cache layout, same results within
floating-point tolerance. On CPU tensors the kernels run under Triton's interpreter, which is
how the tests compare the two backends without a GPU.
"""

from __future__ import annotations

import torch

import kernels.triton as triton_kernels
from kernels.attention_metadata import AttentionMetadata
from kernels.triton.paged_attention import decode_rotates_q
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
        prefill = use_prefill_kernel(meta)  # long chunks, long contexts: SDPA / Triton prefill (issue 31)
        q_rotary = None
        if rotary is not None:  # one kernel rotates q and k in place and writes the cache
            positions, cos_sin = rotary
            # A pure decode on the decode kernel rotates q there instead, so that the attention
            # walks all but each sequence's newest tile while the cache write still runs.
            if not prefill and decode_rotates_q(q, kv_cache, meta, cos_sin):
                q_rotary = rotary
            triton_kernels.rotary_and_write_kv(
                positions, q, k, v, cos_sin, kv_cache, meta.slot_mapping, kv_scale, rotate_q=q_rotary is None
            )
        else:
            triton_kernels.write_kv_cache(k, v, kv_cache, meta.slot_mapping, kv_scale)
        if prefill:
            return long_prefill_attention(q, kv_cache, meta, scale, kv_scale=kv_scale)
        return triton_kernels.paged_attention(q, kv_cache, meta, scale, kv_scale=kv_scale, q_rotary=q_rotary)
