"""A mixed batch's decodes on the decode path (issue 31).

The unified kernel serves a mixed batch (prefill chunks and decodes) in one launch, with the
tile shapes its prefill rows need: 64-row programs, of which a decode fills `GROUP` (4 for the
8B), and for an fp8 cache the codes converted after they reach the dot-operand layout. In
ShareGPT's mixed steps (~1,000 decodes beside 16k prompt tokens) its attention took 750 us a
layer with an fp8 cache, most of it on the decodes. The planner lists running sequences
before the ones it admits, so a mixed batch's decodes are one leading run: they go to
`paged_attention` as a pure-decode batch of their own (the decode kernel for an fp8 cache, the
unified kernel's decode shapes otherwise), the other rows as before: two launches, not one.
"""

from __future__ import annotations

import torch

import kernels.triton as triton_kernels
from kernels.attention_metadata import AttentionMetadata
from worker_svc.attention.long_prefill import sub_batch

# Fewer leading decodes than this stay in the one launch (a launch costs more than they gain).
MIN_DECODES = 16


def leading_decodes(meta: AttentionMetadata) -> int:
    """How many sequences at the head of the batch have one query token each."""
    for i, n in enumerate(meta.query_lens_cpu):
        if n != 1:
            return i
    return meta.num_seqs


def decodes_apart(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_decodes: int,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` of a batch whose first `num_decodes` sequences decode: those as a
    pure-decode batch, the rest in a second launch. Returns [T, H, D]."""
    out = torch.empty_like(q)
    # A decode is one row: the first num_decodes rows are the decodes', the rest the others'.
    parts = ((0, num_decodes, 0, num_decodes), (num_decodes, meta.num_seqs, num_decodes, q.shape[0]))
    for a, b, row_a, row_b in parts:
        sub = sub_batch(meta, a, b, row_a, row_b)
        rows = slice(row_a, row_b)
        triton_kernels.paged_attention(q[rows], kv_cache, sub, scale, out=out[rows], kv_scale=kv_scale)
    return out
