"""The prefill attention kernel against its twin under Triton's interpreter, tiny shapes.

Small tiles (forced through `config`) make the tiny chunks take every path of the real sizes:
several query blocks per sequence, unmasked prefix tiles, diagonal tiles, tiles spanning
several cache blocks, the ragged end of a chunk, GQA packing, padded head dims, an fp8 cache,
and the reversed (longest rows first) order of programs over a mixed batch.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels import reference
from kernels.triton.prefill_attention import PrefillConfig, prefill_attention, use_prefill_kernel
from tests.unit.kernels import make_paged_batch

pf_mod = importlib.import_module("kernels.triton.prefill_attention")

# Chunks on cached prefixes, a whole prompt, a decode row riding along, a prompt under a block.
SEQS = [(37, 100), (1, 17), (24, 24), (9, 9), (1, 30), (20, 71)]
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}


def _check(b, out: torch.Tensor, scale: float, dtype: torch.dtype, kv_scale=None) -> None:  # type: ignore[no-untyped-def]
    expected = reference.prefill_attention(b.q, b.kv_cache, b.meta, scale, kv_scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.parametrize(("group", "block_m", "block_n"), [(4, 32, 16)])
def test_prefill_attention_matches_twin(group: int, block_m: int, block_n: int) -> None:
    b = make_paged_batch(
        SEQS, num_heads=2 * group, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32
    )
    cfg = PrefillConfig(block_m, block_n, 4, 2)
    _check(b, prefill_attention(b.q, b.kv_cache, b.meta, 0.3, config=cfg), 0.3, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_prefill_attention_half_and_padded_head(dtype: torch.dtype) -> None:
    """No GQA, head_dim 24 (padded to 32), block size 8 (a tile spans several blocks), every row written."""
    b = make_paged_batch(SEQS, num_heads=2, num_kv_heads=2, head_dim=24, block_size=8, dtype=dtype)
    out = torch.full_like(b.q, float("nan"))
    result = prefill_attention(b.q, b.kv_cache, b.meta, 0.2, out=out, config=PrefillConfig(32, 16, 4, 2))
    assert result is out and out.dtype == dtype
    _check(b, out, 0.2, dtype)


def test_prefill_attention_nan_in_unused_slots() -> None:
    """Slots past a sequence's end (the tail of its last block, spare blocks) may hold NaN bits
    in a real cache: the diagonal tiles must not read them into any row."""
    b = make_paged_batch(SEQS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    cache = torch.full_like(b.kv_cache, float("nan"))
    for i, seq_len in enumerate(b.meta.seq_lens_cpu):
        for pos in range(seq_len):
            blk = int(b.meta.block_tables[i, pos // 16])
            cache[:, blk, pos % 16] = b.kv_cache[:, blk, pos % 16]
    out = prefill_attention(b.q, cache, b.meta, 0.3, config=PrefillConfig(32, 32, 4, 2))
    assert not out.isnan().any()
    _check(b, out, 0.3, torch.float32)  # the twin reads the clean cache (its decode path pads)


def test_prefill_attention_fp8_cache() -> None:
    scales = torch.tensor([0.5, 0.125, 2.0, 8.0])
    b = make_paged_batch(SEQS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    b.kv_cache = torch.stack(
        [reference.quantize_kv(b.kv_cache[0], scales[2]), reference.quantize_kv(b.kv_cache[1], scales[3])]
    )
    out = prefill_attention(
        b.q, b.kv_cache, b.meta, 0.25, kv_scale=scales, config=PrefillConfig(16, 32, 4, 2)
    )
    _check(b, out, 0.25, torch.float32, scales)


def test_dispatch_by_longest_chunk_and_context(monkeypatch: pytest.MonkeyPatch) -> None:
    def meta(seqs: list[tuple[int, int]]):  # type: ignore[no-untyped-def]
        return make_paged_batch(
            seqs, num_heads=2, num_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32
        ).meta

    n, ctx = pf_mod.PREFILL_MIN_QUERY, pf_mod.PREFILL_MIN_CONTEXT
    long = meta([(1, 40), (n, ctx)])
    assert use_prefill_kernel(long)
    assert not use_prefill_kernel(meta([(3, 40)])) and not use_prefill_kernel(meta([(n, n), (1, ctx - 1)]))
    monkeypatch.setattr(pf_mod, "PREFILL_MIN_QUERY", 1 << 30)  # the benchmark's switch to the old path
    assert not use_prefill_kernel(long)


@pytest.mark.parametrize(("flash", "bucketed"), [(True, True), (True, False), (False, True)])
def test_backend_split_of_a_batch_with_long_chunks(
    monkeypatch: pytest.MonkeyPatch, flash: bool, bucketed: bool
) -> None:
    """Chunks of PREFILL_MIN_QUERY or more tokens over FLASH_MIN_CONTEXT or more through SDPA
    (prefix and chunk apart, merged by logsumexp, on K/V gathered from the cache), the other long
    ones (all, without flash) through the Triton prefill kernel, runs of short rows through the
    unified kernel, each on its slice of the batch. An fp8 cache is upcast on the SDPA side.
    Bucketed (the default): the chunk's square padded to SQUARE_ALIGN rows (37 -> 48, 20 -> 32),
    the merge in one kernel; unbucketed: the path before."""
    from worker_svc.attention import long_prefill

    monkeypatch.setattr(long_prefill, "_flash_available", lambda device: flash)
    monkeypatch.setattr(long_prefill, "BUCKETED", bucketed)
    monkeypatch.setattr(long_prefill, "SQUARE_ALIGN", 16)
    monkeypatch.setattr(long_prefill, "FLASH_MIN_CONTEXT", 50)  # (37, 100), (20, 71); not (24, 24)
    monkeypatch.setattr(pf_mod, "PREFILL_MIN_QUERY", 20)
    monkeypatch.setattr(pf_mod, "default_config", lambda *_: PrefillConfig(32, 16, 4, 2))
    b = make_paged_batch(SEQS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    # (24, 24) has no prefix: one causal square, warmed at start-up, so flash once bucketed.
    first = "flash" if bucketed else "triton"
    kinds = ["flash", "short", first, "short", "short", "flash"] if flash else None
    assert long_prefill._route(b.meta, flash) == (
        kinds or ["triton", "short", "triton", "short", "short", "triton"]
    )
    _check(b, long_prefill.long_prefill_attention(b.q, b.kv_cache, b.meta, 0.3), 0.3, torch.float32)
    if flash:
        scales = torch.tensor([0.5, 0.125, 2.0, 8.0])
        b.kv_cache = torch.stack(
            [reference.quantize_kv(b.kv_cache[0], scales[2]), reference.quantize_kv(b.kv_cache[1], scales[3])]
        )
        out = long_prefill.long_prefill_attention(b.q, b.kv_cache, b.meta, 0.3, kv_scale=scales)
        _check(b, out, 0.3, torch.float32, scales)


def test_flash_path_ignores_nan_in_unused_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The padded square reads whole blocks past a sequence's end: their stale (NaN) slots are
    zeroed before cuDNN (here its CPU form) sees them, so no real row turns NaN. 37 rows are
    padded to 64, 32 rows (aligned) used in place."""
    from worker_svc.attention import long_prefill

    monkeypatch.setattr(long_prefill, "_flash_available", lambda device: True)
    monkeypatch.setattr(long_prefill, "SQUARE_ALIGN", 32)
    monkeypatch.setattr(long_prefill, "FLASH_MIN_CONTEXT", 50)
    monkeypatch.setattr(pf_mod, "PREFILL_MIN_QUERY", 20)
    b = make_paged_batch(
        [(37, 100), (32, 71)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32
    )
    cache = torch.full_like(b.kv_cache, float("nan"))
    for i, seq_len in enumerate(b.meta.seq_lens_cpu):
        for pos in range(seq_len):
            blk = int(b.meta.block_tables[i, pos // 16])
            cache[:, blk, pos % 16] = b.kv_cache[:, blk, pos % 16]
    out = long_prefill.long_prefill_attention(b.q, cache, b.meta, 0.3)
    assert not out.isnan().any()
    _check(b, out, 0.3, torch.float32)


def test_merge_two_matches_twin() -> None:
    """Two attentions over disjoint key sets joined by their logsumexps, from the layouts the
    flash path hands over (cuDNN's [H, T, D]-major output, strided logsumexps), into a strided
    slice of the batch's output: `reference.merge_attn_partials` of the two stacked."""
    t, h, d = 37, 4, 24  # d padded to 32 inside
    a = torch.randn(h, t, d).transpose(0, 1)
    b = torch.randn(t, h, d)
    lse_a, lse_b = 3 * torch.randn(t, h).t(), 3 * torch.randn(h, t + 5)[:, :t]
    out = torch.full((t + 4, h, d), float("nan"))[2 : t + 2]
    pf_mod.merge_two(a, lse_a, b, lse_b, out)
    expected = reference.merge_attn_partials(torch.stack([a, b], 2), torch.stack([lse_a.t(), lse_b.t()], 2))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
