"""A mixed batch's leading decodes on the decode path (`worker_svc.attention.mixed`), against the
PyTorch twin, interpreted on the CPU: fp32, and an fp8 cache with non-unit scales."""

from __future__ import annotations

import torch

from kernels import reference
from tests.unit.kernels import make_paged_batch
from worker_svc.attention.mixed import decodes_apart, leading_decodes

# (new tokens, context length): three decodes, then a chunk over a prefix, a whole prompt, a decode.
SEQS = [(1, 40), (1, 7), (1, 130), (9, 60), (12, 12), (1, 33)]
SCALES = torch.tensor([0.5, 2.0, 2.0, 0.5])


def _batch(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return make_paged_batch(SEQS, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, dtype=dtype)


def test_leading_decodes_stop_at_the_first_chunk() -> None:
    assert leading_decodes(_batch(torch.float32).meta) == 3


def test_decodes_apart_match_the_twin() -> None:
    b = _batch(torch.float32)
    out = decodes_apart(b.q, b.kv_cache, b.meta, 0.3, leading_decodes(b.meta))
    expected = reference.paged_attention(b.q, b.kv_cache, b.meta, 0.3)
    assert float((out - expected).norm() / expected.norm()) < 1e-5


def test_decodes_apart_with_an_fp8_cache() -> None:
    b = _batch(torch.bfloat16)
    cache = (b.kv_cache.float() * 4).to(torch.float8_e4m3fn)
    out = decodes_apart(b.q, cache, b.meta, 0.2, 3, kv_scale=SCALES)
    expected = reference.paged_attention(b.q.float(), cache, b.meta, 0.2, SCALES)
    assert torch.isfinite(out).all()
    assert float((out.float() - expected).norm() / expected.norm()) < 2e-2
