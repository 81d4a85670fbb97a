"""Long prefill chunks on the GPU (issue 31): the Triton prefill kernel and the backend's split
(SDPA on gathered K/V over long contexts) against the twin in fp32, at the 8B model's heads.

The same checks ran on an H200 through `benchmarks/prefill_attention.py --sections check`
(relative errors 2.0e-3 to 2.8e-3 for every path, docs/benchmarks.md); tolerances as in
test_kernels_gpu.py (about one bf16 rounding of the output).
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton.prefill_attention import PrefillConfig, default_config, prefill_attention
from tests.unit.kernels import PagedBatch, make_paged_batch
from worker_svc.attention import long_prefill

pytestmark = pytest.mark.gpu

BF16_TOL = 2e-2
# A long chunk over a long cached prefix (SDPA), one over a short context (Triton prefill
# kernel), a whole prompt, and decodes and a short chunk riding along (unified kernel).
SEQS = [(1, 3000), (2048, 20480), (300, 2000), (1500, 4000), (1, 500), (1024, 1024)]


def _batch(seqs: list[tuple[int, int]]) -> PagedBatch:
    return make_paged_batch(
        seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda"
    )


def _check(b: PagedBatch, out: torch.Tensor) -> None:
    expected = reference.paged_attention(b.q.float(), b.kv_cache.float(), b.meta, 128**-0.5)
    assert out.dtype == b.q.dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, atol=BF16_TOL, rtol=BF16_TOL)


@pytest.mark.parametrize("config", [None, PrefillConfig(128, 64, 8, 3), PrefillConfig(64, 64, 4, 2)])
def test_prefill_kernel_mixed_step(config: PrefillConfig | None) -> None:
    b = _batch(SEQS)
    _check(b, prefill_attention(b.q, b.kv_cache, b.meta, 128**-0.5, config=config or default_config(128, 4)))


def test_backend_split_sdpa_triton_unified() -> None:
    b = _batch(SEQS)
    # (1024, 1024) has no prefix: one causal square (warmed at start-up), so SDPA too.
    assert long_prefill._route(b.meta, True) == ["short", "flash", "short", "triton", "short", "flash"]
    _check(b, long_prefill.long_prefill_attention(b.q, b.kv_cache, b.meta, 128**-0.5))


def test_backend_split_before_plan_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flash path as it ran before (unpadded shapes, torch merge): the benchmark's baseline."""
    monkeypatch.setattr(long_prefill, "BUCKETED", False)
    b = _batch(SEQS)
    assert long_prefill._route(b.meta, True) == ["short", "flash", "short", "triton", "short", "triton"]
    _check(b, long_prefill.long_prefill_attention(b.q, b.kv_cache, b.meta, 128**-0.5))


def test_merge_two_bf16() -> None:
    from kernels.triton.prefill_attention import merge_two

    t, h, d = 3000, 32, 128
    a = torch.randn(h, t, d, device="cuda").to(torch.bfloat16).transpose(0, 1)
    b = torch.randn(t, h, d, device="cuda").to(torch.bfloat16)
    lse_a, lse_b = 3 * torch.randn(h, t, device="cuda"), 3 * torch.randn(h, t, device="cuda")
    out = merge_two(a, lse_a, b, lse_b, torch.empty_like(b))
    expected = reference.merge_attn_partials(torch.stack([a, b], 2), torch.stack([lse_a.t(), lse_b.t()], 2))
    torch.testing.assert_close(out.float(), expected, atol=BF16_TOL, rtol=BF16_TOL)
