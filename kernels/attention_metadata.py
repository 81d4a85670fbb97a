"""`AttentionMetadata`: where each token of a flat (varlen) batch lives in the paged KV cache.

Owned by kernels/ (the attention kernels and their reference twins read it), so that kernels
import nothing of the project above them; worker_svc's backends and runner build it.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    # [B] int32, the sequences longest context first: built on first use by a decode kernel
    # that launches long contexts first (kernels.triton.paged_decode), shared by every layer.
    decode_order: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
