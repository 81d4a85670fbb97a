"""The fp8 KV cache's kernels against their twins (CPU: Triton's interpreter), tiny shapes.

The KV write and the fused rotary + write quantize exactly as the twin does (byte for byte
where their inputs agree); paged attention reads an fp8 cache with its scales as the twin
does, on the unified, mixed and split-K paths.
"""

from __future__ import annotations

import pytest
import torch

import kernels.triton as kt
from kernels import reference
from tests.unit.kernels import make_paged_batch, rope_cache

FP8 = torch.float8_e4m3fn
# Scales of the kind the worker calibrates (powers of two), K and V apart: (k, v, 1/k, 1/v).
SCALES = torch.tensor([0.5, 0.125, 2.0, 8.0])
MIXED = [(5, 40), (1, 17), (20, 20), (1, 70), (3, 3), (37, 50), (1, 1)]


def _as_fp8(cache: torch.Tensor, scales: torch.Tensor = SCALES) -> torch.Tensor:
    return torch.stack(
        [reference.quantize_kv(cache[0], scales[2]), reference.quantize_kv(cache[1], scales[3])]
    )


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def test_quantize_kv_rounds_to_nearest_even_and_saturates() -> None:
    x = torch.tensor([1000.0, -1000.0, 0.0, 17.0, 18.0, 1e-4, 3.0])
    q = reference.quantize_kv(x, torch.tensor(1.0)).float()
    # 17 lies halfway between 16 and 18 (e4m3 steps of 2 there): to even, 16.
    assert q.tolist()[:5] == [448.0, -448.0, 0.0, 16.0, 18.0]
    assert not torch.isnan(q).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_fp8_matches_twin(dtype: torch.dtype) -> None:
    num_blocks, block_size, hkv, d, t = 6, 16, 3, 24, 11
    qkv = torch.randn(t, (4 + 2 * hkv) * d, dtype=dtype) * 4
    qkv[0, 4 * d : 4 * d + 5] = torch.tensor([1000.0, -1000.0, 1e-4, 0.0, 0.0173])  # saturation, subnormals
    k = qkv[:, 4 * d : (4 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (4 + hkv) * d :].view(t, hkv, d)
    slots = torch.randperm(num_blocks * block_size)[:t]
    cache = torch.zeros(2, num_blocks, block_size, hkv, d, dtype=FP8)
    expected = cache.clone()
    kt.write_kv_cache(k, v, cache, slots, SCALES)
    reference.write_kv_cache(k, v, expected, slots, SCALES)
    assert torch.equal(_bytes(cache), _bytes(expected))
    assert not torch.isnan(cache.float()).any()


def test_write_kv_cache_fp8_without_scales_uses_one() -> None:
    k = torch.randn(5, 2, 16)
    v = torch.randn(5, 2, 16)
    slots = torch.arange(5)
    cache = torch.zeros(2, 2, 4, 2, 16, dtype=FP8)
    expected = cache.clone()
    kt.write_kv_cache(k, v, cache, slots)
    reference.write_kv_cache(k, v, expected, slots, torch.ones(4))
    assert torch.equal(_bytes(cache), _bytes(expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("h", "hkv", "head_dim"), [(6, 2, 16), (3, 3, 24)])
def test_fused_rotary_and_kv_write_fp8_matches_twin(
    dtype: torch.dtype, h: int, hkv: int, head_dim: int
) -> None:
    t, max_pos, num_blocks, block_size = 9, 100, 6, 4
    cos_sin = rope_cache(max_pos, head_dim)
    positions = torch.randint(0, max_pos, (t,))
    slots = torch.randperm(num_blocks * block_size)[:t]
    slots[[2, 7]] = -1  # padding rows: rotated, not written
    qkv = torch.randn(t, (h + 2 * hkv) * head_dim, dtype=dtype) * 3

    def run(fn) -> tuple[torch.Tensor, torch.Tensor]:
        x = qkv.clone()
        q, k, v = x.split([h * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
        cache = torch.zeros(2, num_blocks, block_size, hkv, head_dim, dtype=FP8)
        fn(positions, q.view(t, h, head_dim), k.view(t, hkv, head_dim), v.view(t, hkv, head_dim), cos_sin,
           cache, slots, SCALES)  # fmt: skip
        return x, cache

    exp_qkv, exp_cache = run(reference.rotary_and_write_kv)
    out_qkv, out_cache = run(kt.rotary_and_write_kv)
    if dtype == torch.float32:  # the same rotated keys: the same codes
        assert torch.equal(out_qkv, exp_qkv)
        assert torch.equal(_bytes(out_cache), _bytes(exp_cache))
    else:  # a key one bf16 step apart after the rotation may land one e4m3 step apart
        tol = 2e-2 * 3
        torch.testing.assert_close(out_qkv.float(), exp_qkv.float(), atol=tol, rtol=tol)
        a, b = out_cache.float(), exp_cache.float()
        assert ((a - b).abs() <= b.abs() / 8 + 2**-9).all()
        assert (_bytes(out_cache) != _bytes(exp_cache)).float().mean() < 0.05
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert not _bytes(out_cache).view(2, num_blocks * block_size, -1)[:, ~written].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_paged_attention_fp8_cache_matches_twin(dtype: torch.dtype, group: int) -> None:
    b = make_paged_batch(MIXED, num_heads=2 * group, num_kv_heads=2, head_dim=32, block_size=16, dtype=dtype)
    cache = _as_fp8(b.kv_cache)
    out = kt.paged_attention(b.q, cache, b.meta, 0.2, kv_scale=SCALES)
    expected = reference.paged_attention(b.q, cache, b.meta, 0.2, SCALES)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    # And near the unquantized cache's attention: e4m3 keeps 3 mantissa bits.
    full = reference.paged_attention(b.q, b.kv_cache, b.meta, 0.2)
    assert (out.float() - full.float()).abs().mean() < 0.05


@pytest.mark.parametrize("num_splits", [2, 8])
def test_paged_attention_fp8_cache_split_k(num_splits: int) -> None:
    seqs = [(1, 300), (1, 17), (1, 129), (1, 2)]
    b = make_paged_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    cache = _as_fp8(b.kv_cache)
    out = kt.paged_attention(b.q, cache, b.meta, 0.25, num_splits=num_splits, kv_scale=SCALES)
    expected = reference.paged_attention(b.q, cache, b.meta, 0.25, SCALES)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_backends_agree_on_an_fp8_cache() -> None:
    """The Triton backend writes and reads an fp8 cache as the torch (CPU) backend does."""
    from worker_svc.attention.torch_paged import TorchPagedBackend
    from worker_svc.attention.triton_paged import TritonPagedBackend

    b = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    cos_sin = rope_cache(128, 16)
    positions = torch.randint(0, 128, (b.q.shape[0],))
    results = []
    for backend in (TorchPagedBackend(), TritonPagedBackend()):
        cache = _as_fp8(b.kv_cache)
        q, k, v = b.q.clone(), b.k.clone(), b.v.clone()
        out = backend.forward(q, k, v, cache, b.meta, 0.25, rotary=(positions, cos_sin), kv_scale=SCALES)
        results.append((out, cache))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(_bytes(results[1][1]), _bytes(results[0][1]))
