"""FP8 (e4m3) W8A8 linear layers: `quantization="fp8"`, as vLLM's dynamic FP8.

Weights are quantized once, on load, from the checkpoint's bf16/fp32 tensors: one scale per
output channel (row of W), amax / 448, which keeps a channel of small weights from being
flattened by another's large ones (a per-tensor scale loses ~1 bit on real checkpoints).
Activations are quantized per token at every GEMM (`quantize_fp8_rows`: the Triton kernel on
CUDA, its twin elsewhere), and the GEMM is `torch._scaled_mm` with both scales applied to its
fp32 accumulators (rowwise scaling: CUTLASS on Hopper, a reference kernel on the CPU).

Only the decoder's projections are quantized; the embedding, the norms and the lm_head stay
in the model's dtype (the logits are where FP8's error would show first, and vLLM keeps the
head unquantized too). A layer whose dims are not multiples of 16 (the FP8 GEMM's tile rule)
stays unquantized.

The activation quantization of the GEMMs that follow a norm (q|k|v, gate|up) and SiLU·mul
(down) is fused into those kernels (`rms_norm_fp8`, `silu_and_mul_fp8`, as vLLM's fusion passes
do): they hand the layer `Fp8Rows`, which it multiplies as they are. Only o_proj's input, the
attention output, is quantized by a kernel of its own.

The KV cache is untouched here: what the layers write into it is still the model's dtype,
but its values differ from the unquantized model's, so the worker's fingerprint names the
quantization and no block is shared between the two.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from kernels import reference

if TYPE_CHECKING:
    from kernels.triton.skinny_gemm import SkinnyConfig

log = logging.getLogger(__name__)

QUANTIZATIONS = ("fp8",)
_FP8_MAX = reference.FP8_MAX
# Hopper's FP8 tensor cores accumulate in fewer bits unless the GEMM promotes its partial sums to
# fp32 every few k-steps; the library's fast-accumulation kernels skip that, as vLLM's CUTLASS FP8
# schedules (FP8FastAccum) do. H100, 8B shapes, 256-16,384 rows: 5-18 % faster, an error of
# 0.4-1.2 % of the output's largest value against promoted sums, a tenth to a third of what the
# per-token quantization itself costs (3.3-4.1 %) (docs/benchmarks.md). LLMESH_FP8_FAST_ACCUM=0:
# promoted sums. The CPU's reference kernel has no such mode.
FAST_ACCUM = os.environ.get("LLMESH_FP8_FAST_ACCUM", "1") != "0"


class Fp8Rows(NamedTuple):
    """Activations already quantized per token, by the kernel that produced them (the fused
    RMSNorm or SiLU·mul): what an FP8 layer multiplies without quantizing again."""

    q: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M, 1] fp32: row m stands for q[m] * scale[m]
    dtype: torch.dtype  # the dtype the unquantized rows had: the GEMM's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (Wq [out, in] float8_e4m3fn, scale [out] fp32), W ≈ Wq * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / _FP8_MAX).clamp(min=reference.FP8_MIN_SCALE)
    q = (w / scale[:, None]).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantizable(layer: nn.Module) -> bool:
    """Whether `layer` (a ShardedLinear) can take FP8 weights: a float matrix whose dims are
    multiples of 16."""
    w = getattr(layer, "weight", None)
    return (
        w is not None
        and w.dim() == 2
        and w.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and w.shape[0] % 16 == 0
        and w.shape[1] % 16 == 0
    )


def quantize_model_fp8(model: nn.Module) -> int:
    """Quantize every linear layer of `model` (in place, one layer at a time, so the peak is
    one layer's fp32 copy above the model); returns how many were quantized."""
    from worker_svc.models.parallel_layers import ShardedLinear

    done = skipped = 0
    for layer in model.modules():
        if not isinstance(layer, ShardedLinear):
            continue
        if not quantizable(layer):
            skipped += 1
            continue
        q, scale = quantize_weight_fp8(layer.weight.data)
        layer.set_fp8_weight(q, scale)
        done += 1
    if skipped:
        log.warning("fp8: %d linear layers kept their dtype (dims not multiples of 16)", skipped)
    if done and next(model.parameters()).device.type == "cuda":
        torch.cuda.empty_cache()  # the freed bf16 weights count as free for the KV budget
    return done


def fp8_linear(
    x: torch.Tensor | Fp8Rows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x @ (Wq * scale).T (+ bias) with x quantized per token: [..., in] -> [..., out] in `out_dtype`.

    `weight_scale` is [1, out] fp32 (the layout `_scaled_mm` takes). `Fp8Rows` are used as
    they are."""
    n_out = weight.shape[0]
    q, x_scale, lead = _rows(x)
    if q.shape[0] == 0:
        return torch.empty((*lead, n_out), dtype=out_dtype, device=q.device)
    gemm_dtype = out_dtype if out_dtype != torch.float32 or _fp32_out(q.device) else torch.bfloat16
    fast = {"use_fast_accum": True} if FAST_ACCUM and q.device.type == "cuda" else {}
    out = torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=gemm_dtype, **fast)
    if out.dtype != out_dtype:
        out = out.to(out_dtype)
    if bias is not None:
        out = out + bias
    return out.view(*lead, n_out)


def fp8_skinny_linear(
    x: torch.Tensor | Fp8Rows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    config: SkinnyConfig,
) -> torch.Tensor:
    """`fp8_linear`'s math (bias aside) for a few rows: x quantized per row, then the Triton
    skinny GEMM on the FP8 tensor cores; what the decode graphs run where it beat `_scaled_mm`
    at start (worker_svc.decode_gemms). (Quantizing x inside the GEMM, in each of its programs,
    was slower on an H200: 5.0 ms against 3.4 ms for the 8B shape's batch-1 graph.)"""
    from kernels.triton.skinny_gemm import skinny_gemm

    q, x_scale, lead = _rows(x)
    out = skinny_gemm(q, weight, out_dtype, config, scale=weight_scale[0], x_scale=x_scale)
    return out.view(*lead, weight.shape[0])


def fp8_skinny_silu_and_mul(
    x: torch.Tensor | Fp8Rows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    config: SkinnyConfig,
    quantize: bool,
) -> torch.Tensor | Fp8Rows:
    """SiLU(gate) * up of an FP8 gate | up layer ([2I, K]) for a few rows, by the skinny GEMM
    with SiLU·mul in its epilogue: [M, I] in `out_dtype`, or with `quantize` its per-token FP8
    rows for an FP8 down projection. These are the codes and scales `silu_and_mul_fp8` makes of
    the GEMM's output: the GEMM hands the rows' amax over in parts, so the quantization needs no
    pass of its own to find it (kernels.triton.fp8_quant)."""
    from kernels.triton.skinny_gemm import skinny_gemm

    q, x_scale, lead = _rows(x)
    scale = weight_scale[0]
    if not quantize:
        out = skinny_gemm(q, weight, out_dtype, config, scale=scale, x_scale=x_scale, gated=True)
        return out.view(*lead, out.shape[-1])
    y, parts = skinny_gemm(
        q, weight, out_dtype, config, scale=scale, x_scale=x_scale, gated=True, row_amax=True
    )
    return Fp8Rows(*_quantize_rows(y, parts), out_dtype)


def _rows(x: torch.Tensor | Fp8Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Size]:
    """(q [M, K], scale [M, 1], the leading dims of the output): x quantized per token unless
    it came quantized."""
    if isinstance(x, Fp8Rows):
        return x.q, x.scale, x.q.shape[:-1]
    q, scale = _quantize_rows(x.reshape(-1, x.shape[-1]))
    return q, scale, x.shape[:-1]


def _quantize_rows(
    x: torch.Tensor, partial_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization: the Triton kernel on CUDA (imported on first use: the CPU
    worker never loads Triton), the twin elsewhere. `partial_amax`: the rows' amax in parts,
    which the kernel uses instead of a pass of its own (the twin finds the same amax itself)."""
    if x.device.type != "cuda":
        return reference.quantize_fp8_rows(x)
    global _triton_quantize_rows
    if _triton_quantize_rows is None:
        from kernels.triton.fp8_quant import quantize_fp8_rows

        _triton_quantize_rows = quantize_fp8_rows
    return _triton_quantize_rows(x, partial_amax=partial_amax)


_triton_quantize_rows: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
_SCALED_MM_FP32_OUT: dict[torch.device, bool] = {}


def _fp32_out(device: torch.device) -> bool:
    """Whether `_scaled_mm` with rowwise scales writes fp32 on this device (probed once, outside
    any graph capture; the CPU's does)."""
    known = _SCALED_MM_FP32_OUT.get(device)
    if known is not None:
        return known
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    ones = torch.ones(16, 1, device=device)
    try:
        ok = torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=ones.t(), out_dtype=torch.float32).dtype == (
            torch.float32
        )
    except (RuntimeError, TypeError, NotImplementedError):
        ok = False
    _SCALED_MM_FP32_OUT[device] = ok
    return ok
