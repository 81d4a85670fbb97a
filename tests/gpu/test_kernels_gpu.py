"""The Triton kernels against their PyTorch twins at serving sizes, compiled for the GPU.

Attention is compared with the twin run in fp32 on the same bf16 inputs; the kernel feeds
tensor cores bf16 (Q, K, V and the softmax weights P) and accumulates in fp32, so it may
differ by about one bf16 rounding of the output: atol = rtol = 2e-2.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch

import kernels.triton as kt
from kernels import reference
from tests.unit.kernels import PagedBatch, make_paged_batch, rope_cache

pytestmark = pytest.mark.gpu

pa_mod = importlib.import_module("kernels.triton.paged_attention")

BF16_TOL = 2e-2


def _batch(
    seqs: list[tuple[int, int]], num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128
) -> PagedBatch:
    return make_paged_batch(
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
    )


def _check_attention(b: PagedBatch, out: torch.Tensor) -> None:
    scale = b.q.shape[-1] ** -0.5
    expected = reference.paged_attention(b.q.float(), b.kv_cache.float(), b.meta, scale)
    assert out.dtype == b.q.dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, atol=BF16_TOL, rtol=BF16_TOL)


def _decode_seqs(n: int, max_len: int, rng: random.Random) -> list[tuple[int, int]]:
    return [(1, rng.randint(1, max_len)) for _ in range(n - 1)] + [(1, max_len)]


@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_decode_batch_64_contexts_to_8k(num_splits: int | None) -> None:
    b = _batch(_decode_seqs(64, 8192, random.Random(1)))
    out = kt.paged_attention(b.q, b.kv_cache, b.meta, 128**-0.5, num_splits=num_splits)
    _check_attention(b, out)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 32), (32, 8), (32, 4), (16, 2)])
def test_decode_few_long_sequences_takes_split_k(num_heads: int, num_kv_heads: int) -> None:
    b = _batch([(1, 8192), (1, 5000), (1, 77)], num_heads=num_heads, num_kv_heads=num_kv_heads)
    assert pa_mod._choose_num_splits(b.meta, num_kv_heads, b.q.device) > 1
    _check_attention(b, kt.paged_attention(b.q, b.kv_cache, b.meta, 128**-0.5))


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 32), (32, 8), (32, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_prefill_chunks_and_decodes(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    rng = random.Random(2)
    seqs = [(512, 512 + 4096), (512, 1024), (2048, 2048), (37, 37 + 3000), (1, 1)]
    seqs += _decode_seqs(32, 8192, rng)
    b = _batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    _check_attention(b, kt.paged_attention(b.q, b.kv_cache, b.meta, head_dim**-0.5))


def test_attention_never_syncs_with_host() -> None:
    decode = _batch(_decode_seqs(4, 8192, random.Random(3)))  # split-K + merge
    mixed = _batch([(300, 1000), (1, 4000)])
    for b in (decode, mixed):  # compile first: the first launch may query the device
        kt.paged_attention(b.q, b.kv_cache, b.meta, 0.1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in (decode, mixed):
            kt.paged_attention(b.q, b.kv_cache, b.meta, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("num_seqs", [8, 64])
def test_decode_replays_in_a_cuda_graph(num_seqs: int) -> None:
    """Capture once, then replay with new lengths and block tables written into the same tensors."""
    rng = random.Random(4)
    b = _batch(_decode_seqs(num_seqs, 4096, rng))
    meta = b.meta
    out = torch.empty_like(b.q)
    scale = 128**-0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kt.paged_attention(b.q, b.kv_cache, meta, scale, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kt.paged_attention(b.q, b.kv_cache, meta, scale, out=out)

    # New step: shorter contexts (within the captured block-table width), new queries.
    new_lens = [rng.randint(1, 4096) for _ in range(num_seqs)]
    meta.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    meta.seq_lens_cpu = new_lens
    meta.max_seq_len = max(new_lens)
    meta.block_tables.copy_(meta.block_tables[torch.randperm(num_seqs, device="cuda")])
    b.q.copy_(torch.randn_like(b.q))
    graph.replay()
    _check_attention(b, out)


def test_write_kv_cache_4k_tokens() -> None:
    num_blocks, block_size, hkv, d, t = 2048, 16, 8, 128, 4096
    qkv = torch.randn(t, (32 + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    k = qkv[:, 32 * d : (32 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (32 + hkv) * d :].view(t, hkv, d)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:t]
    cache = torch.randn(2, num_blocks, block_size, hkv, d, device="cuda", dtype=torch.bfloat16)
    expected = cache.clone()
    kt.write_kv_cache(k, v, cache, slots)
    reference.write_kv_cache(k, v, expected, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_hidden_4096(with_residual: bool) -> None:
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x) if with_residual else None
    weight = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    normed, new_residual = kt.rms_norm(x, weight, 1e-5, residual)
    exp_normed, exp_residual = reference.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(new_residual, exp_residual, atol=0, rtol=0)
    # The fp32 sum of squares may round differently; allow one bf16 ulp.
    torch.testing.assert_close(normed, exp_normed, atol=BF16_TOL, rtol=BF16_TOL)


def test_rms_norm_fp32_sum_into_bf16_stream() -> None:
    # The tensor-parallel path: o_proj / down_proj hand over their fp32 all-reduced sum.
    x = torch.randn(64, 4096, device="cuda", dtype=torch.float32)
    residual = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    normed, new_residual = kt.rms_norm(x, weight, 1e-5, residual)
    exp_normed, exp_residual = reference.rms_norm(x, weight, 1e-5, residual)
    assert new_residual.dtype == normed.dtype == torch.bfloat16
    torch.testing.assert_close(new_residual, exp_residual, atol=0, rtol=0)
    torch.testing.assert_close(normed, exp_normed, atol=BF16_TOL, rtol=BF16_TOL)


def test_silu_and_mul_llama_8b_mlp() -> None:
    x = 4 * torch.randn(2048, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    out = kt.silu_and_mul(x)
    # SiLU is rounded to bf16 before the multiply, as in the twin; the exp may differ in its
    # last fp32 bits, which moves a rare element by one bf16 ulp.
    torch.testing.assert_close(out, reference.silu_and_mul(x), atol=BF16_TOL, rtol=BF16_TOL)


def test_fused_rotary_and_kv_write_llama_8b_shape() -> None:
    t, h, hkv, d, num_blocks, block_size = 4096, 32, 8, 128, 2048, 16
    cos_sin = rope_cache(8192, d).cuda()
    positions = torch.randint(0, 8192, (t,), device="cuda")
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:t]
    slots[::97] = -1  # padding rows
    qkv = torch.randn(t, (h + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(2, num_blocks, block_size, hkv, d, device="cuda", dtype=torch.bfloat16)

    def run(fn):  # type: ignore[no-untyped-def]
        x, c = qkv.clone(), cache.clone()
        q, k, v = x.split([h * d, hkv * d, hkv * d], dim=-1)
        fn(positions, q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d), cos_sin, c, slots)
        return x, c

    exp_qkv, exp_cache = run(reference.rotary_and_write_kv)
    out_qkv, out_cache = run(kt.rotary_and_write_kv)
    torch.testing.assert_close(out_qkv, exp_qkv, atol=BF16_TOL, rtol=BF16_TOL)
    torch.testing.assert_close(out_cache, exp_cache, atol=BF16_TOL, rtol=BF16_TOL)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_skinny_gemm_llama_8b_o_proj(m: int, out_dtype: torch.dtype) -> None:
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    out = kt.skinny_gemm(x, weight, out_dtype)
    expected = reference.linear(x, weight, out_dtype)
    assert out.dtype == out_dtype
    # fp32 sums in another order: within an fp32 rounding of the sum, then one bf16 rounding.
    tol = BF16_TOL if out_dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("cfg", [(32, 512, 4, 3), (32, 512, 4, 4), (64, 256, 4, 4)], ids=["s3", "s4", "n64"])
def test_skinny_gemms_fold_the_residual_norm_at_the_llama_8b_shapes(m: int, cfg: tuple) -> None:
    """A bf16 decode layer's norms folded into its skinny GEMMs (the decode graphs' candidate
    tiles): o_proj and down add their product to the stream with the bits of the fp32 GEMM then
    the norm kernel's add, and write h * g (its bits) and h's squares; qkv and gate|up (gated)
    read those, within bf16's tolerance of the norm kernel then the GEMM."""
    from kernels.triton.skinny_gemm import SkinnyConfig

    n, k, warps, stages = cfg
    config = SkinnyConfig(block_n=n, block_k=k, num_warps=warps, num_stages=stages)
    stream = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    g = (1 + torch.randn(4096, device="cuda") / 4).to(torch.bfloat16)
    for cols in (4096, 14336):  # o_proj, down
        x = torch.randn(m, cols, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, cols, device="cuda", dtype=torch.bfloat16) / 64
        h, scaled, squares = kt.skinny_gemm(x, w, config=config, residual=stream, norm_weight=g)
        product = kt.skinny_gemm(x, w, torch.float32, config)
        assert torch.equal(h, kt.rms_norm(product, g, 1e-5, stream)[1])
        assert torch.equal(scaled, (h.float() * g.float()).to(torch.bfloat16))
        torch.testing.assert_close(squares.sum(1), h.float().square().sum(1), atol=1e-2, rtol=1e-5)
    normed = kt.rms_norm(h, g, 1e-5)[0]
    for rows, gated in ((6144, False), (2 * 14336, True)):  # qkv, gate|up
        w = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16) / 64
        fused = kt.skinny_gemm(scaled, w, config=config, gated=gated, norm_parts=squares, eps=1e-5)
        chain = kt.skinny_gemm(normed, w, config=config, gated=gated)
        # (gate and up each round to bf16 before SiLU·mul: a near-cancelling product moves most)
        torch.testing.assert_close(fused, chain, atol=4e-2, rtol=BF16_TOL)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("num_seqs", "ctx", "num_splits"), [(1, 32768, 32), (4, 8192, 16), (1, 128, 32)])
def test_decode_fused_merge_in_a_graph(fp8: bool, num_seqs: int, ctx: int, num_splits: int) -> None:
    """The decode kernel's fused merge (the last segment merges, DecodeConfig.fused_merge) gives
    the separate merge's output, launch after launch in a replayed graph (its counters go back to
    zero), including a short context split more ways than it has tiles (a graph's fixed split)."""
    pd = importlib.import_module("kernels.triton.paged_decode")
    b = _batch([(1, ctx)] * num_seqs)
    cache = b.kv_cache
    scales = None
    if fp8:
        scales = torch.tensor([0.02, 0.02, 1.0, 1.0], device="cuda")
        cache = (b.kv_cache.float() / 0.02).to(torch.float8_e4m3fn)
    base = pd.pick_decode_config(128, fp8)
    plain = torch.empty_like(b.q)
    pd.paged_decode(b.q, cache, b.meta, 0.1, plain, num_splits=num_splits, kv_scale=scales, config=base)
    fused = pd.DecodeConfig(base.tile, base.num_warps, base.num_stages, base.dot_f16, fused_merge=True)
    out = torch.full_like(b.q, float("nan"))
    pd.paged_decode(b.q, cache, b.meta, 0.1, out, num_splits=num_splits, kv_scale=scales, config=fused)
    torch.testing.assert_close(out, plain, atol=1e-2, rtol=1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pd.paged_decode(b.q, cache, b.meta, 0.1, out, num_splits=num_splits, kv_scale=scales, config=fused)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, plain, atol=1e-2, rtol=1e-2)
    assert int(pd._counters(b.q.device, 1).abs().sum()) == 0
