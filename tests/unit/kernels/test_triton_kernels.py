"""Each Triton kernel against its PyTorch twin on fresh random inputs, under the interpreter.

Shapes are tiny (the interpreter runs every program in Python) but chosen to hit the
interesting paths: several query blocks per sequence, tiles that span several cache blocks,
cached prefixes under a prefill chunk, GQA groups, masked (non power-of-two) dimensions,
split-K segments that see no key.

Tolerances: fp32 1e-5 (only summation order differs); fp16 2e-3 absolute on O(1) values
(one rounding of P to fp16 before P@V, plus output rounding); bf16 3e-2 (the interpreter
converts fp32 -> bf16 by truncation, not round-to-nearest, so outputs may sit one bf16 ulp
off, 2^-7 relative).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import kernels.triton as kt
from kernels import reference
from tests.unit.kernels import make_paged_batch, rope_cache
from worker_svc.attention.torch_paged import TorchPagedBackend
from worker_svc.attention.triton_paged import TritonPagedBackend

# The package re-exports the function `paged_attention`, which shadows the submodule's name
# as an attribute: fetch the module itself to reach its internals.
pa_mod = importlib.import_module("kernels.triton.paged_attention")

ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}

# A mixed step: prefill chunks over cached prefixes, a whole prompt, decodes, one chunk long
# enough for several query blocks, one sequence shorter than a cache block.
MIXED = [(5, 40), (1, 17), (20, 20), (1, 70), (3, 3), (37, 50), (1, 1)]


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL[dtype], rtol=ATOL[dtype])


# ----------------------------------------------------------------------------- KV write


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_cache_matches_twin(dtype: torch.dtype) -> None:
    num_blocks, block_size, hkv, d, t = 6, 16, 3, 24, 11
    # k/v as column slices of a fused qkv projection: strided rows, contiguous head_dim.
    qkv = torch.randn(t, (4 + 2 * hkv) * d, dtype=dtype)
    k = qkv[:, 4 * d : (4 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (4 + hkv) * d :].view(t, hkv, d)
    slots = torch.randperm(num_blocks * block_size)[:t]
    cache = torch.randn(2, num_blocks, block_size, hkv, d, dtype=dtype)
    expected = cache.clone()
    kt.write_kv_cache(k, v, cache, slots)
    reference.write_kv_cache(k, v, expected, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


def test_write_kv_cache_casts_and_skips_padding() -> None:
    num_blocks, block_size, hkv, d, t = 4, 16, 2, 16, 6
    k = torch.randn(t, hkv, d)
    v = torch.randn(t, hkv, d)
    slots = torch.tensor([3, 17, -1, 40, -1, 63])
    cache = torch.zeros(2, num_blocks, block_size, hkv, d, dtype=torch.float16)
    expected = cache.clone()
    kt.write_kv_cache(k, v, cache, slots)
    keep = slots >= 0  # the twin knows no padding slots: feed it only the real ones
    reference.write_kv_cache(k[keep], v[keep], expected, slots[keep])
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


# ----------------------------------------------------------------------------- SiLU * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 2 * 48), (2, 5, 2 * 1100), (0, 64)])
def test_silu_and_mul_matches_twin(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = 3 * torch.randn(shape, dtype=dtype)
    out = kt.silu_and_mul(x)
    expected = reference.silu_and_mul(x)
    assert out.shape == expected.shape and out.dtype == dtype
    _close(out, expected, dtype)


def test_silu_and_mul_reads_a_strided_view() -> None:
    wide = torch.randn(4, 300)
    x = wide[:, :200]  # rows not contiguous with each other
    torch.testing.assert_close(kt.silu_and_mul(x), reference.silu_and_mul(x))


# ----------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [48, 64])
def test_rms_norm_matches_twin(dtype: torch.dtype, with_residual: bool, hidden: int) -> None:
    x = torch.randn(2, 3, hidden, dtype=dtype)
    residual = torch.randn(2, 3, hidden, dtype=dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    normed, new_residual = kt.rms_norm(x, weight, 1e-6, residual)
    exp_normed, exp_residual = reference.rms_norm(x, weight, 1e-6, residual)
    assert normed.dtype == exp_normed.dtype and normed.shape == exp_normed.shape
    _close(normed, exp_normed, dtype)
    _close(new_residual, exp_residual, dtype)
    if residual is None:
        assert new_residual is x


@pytest.mark.parametrize("stream", [torch.bfloat16, torch.float16])
def test_rms_norm_rounds_a_wider_sum_once_to_the_residual_dtype(stream: torch.dtype) -> None:
    # A row-parallel projection's fp32 all-reduced sum meets the bf16 residual stream.
    x = torch.randn(5, 64, dtype=torch.float32)
    residual = torch.randn(5, 64, dtype=stream)
    weight = (1 + 0.1 * torch.randn(64)).to(stream)
    normed, new_residual = kt.rms_norm(x, weight, 1e-6, residual)
    exp_normed, exp_residual = reference.rms_norm(x, weight, 1e-6, residual)
    assert new_residual.dtype == stream and normed.dtype == stream
    assert exp_residual.dtype == stream and exp_normed.dtype == stream
    # The twin rounds the exact fp32 sum once, not x first. (The interpreter's casts to 16-bit
    # floats truncate, so the kernel is held to the tolerance here and to bit equality on
    # the GPU: tests/gpu/test_kernels_gpu.py.)
    torch.testing.assert_close(exp_residual, (x + residual.float()).to(stream), atol=0, rtol=0)
    _close(new_residual, exp_residual, stream)
    _close(normed, exp_normed, stream)


def test_rms_norm_fp32_weight_promotes() -> None:
    x = torch.randn(4, 32, dtype=torch.float16)
    weight = torch.randn(32)
    normed, _ = kt.rms_norm(x, weight, 1e-5)
    expected, _ = reference.rms_norm(x, weight, 1e-5)
    assert normed.dtype == torch.float32
    _close(normed, expected, torch.float16)


# ----------------------------------------------------------------------------- rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("h", "hkv", "head_dim"), [(6, 2, 16), (3, 3, 24)])
def test_fused_rotary_and_kv_write_matches_twin(dtype: torch.dtype, h: int, hkv: int, head_dim: int) -> None:
    t, max_pos, num_blocks, block_size = 9, 100, 6, 4
    cos_sin = rope_cache(max_pos, head_dim)
    positions = torch.randint(0, max_pos, (t,))
    slots = torch.randperm(num_blocks * block_size)[:t]
    slots[[2, 7]] = -1  # padding rows: rotated, not written
    qkv = torch.randn(t, (h + 2 * hkv) * head_dim, dtype=dtype)

    def run(fn) -> tuple[torch.Tensor, torch.Tensor]:
        x = qkv.clone()
        q, k, v = x.split([h * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
        cache = torch.zeros(2, num_blocks, block_size, hkv, head_dim, dtype=dtype)
        fn(positions, q.view(t, h, head_dim), k.view(t, hkv, head_dim), v.view(t, hkv, head_dim), cos_sin,
           cache, slots)  # fmt: skip
        return x, cache

    exp_qkv, exp_cache = run(reference.rotary_and_write_kv)
    out_qkv, out_cache = run(kt.rotary_and_write_kv)
    _close(out_qkv, exp_qkv, dtype)  # q and k rotated in place, v untouched
    _close(out_cache, exp_cache, dtype)
    assert torch.equal(out_qkv[:, (h + hkv) * head_dim :], qkv[:, (h + hkv) * head_dim :])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert not out_cache.view(2, num_blocks * block_size, -1)[:, ~written].any()


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_paged_attention_mixed_batch(dtype: torch.dtype, head_dim: int, group: int) -> None:
    hkv = 2
    b = make_paged_batch(
        MIXED, num_heads=hkv * group, num_kv_heads=hkv, head_dim=head_dim, block_size=16, dtype=dtype
    )
    scale = head_dim**-0.5
    out = kt.paged_attention(b.q, b.kv_cache, b.meta, scale)
    _close(out, reference.paged_attention(b.q, b.kv_cache, b.meta, scale), dtype)


def test_paged_attention_bf16() -> None:
    b = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.bfloat16)
    out = kt.paged_attention(b.q, b.kv_cache, b.meta, 0.2)
    assert out.dtype == torch.bfloat16
    _close(out, reference.paged_attention(b.q, b.kv_cache, b.meta, 0.2), torch.bfloat16)


def test_paged_attention_odd_shapes() -> None:
    """GQA group 3 (rows past BLOCK_Q * GROUP masked), head_dim 24 (padded to 32), block size 32."""
    b = make_paged_batch(MIXED, num_heads=6, num_kv_heads=2, head_dim=24, block_size=32, dtype=torch.float32)
    out = kt.paged_attention(b.q, b.kv_cache, b.meta, 0.3)
    _close(out, reference.paged_attention(b.q, b.kv_cache, b.meta, 0.3), torch.float32)


@pytest.mark.parametrize(("block_m", "tile"), [(16, 16), (32, 32), (16, 128)])
def test_paged_attention_tile_shapes(monkeypatch: pytest.MonkeyPatch, block_m: int, tile: int) -> None:
    """Tiles equal to, twice and eight times the cache block size; BLOCK_M below the chunk."""
    monkeypatch.setattr(pa_mod, "_pick_config", lambda *_: pa_mod._Config(block_m, tile, 4, 2))
    b = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    out = kt.paged_attention(b.q, b.kv_cache, b.meta, 0.3)
    _close(out, reference.paged_attention(b.q, b.kv_cache, b.meta, 0.3), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_paged_attention_split_k_decode(dtype: torch.dtype, group: int, num_splits: int) -> None:
    # Long and short contexts together: with 8 segments over a 3-tile context most segments
    # are empty and must drop out of the merge.
    seqs = [(1, 300), (1, 17), (1, 129), (1, 2)]
    b = make_paged_batch(seqs, num_heads=2 * group, num_kv_heads=2, head_dim=16, block_size=16, dtype=dtype)
    out = kt.paged_attention(b.q, b.kv_cache, b.meta, 0.25, num_splits=num_splits)
    _close(out, reference.paged_attention(b.q, b.kv_cache, b.meta, 0.25), dtype)


def test_split_k_chosen_for_long_decode_only() -> None:
    seqs = [(1, 1100), (1, 40)]
    b = make_paged_batch(seqs, num_heads=2, num_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32)
    assert pa_mod._choose_num_splits(b.meta, 1, b.q.device) > 1
    # The default path takes the split for this batch and still matches.
    out = kt.paged_attention(b.q, b.kv_cache, b.meta, 0.25)
    _close(out, reference.paged_attention(b.q, b.kv_cache, b.meta, 0.25), torch.float32)
    mixed = make_paged_batch(
        [(2, 1100), (1, 40)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32
    )
    assert pa_mod._choose_num_splits(mixed.meta, 1, b.q.device) == 1
    short = make_paged_batch(
        [(1, 40)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32
    )
    assert pa_mod._choose_num_splits(short.meta, 1, b.q.device) == 1


def test_merge_attn_partials_matches_twin() -> None:
    t, h, s, d = 3, 4, 5, 24
    partial_out = torch.randn(t, h, s, d)
    partial_lse = 3 * torch.randn(t, h, s)
    partial_lse[0, :, 1:] = float("-inf")  # segments that saw no key
    partial_lse[2, 1, 3] = float("-inf")
    partial_out[partial_lse == float("-inf")] = float("nan")  # never written, never read
    out = kt.merge_attn_partials(partial_out, partial_lse)
    assert not out.isnan().any()
    _close(out, reference.merge_attn_partials(partial_out, partial_lse), torch.float32)
    torch.testing.assert_close(out[0], partial_out[0, :, 0])


def test_paged_attention_writes_into_out() -> None:
    b = make_paged_batch(
        [(3, 10), (1, 5)], num_heads=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32
    )
    out = torch.full_like(b.q, float("nan"))
    result = kt.paged_attention(b.q, b.kv_cache, b.meta, 0.3, out=out)
    assert result is out
    _close(out, reference.paged_attention(b.q, b.kv_cache, b.meta, 0.3), torch.float32)


# ----------------------------------------------------------------------------- backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_backend_is_drop_in_for_torch_backend(dtype: torch.dtype) -> None:
    b = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=dtype)
    # Start both from a cache whose new-token slots hold garbage: each backend must write first.
    stale = b.kv_cache.clone()
    stale.view(2, -1, 2, 16)[:, b.meta.slot_mapping] = 100.0
    cache_triton, cache_torch = stale.clone(), stale.clone()
    k, v = torch.randn_like(b.k), torch.randn_like(b.v)
    out = TritonPagedBackend().forward(b.q, k, v, cache_triton, b.meta, 0.3)
    expected = TorchPagedBackend().forward(b.q, k, v, cache_torch, b.meta, 0.3)
    assert TritonPagedBackend.name == "triton"
    torch.testing.assert_close(cache_triton, cache_torch, atol=0, rtol=0)
    _close(out, expected, dtype)


# ----------------------------------------------------------------------------- skinny GEMM


# The skinny GEMM's three bodies for its epilogues: tensor cores, split-K, plain sum.
EPILOGUE_TILES = pytest.mark.parametrize(
    "cfg",
    [
        dict(block_n=32, block_k=64),
        dict(block_n=16, block_k=64, split_k=2),
        dict(block_n=32, block_k=64, dot=False),
    ],
    ids=["dot", "split", "sum"],
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dot", [True, False])
def test_skinny_gemm_matches_twin(dtype: torch.dtype, m: int, dot: bool) -> None:
    from kernels.triton.skinny_gemm import SkinnyConfig

    # N and K not multiples of the blocks: the masks are exercised.
    x = torch.randn(m, 200, dtype=dtype)
    weight = torch.randn(72, 200, dtype=dtype) / 10
    cfg = SkinnyConfig(block_n=32, block_k=64, dot=dot)
    out = kt.skinny_gemm(x, weight, config=cfg)
    assert out.dtype == dtype and out.shape == (m, 72)
    _close(out, reference.linear(x, weight), dtype)
    wide = kt.skinny_gemm(x, weight, out_dtype=torch.float32, config=cfg)
    assert wide.dtype == torch.float32
    torch.testing.assert_close(wide, reference.linear(x, weight, torch.float32), atol=1e-4, rtol=1e-4)


def test_skinny_gemm_keeps_leading_dims_and_reads_strided_rows() -> None:
    wide = torch.randn(2, 3, 96)
    x = wide[..., :64]  # rows not contiguous
    weight = torch.randn(40, 64)
    out = kt.skinny_gemm(x, weight)
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(out, reference.linear(x, weight), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [1, 3])
@EPILOGUE_TILES
def test_gated_skinny_gemm_is_the_gemm_then_silu_and_mul_bit_for_bit(m: int, cfg: dict) -> None:
    """SiLU·mul in the epilogue gives the bits of the GEMM then SiLU·mul's kernel (the decode
    graphs' MLP launches one kernel where it launched two); an intermediate size that is not a
    multiple of a program's columns exercises the masks."""
    from kernels.triton.skinny_gemm import SkinnyConfig

    config = SkinnyConfig(**cfg)
    x = torch.randn(m, 128, dtype=torch.bfloat16)
    weight = torch.randn(2 * 40, 128, dtype=torch.bfloat16) / 8  # gate | up, I = 40
    fused = kt.skinny_gemm(x, weight, config=config, gated=True)
    assert fused.shape == (m, 40) and fused.dtype == torch.bfloat16
    assert torch.equal(fused, kt.silu_and_mul(kt.skinny_gemm(x, weight, config=config)))
    _close(fused, reference.silu_and_mul(reference.linear(x, weight)), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
@EPILOGUE_TILES
def test_skinny_gemm_folds_the_residual_norm_around_it(dtype: torch.dtype, m: int, cfg: dict) -> None:
    """The residual RMSNorm folded into the GEMMs on either side of it. The GEMM before the norm
    adds its product to the stream (the bits of the fp32 GEMM then the norm kernel's add) and
    writes h * g and h's squares in parts; the GEMM after it reads h * g and scales its sums by
    1 / rms from the parts: the norm then the GEMM, up to where bf16 rounds (exact in fp32).
    Sizes that are not multiples of the tiles exercise the masks."""
    from kernels.triton.skinny_gemm import SkinnyConfig

    config = SkinnyConfig(**cfg)
    torch.manual_seed(0)
    x = torch.randn(m, 96, dtype=dtype)
    w_before = (torch.randn(200, 96) / 10).to(dtype)
    stream = torch.randn(m, 200, dtype=dtype)
    g = (1 + torch.randn(200) / 4).to(dtype)
    h, hg, parts = kt.skinny_gemm(x, w_before, config=config, residual=stream, norm_weight=g)
    assert h.dtype == hg.dtype == dtype and h.shape == hg.shape == (m, 200) and parts.shape[0] == m
    product = kt.skinny_gemm(x, w_before, out_dtype=torch.float32, config=config)
    assert torch.equal(h, kt.rms_norm(product, g, 1e-5, stream)[1])
    _close(hg, h.float() * g.float(), dtype)  # (the interpreter's bf16 cast truncates; the GPU's rounds)
    torch.testing.assert_close(parts.sum(1), h.float().square().sum(1), atol=1e-3, rtol=1e-5)

    w_after = (torch.randn(72, 200) / 10).to(dtype)
    normed = reference.rms_norm(h, g, 1e-5)[0]
    fused = kt.skinny_gemm(hg, w_after, config=config, norm_parts=parts, eps=1e-5)
    assert fused.shape == (m, 72) and fused.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else ATOL[dtype]
    torch.testing.assert_close(fused.float(), reference.linear(normed, w_after).float(), atol=tol, rtol=tol)
    if dtype == torch.bfloat16:  # gate | up, I = 36
        gated = kt.skinny_gemm(hg, w_after, config=config, gated=True, norm_parts=parts, eps=1e-5)
        _close(gated, reference.silu_and_mul(reference.linear(normed, w_after)), dtype)


def test_pdl_is_off_where_the_interpreter_runs(monkeypatch) -> None:
    """A `dual_jit(pdl=True)` kernel runs under the interpreter with PDL off (its grid waits are
    compiled-only); on the GPU LLMESH_PDL=0 turns it off (tests/gpu/test_pdl_gpu.py: same bits)."""
    assert not kt.pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("LLMESH_PDL", "0")
    assert not kt.pdl_enabled(torch.device("cuda", 0))  # decided before any device is asked
    from kernels.triton.skinny_gemm import _prefetch_lines, _skinny_gemm_kernel

    assert _skinny_gemm_kernel.pdl
    assert _prefetch_lines(256, 2) == 8 and _prefetch_lines(512, 1) == 8  # 2 K tiles of 128-byte lines


def test_the_interpreters_e4m3_cast_is_torchs_during_a_launch_only() -> None:
    """Under the interpreter a cast to e4m3 rounds as torch's (and the GPU's) does, so a kernel
    needs no rounding by hand; the interpreter's own cast is back after the launch."""
    from triton.runtime.interpreter import InterpreterBuilder

    before = InterpreterBuilder.create_fp_to_fp
    k = torch.tensor([[[127.4, -0.0, 0.0031, 300.0]]])  # a carry into the exponent, -0, a subnormal
    cache = torch.zeros(2, 1, 4, 1, 4, dtype=torch.float8_e4m3fn)
    kt.write_kv_cache(k, k, cache, torch.tensor([0]))
    assert InterpreterBuilder.create_fp_to_fp is before
    want = k.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(cache[0, 0, 0].view(torch.uint8), want[0])
