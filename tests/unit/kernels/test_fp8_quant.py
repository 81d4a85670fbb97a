"""The per-token FP8 quantization kernel against its twin (Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton.fp8_quant import quantize_fp8_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 3000), (3, 64), (1, 16)])
@pytest.mark.parametrize("row_block", [16384, 1024])  # the row loaded once; two passes over it
def test_quantize_fp8_rows_matches_twin_bit_for_bit(
    dtype: torch.dtype, shape: tuple[int, int], row_block: int
) -> None:
    x = (torch.randn(shape) * 3).to(dtype)
    x[0] = 0  # an all-zero row: finite scale, zero codes
    q, scale = quantize_fp8_rows(x, row_block=row_block)
    q_ref, scale_ref = reference.quantize_fp8_rows(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_quantize_fp8_rows_rounds_to_nearest_even_across_binades_and_subnormals() -> None:
    # Values that round up into the next power of two (127.4 -> 128), e4m3 subnormals (below
    # 2**-6 of the scale) and a negative zero: where Triton's interpreter's own cast goes wrong
    # (kernels.triton casts through torch under it, as the GPU's cast rounds).
    row = torch.tensor([[448.0, 127.4, -31.1, 1.98, 0.009, -0.0031, 0.00098, 0.0, -0.0, -1e-5]])
    q, scale = quantize_fp8_rows(row)
    q_ref, _ = reference.quantize_fp8_rows(row)
    assert scale.item() == 1.0
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert q.float()[0, 1].item() == 128.0
    assert q.view(torch.uint8)[0, 8].item() == 0x80  # -0 stays -0


def test_quantize_fp8_rows_scales_each_row_and_keeps_leading_dims_flat() -> None:
    x = torch.randn(2, 3, 32)
    x[1, 2] *= 1000  # one outlier token does not change the others' scales
    q, scale = quantize_fp8_rows(x)
    assert q.shape == (6, 32) and scale.shape == (6, 1)
    rel = ((q.float() * scale).view_as(x) - x).abs().amax(-1) / x.abs().amax(-1)
    assert rel.max() <= 2**-4  # half of e4m3's 3-bit mantissa step
    assert quantize_fp8_rows(torch.empty(0, 32))[0].shape == (0, 32)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dot", [True, False])
def test_skinny_gemm_with_fp8_weights_matches_twin(m: int, dot: bool) -> None:
    """The decode graphs' GEMM over FP8 weights (W8A16): the weight widened, the scales applied
    once to the fp32 sums."""
    from kernels.triton.skinny_gemm import SkinnyConfig, skinny_gemm
    from worker_svc.models.fp8 import quantize_weight_fp8

    x = torch.randn(m, 200)
    wq, scale = quantize_weight_fp8(torch.randn(72, 200) / 10)
    cfg = SkinnyConfig(block_n=32, block_k=64, dot=dot)
    for out_dtype in (torch.float32, None):
        out = skinny_gemm(x, wq, out_dtype, cfg, scale=scale)
        expected = reference.linear(x, wq, out_dtype, scale=scale)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [1, 5])
def test_skinny_gemm_with_fp8_rows_and_weights_matches_twin(m: int) -> None:
    """W8A8 in the decode graphs: x quantized per row, both scales applied to the fp32 sums."""
    from kernels.triton.skinny_gemm import SkinnyConfig, skinny_gemm
    from worker_svc.models.fp8 import quantize_weight_fp8

    xq, xs = reference.quantize_fp8_rows(torch.randn(m, 200))
    wq, scale = quantize_weight_fp8(torch.randn(72, 200) / 10)
    out = skinny_gemm(xq, wq, torch.float32, SkinnyConfig(block_n=32, block_k=64), scale=scale, x_scale=xs)
    expected = reference.linear(xq, wq, torch.float32, scale=scale, x_scale=xs)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------- the quantization fused into its producer


def _same_codes(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> None:
    assert torch.equal(a[1], b[1])  # the scales
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_matches_twin(with_residual: bool) -> None:
    from kernels.triton.rms_norm import rms_norm_fp8

    x = torch.randn(4, 96) * 3
    x[2] = 0  # an all-zero row (without a residual): finite scale, zero codes
    residual = torch.randn(4, 96) if with_residual else None
    weight = 1 + 0.1 * torch.randn(96)
    q, scale, new_residual = rms_norm_fp8(x, weight, 1e-6, residual)
    q_ref, scale_ref, residual_ref = reference.rms_norm_fp8(x, weight, 1e-6, residual)
    assert q.shape == (4, 96) and scale.shape == (4, 1) and q.dtype == torch.float8_e4m3fn
    assert torch.equal(new_residual, residual_ref)
    # The norm's sum of squares runs in another order than torch's mean: the scale may differ
    # in its last bit, and a code sitting on a rounding point may move by one step.
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(q.float() * scale, q_ref.float() * scale_ref, rtol=2**-3, atol=1e-6)
    assert (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean() < 0.02


@pytest.mark.parametrize("stream", [torch.bfloat16, torch.float16])
def test_rms_norm_fp8_quantizes_what_rms_norm_writes(stream: torch.dtype) -> None:
    """The fused pass is the norm kernel then the quantization kernel, code for code: the normed
    row is rounded to the stream's dtype first (also for an fp32 sum meeting a bf16 stream)."""
    import kernels.triton as kt
    from kernels.triton.fp8_quant import quantize_fp8_rows

    x = torch.randn(3, 2, 64)  # wider than the stream: a row-parallel layer's fp32 sum
    residual = torch.randn(3, 2, 64, dtype=stream)
    weight = (1 + 0.1 * torch.randn(64)).to(stream)
    q, scale, new_residual = kt.rms_norm_fp8(x, weight, 1e-6, residual)
    normed, residual_unfused = kt.rms_norm(x, weight, 1e-6, residual)
    _same_codes((q, scale), quantize_fp8_rows(normed))
    assert torch.equal(new_residual, residual_unfused) and new_residual.dtype == stream


@pytest.mark.parametrize("row_block", [16384, 32])  # the row in one block; in two passes of 32
def test_silu_and_mul_fp8_matches_twin_bit_for_bit(row_block: int) -> None:
    from kernels.triton.silu_mul import silu_and_mul_fp8

    x = torch.randn(2, 3, 2 * 100) * 3
    x[1, 1] = 0
    q, scale = silu_and_mul_fp8(x, row_block=row_block)
    assert q.shape == (6, 100) and scale.shape == (6, 1)
    _same_codes((q, scale), reference.silu_and_mul_fp8(x))
    assert silu_and_mul_fp8(torch.empty(0, 64))[0].shape == (0, 32)


@pytest.mark.parametrize("row_block", [16384, 32])
def test_silu_and_mul_fp8_quantizes_what_silu_and_mul_writes(row_block: int) -> None:
    import kernels.triton as kt
    from kernels.triton.fp8_quant import quantize_fp8_rows

    x = (torch.randn(3, 2 * 100) * 3).to(torch.bfloat16)
    _same_codes(kt.silu_and_mul_fp8(x, row_block=row_block), quantize_fp8_rows(kt.silu_and_mul(x)))


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_skinny_gemm_matches_twin_and_leaves_its_counters_at_zero(m: int, split_k: int) -> None:
    """Split-K: programs over runs of K, the last of each column block adds the partial sums in
    plane order; the same result every call, and the counters ready for the next one."""
    import importlib

    from kernels.triton.skinny_gemm import SkinnyConfig, skinny_gemm
    from worker_svc.models.fp8 import quantize_weight_fp8

    skinny = importlib.import_module("kernels.triton.skinny_gemm")
    cfg = SkinnyConfig(block_n=32, block_k=32, split_k=split_k)
    x = torch.randn(m, 200)
    w = torch.randn(72, 200) / 10
    out = skinny_gemm(x, w, torch.float32, cfg)
    torch.testing.assert_close(out, reference.linear(x, w, torch.float32), atol=1e-5, rtol=1e-5)
    assert torch.equal(skinny_gemm(x, w, torch.float32, cfg), out)
    xq, xs = reference.quantize_fp8_rows(x)
    wq, scale = quantize_weight_fp8(w)
    out = skinny_gemm(xq, wq, torch.float32, cfg, scale=scale, x_scale=xs)
    expected = reference.linear(xq, wq, torch.float32, scale=scale, x_scale=xs)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    _, counts = skinny._WORKSPACES.by_device[torch.device("cpu")]
    assert not counts.any()


@pytest.mark.parametrize("m", [1, 5])
def test_gated_fp8_skinny_gemm_then_quantization_is_silu_and_mul_fp8_bit_for_bit(m: int) -> None:
    """The FP8 decode MLP with SiLU·mul in the gate|up GEMM, its output quantized by
    `quantize_fp8_rows`, hands the down projection the codes and scales the GEMM then
    `silu_and_mul_fp8` hand it."""
    import kernels.triton as kt
    from kernels.triton.skinny_gemm import SkinnyConfig, skinny_gemm
    from worker_svc.models.fp8 import quantize_weight_fp8

    x = torch.randn(m, 128)
    w = torch.randn(2 * 48, 128) / 8
    xq, xs = reference.quantize_fp8_rows(x)
    wq, scale = quantize_weight_fp8(w)
    cfg = SkinnyConfig(block_n=32, block_k=64)
    fused = skinny_gemm(xq, wq, torch.bfloat16, cfg, scale=scale, x_scale=xs, gated=True)
    plain = skinny_gemm(xq, wq, torch.bfloat16, cfg, scale=scale, x_scale=xs)
    fused_again, parts = skinny_gemm(
        xq, wq, torch.bfloat16, cfg, scale=scale, x_scale=xs, gated=True, row_amax=True
    )
    assert torch.equal(fused_again, fused) and parts.shape == (m, 3)  # 48 columns, 16 a program
    q, qs = quantize_fp8_rows(fused, partial_amax=parts)
    want_q, want_s = kt.silu_and_mul_fp8(plain)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(qs, want_s)


@pytest.mark.parametrize("parts", [1, 7])
def test_quantize_fp8_rows_by_parts_of_the_amax_is_quantize_fp8_rows(parts: int) -> None:
    """Rows whose amax comes in parts (the max of a row's parts being its amax, as the gated
    skinny GEMM writes them) get the codes and scales of the plain quantization, the row
    spread over programs of PART_COLUMNS columns."""
    x = torch.randn(3, 5000, dtype=torch.bfloat16)
    x[1] = 0  # an all-zero row: the smallest scale
    split = torch.tensor_split(x.float().abs(), parts, dim=1)
    partial = torch.stack([p.amax(dim=1) for p in split], dim=1).contiguous()
    q, scale = quantize_fp8_rows(x, partial_amax=partial)
    want_q, want_s = quantize_fp8_rows(x)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_s)
