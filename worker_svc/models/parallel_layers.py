"""Linear and embedding layers split across tensor-parallel ranks (Megatron's scheme, as in vLLM).

* column-parallel (`QKVParallelLinear`, `MergedColumnParallelLinear`): each rank holds a
  slice of the output rows; no communication, the outputs stay split (by heads / by MLP
  columns) into the next layer;
* row-parallel (`RowParallelLinear`: o_proj, down_proj): each rank holds the matching slice
  of the input columns; the partial products are summed in fp32 by one all-reduce, then the
  bias (once, not once per rank); the fp32 sum goes on to the residual norm, which rounds it
  (at size 1 too, so that every size rounds the residual stream alike);
* vocab-parallel (`VocabParallelEmbedding`, `ParallelLMHead`): each rank holds a run of the
  vocabulary, padded to a multiple of the size; an embedding lookup is masked to the rank's
  run and all-reduced; the logits are gathered to rank 0, which alone samples.

Merged layers are made of segments along the split dim (q | k | v, gate | up): a rank's
slice is its part of every segment, in order, so that the local output still splits into
its local q, k and v (or gate and up). Each layer loads its own slice from a full
checkpoint tensor (`load_segment`, reading only that slice from a lazy safetensors slice)
and cuts its slice from a full-size parameter (`shard_full`, for dummy weights that must
equal size 1's). At size 1 every layer is a plain linear / embedding with the same
parameter names, so checkpoints, tests and CUDA graphs see no difference.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.models.fp8 import Fp8Rows, fp8_linear, fp8_skinny_linear, fp8_skinny_silu_and_mul
from worker_svc.parallel import TensorParallel

if TYPE_CHECKING:
    from kernels.triton.skinny_gemm import SkinnyConfig


def _shape(src: Any) -> tuple[int, ...]:
    """The shape of a tensor or of a lazy safetensors slice (`get_shape()`)."""
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def _rows(src: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """`src[start:start+length]` along `dim` (0 or 1); a lazy slice reads only those bytes."""
    if dim == 0:
        return src[start : start + length]
    return src[:, start : start + length]


SKINNY_MAX_ROWS = 16  # the skinny GEMM pads rows to 16 for the tensor cores: above, cuBLAS...
# ...except where an FP8 layer's start-time timing chose a second config for the decode graphs of
# SKINNY_MAX_ROWS + 1 to SKINNY_WIDE_ROWS rows (`ShardedLinear.decode_gemm_wide`)
SKINNY_WIDE_ROWS = 64
# The MLP's SiLU·mul in the gate|up skinny GEMM's epilogue (`decode_silu_and_mul`); 0: its own
# kernel, as before (read at import).
GATED_GEMM = os.environ.get("LLMESH_GATED_GEMM", "1") != "0"
# A decoder layer's residual RMSNorms folded into the skinny GEMMs around them (`decode_normed`,
# `RowParallelLinear.decode_add_to`); 0: the norm kernels, as before (read at import).
NORM_IN_GEMM = os.environ.get("LLMESH_NORM_IN_GEMM", "1") != "0"


class _DecodeGraphScope(threading.local):
    active = False


_DECODE_GRAPH = _DecodeGraphScope()


@contextlib.contextmanager
def decode_graph_gemms() -> Iterator[None]:
    """While a decode graph warms up and is captured (on this thread), linear layers of few
    rows run the skinny GEMMs chosen for them; the graph replays those kernels thereafter."""
    before = _DECODE_GRAPH.active
    _DECODE_GRAPH.active = True
    try:
        yield
    finally:
        _DECODE_GRAPH.active = before


class LoRAHook(Protocol):
    """A layer's LoRA (worker_svc.lora.layer.LoRALayer): `before(x)` ahead of the GEMM (it may
    start work that reads only x, beside the GEMM), then `(x, out)` adds the delta to `out`."""

    def before(self, x: torch.Tensor) -> None: ...

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...


class ShardedLinear(nn.Module):
    """A linear layer whose weight is split along `dim` (0: output rows, 1: input columns)
    into segments of full sizes `segments`; this rank holds 1/size of each."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TensorParallel,
        dim: int,
        segments: dict[str, int],
    ) -> None:
        super().__init__()
        self.tp = tp
        self.dim = dim
        self.segments = segments  # name -> full size along `dim`, in order
        self.full_in, self.full_out = in_features, out_features
        local = {name: tp.shard(n, f"{name} size") for name, n in segments.items()}
        self.local_segments = local
        out_local = sum(local.values()) if dim == 0 else out_features
        in_local = in_features if dim == 0 else sum(local.values())
        self.weight = nn.Parameter(torch.empty(out_local, in_local))
        # A row-parallel bias is not split: it is added once, after the all-reduce.
        self.bias = nn.Parameter(torch.empty(out_local)) if bias else None
        # The Triton skinny GEMM configs chosen for this shape at start (worker_svc.decode_gemms),
        # used inside decode graphs: up to SKINNY_MAX_ROWS rows, and (FP8 layers) up to
        # SKINNY_WIDE_ROWS; None: the library (cuBLAS, `_scaled_mm`) for those rows.
        self.decode_gemm: SkinnyConfig | None = None
        self.decode_gemm_wide: SkinnyConfig | None = None
        # LoRA adapters (worker_svc.lora.layer.LoRALayer, set when the worker serves them): adds
        # each adapter row's low-rank product to this rank's GEMM output. None: nothing to add.
        self.lora: LoRAHook | None = None
        # FP8 weights (worker_svc.models.fp8): the weight is float8_e4m3fn and this holds its
        # per-output-channel scales, [1, out] fp32; None: the weight is used as it is.
        self.weight_scale: torch.Tensor | None
        self.register_buffer("weight_scale", None, persistent=False)

    def set_fp8_weight(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Replace the weight by its FP8 quantization (`scale`: [out] fp32)."""
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = scale.reshape(1, -1).contiguous()

    def takes_fp8_rows(self) -> bool:
        """Whether `forward` takes `Fp8Rows` (FP8 weights and no LoRA, whose delta needs the
        unquantized rows): then the kernel before it quantizes its output for it."""
        return self.weight_scale is not None and self.lora is None

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        if self.lora is None:
            return self._gemm(x, self.bias)
        self.lora.before(x)
        return self.lora(x, self._gemm(x, self.bias))

    def out_fp32(self) -> bool:
        """Whether `forward` returns fp32 above bf16/fp16 weights (it then rounds nothing)."""
        return False

    def _gemm(
        self, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None, fp32_out: bool = False
    ) -> torch.Tensor:
        """x @ W.T + bias, in fp32 with `fp32_out`, else in x's dtype.

        Inside a decode graph's warm-up and capture (`decode_graph_gemms`) a batch of a few rows
        goes through the skinny GEMM chosen for this shape and that many rows; everywhere else,
        the library. Launched eagerly, a Triton kernel costs more host time than cuBLAS, and
        eager small batches are bound by the host."""
        cfg = self._decode_graph_config(x)
        if cfg is not None:
            from kernels.triton.skinny_gemm import skinny_gemm

            if self.weight_scale is not None:
                out_dtype = torch.float32 if fp32_out else x.dtype
                out = fp8_skinny_linear(x, self.weight, self.weight_scale, out_dtype, cfg)
            else:
                assert isinstance(x, torch.Tensor)
                out = skinny_gemm(x, self.weight, torch.float32 if fp32_out else None, cfg)
            return out if bias is None else out + bias
        if self.weight_scale is not None:
            out_dtype = torch.float32 if fp32_out else x.dtype
            return fp8_linear(x, self.weight, self.weight_scale, bias, out_dtype)
        assert isinstance(x, torch.Tensor), "Fp8Rows reached a layer without FP8 weights"
        if fp32_out:
            out = linear_fp32_out(x, self.weight)
            return out if bias is None else out + bias
        return F.linear(x, self.weight, bias)

    def _decode_graph_config(self, x: torch.Tensor | Fp8Rows) -> SkinnyConfig | None:
        """The skinny GEMM config for x's rows inside a decode graph's scope; None outside it
        or where the library serves that many rows."""
        if not _DECODE_GRAPH.active:
            return None
        rows = x.shape[0] if isinstance(x, Fp8Rows) else x.numel() // max(x.shape[-1], 1)
        return self._decode_config(rows)

    def folds_norms(self, x: torch.Tensor | Fp8Rows) -> bool:
        """Whether a residual norm may fold into this layer's GEMM of x's rows: a decode graph's
        skinny GEMM over unquantized weights, at size 1 (the add needs the whole sum), with no
        LoRA (its delta reads the normed rows) and no bias."""
        return (
            NORM_IN_GEMM
            and _DECODE_GRAPH.active
            and isinstance(x, torch.Tensor)
            and self.weight_scale is None
            and self.lora is None
            and self.bias is None
            and self.tp.size == 1
            and self._decode_graph_config(x) is not None
        )

    def decode_normed(
        self, scaled: torch.Tensor, squares: torch.Tensor, eps: float, gated: bool = False
    ) -> torch.Tensor:
        """RMSNorm(h) * g @ W.T from h * g (`scaled`) and the parts of h's squares, as the GEMM
        before wrote them (`RowParallelLinear.decode_add_to`): 1 / rms in the skinny GEMM's
        epilogue (where `folds_norms`). With `gated` (gate|up), SiLU(gate) * up of it."""
        from kernels.triton.skinny_gemm import skinny_gemm

        cfg = self._decode_graph_config(scaled)
        assert cfg is not None and self.folds_norms(scaled), "decode_normed outside a fold"
        return skinny_gemm(scaled, self.weight, None, cfg, gated=gated, norm_parts=squares, eps=eps)

    def _decode_config(self, rows: int) -> SkinnyConfig | None:
        if rows <= SKINNY_MAX_ROWS:
            return self.decode_gemm
        return self.decode_gemm_wide if rows <= SKINNY_WIDE_ROWS else None

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        if param_name == "weight":
            return (self.full_out, self.full_in)
        return (self.full_out,)

    def _split_dim(self, param_name: str) -> int | None:
        """The dim along which `param_name` is split, or None if every rank holds it whole."""
        if param_name == "weight":
            return self.dim
        return 0 if self.dim == 0 else None

    def load_segment(self, param_name: str, segment: str | None, src: Any) -> None:
        """Copy this rank's slice of the full tensor of one segment (`src`, tensor or lazy slice;
        segment None: the layer's only one)."""
        segment = segment or next(iter(self.segments))
        param = getattr(self, param_name)
        dim = self._split_dim(param_name)
        if dim is None:
            dest, piece = param.data, src if isinstance(src, torch.Tensor) else src[:]
        else:
            full = self.segments[segment]
            local = self.local_segments[segment]
            offset = 0
            for name, n in self.local_segments.items():
                if name == segment:
                    break
                offset += n
            expected = list(param.shape)
            expected[dim] = full
            if list(_shape(src)) != expected:
                raise ValueError(f"{segment}: checkpoint shape {_shape(src)} != {tuple(expected)}")
            dest = param.data.narrow(dim, offset, local)
            piece = _rows(src, dim, self.tp.rank * local, local)
        if tuple(piece.shape) != tuple(dest.shape):
            raise ValueError(f"{segment}: checkpoint shape {tuple(piece.shape)} != {tuple(dest.shape)}")
        dest.copy_(piece)

    def shard_full(self, param_name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-size parameter (segments cut apart, sliced, rejoined)."""
        dim = self._split_dim(param_name)
        if dim is None or self.tp.size == 1:
            return full
        pieces = []
        start = 0
        for name, n in self.segments.items():
            local = self.local_segments[name]
            pieces.append(full.narrow(dim, start + self.tp.rank * local, local))
            start += n
        return torch.cat(pieces, dim=dim)


class QKVParallelLinear(ShardedLinear):
    """q|k|v projection, each rank holding its query heads and their KV heads."""

    def __init__(self, hidden: int, q_size: int, kv_size: int, bias: bool, tp: TensorParallel) -> None:
        segments = {"q": q_size, "k": kv_size, "v": kv_size}
        super().__init__(hidden, q_size + 2 * kv_size, bias, tp, dim=0, segments=segments)


class MergedColumnParallelLinear(ShardedLinear):
    """gate|up projection, each rank holding its columns of both."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TensorParallel) -> None:
        segments = {"gate": intermediate, "up": intermediate}
        super().__init__(hidden, 2 * intermediate, bias, tp, dim=0, segments=segments)

    def decode_silu_and_mul(
        self, x: torch.Tensor | Fp8Rows, quantize: bool = False
    ) -> torch.Tensor | Fp8Rows | None:
        """SiLU(gate) * up of this layer's output, [..., I] in the model's dtype (with `quantize`
        and FP8 weights: its per-token FP8 rows, for an FP8 down projection), by the skinny GEMM
        with SiLU·mul in its epilogue: inside a decode graph (`decode_graph_gemms`), where a
        skinny GEMM serves these rows. None elsewhere (the library's GEMM, LoRA's delta, a bias,
        LLMESH_GATED_GEMM=0): the caller then runs the GEMM and SiLU·mul's own kernel. The
        result has the bits of that pair (kernels.triton.skinny_gemm)."""
        cfg = self._decode_graph_config(x)
        if cfg is None or self.lora is not None or self.bias is not None or not GATED_GEMM:
            return None
        if self.weight_scale is not None:
            return fp8_skinny_silu_and_mul(x, self.weight, self.weight_scale, x.dtype, cfg, quantize)
        from kernels.triton.skinny_gemm import skinny_gemm

        assert isinstance(x, torch.Tensor)
        return skinny_gemm(x, self.weight, None, cfg, gated=True)


class RowParallelLinear(ShardedLinear):
    """An output projection over split inputs: partial products all-reduced, then the bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias, tp, dim=1, segments={"in": in_features})

    def out_fp32(self) -> bool:
        return self.weight.dtype != torch.float32

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """x @ W.T (+ bias), in fp32 at every size: the (all-reduced) fp32 sum, unrounded.

        The partial products are summed in fp32 and rounded once, as size 1's one GEMM over
        the whole input rounds once. Summing bf16-rounded halves in bf16 rounds three times,
        and over 32 layers that moved an 8B shape's logprobs by up to 0.16 nats against size 1
        (2x H200), more than the bf16 tie rule allows: greedy text parted from size 1's.
        The sum is handed over unrounded: the residual RMSNorm that follows every row-parallel
        projection adds it to the residual stream and rounds once, to the stream's dtype,
        which saves a cast kernel per projection (two a layer) in every decode step.
        Size 1 hands over its GEMM's fp32 output the same way. Rounding it to bf16 first (and
        again in the add) was one more rounding per projection than TP N makes: on the 8B
        shape (H100, TP 2's arithmetic emulated on one GPU: benchmarks/tp_arithmetic.py, 48
        prompts) greedy text stayed equal to TP 2's for 7.5-7.8 tokens on average before a
        near tie parted them, and 2-5 prompts parted at gaps over the tie rule; with one
        rounding at both sizes, 13.5-13.7 tokens and none over the rule. It costs ~0.6 % of a
        batch-1 decode step (cuBLAS writing fp32); prefill moved within its noise.
        """
        if self.lora is not None:
            self.lora.before(x)
        if self.tp.size == 1 and not self.out_fp32():
            out = self._gemm(x, self.bias)  # fp32 weights: nothing to widen, keep the fused bias
            return out if self.lora is None else self.lora(x, out)
        out = self._gemm(x, None, fp32_out=True)
        if self.lora is not None:  # this rank's part of the delta, summed by the all-reduce
            out = self.lora(x, out)
        if self.tp.size > 1:
            out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def decode_add_to(
        self, x: torch.Tensor, stream: torch.Tensor, norm_weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(h, h * g, squares): h = stream + x @ W.T, summed in fp32 and rounded once to the
        stream's dtype, the residual norm's add in the skinny GEMM's epilogue (where
        `folds_norms`), the same bits as `forward` then the norm kernel's add. With the next
        norm's weight g, also h * g and the parts of h's squares for `decode_normed`; else
        (None, None)."""
        from kernels.triton.skinny_gemm import skinny_gemm

        cfg = self._decode_graph_config(x)
        assert cfg is not None and self.folds_norms(x), "decode_add_to outside a fold"
        if norm_weight is None:
            return skinny_gemm(x, self.weight, None, cfg, residual=stream), None, None  # type: ignore[return-value]
        return skinny_gemm(x, self.weight, None, cfg, residual=stream, norm_weight=norm_weight)  # type: ignore[return-value]


_MM_FP32_OUT: dict[torch.device, bool] = {}  # per device: does torch.mm take out_dtype=float32?


def linear_fp32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T accumulated and returned in fp32 (one GEMM: no bf16 rounding of the result)."""
    if x.dtype == torch.float32:
        return F.linear(x, weight)
    if _mm_fp32_out(x.device):
        flat = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        return flat.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight).float()


def _mm_fp32_out(device: torch.device) -> bool:
    """Probed once per device, outside any graph capture (a capture cannot try and fail)."""
    known = _MM_FP32_OUT.get(device)
    if known is not None:
        return known
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return False
    try:
        a = torch.ones(2, 16, dtype=torch.bfloat16, device=device)
        ok = torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        ok = False
    _MM_FP32_OUT[device] = ok
    return ok


class VocabParallelEmbedding(nn.Module):
    """The token embedding, each rank holding a run of `per_rank` rows (the vocabulary padded
    to a multiple of the size; padding rows are never looked up)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden = hidden
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden))
        # As the logits' projection (an lm_head, or a tied model's embedding): the skinny GEMM
        # config chosen for this shape at start (worker_svc.decode_gemms) for logits of up to
        # SKINNY_MAX_ROWS rows; None: cuBLAS.
        self.decode_gemm: SkinnyConfig | None = None

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        return (self.vocab_size, self.hidden)

    def _valid_rows(self) -> int:
        """Rows of this rank's run that are real tokens (the last rank's run may be padded)."""
        return max(0, min(self.per_rank, self.vocab_size - self.start))

    def load_segment(self, param_name: str, segment: str | None, src: Any) -> None:
        if list(_shape(src)) != [self.vocab_size, self.hidden]:
            raise ValueError(f"checkpoint shape {_shape(src)} != {(self.vocab_size, self.hidden)}")
        n = self._valid_rows()
        self.weight.data[n:].zero_()
        if n:
            self.weight.data[:n].copy_(_rows(src, 0, self.start, n))

    def shard_full(self, param_name: str, full: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return full
        n = self._valid_rows()
        out = full.new_zeros(self.per_rank, self.hidden)
        out[:n] = full[self.start : self.start + n]
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over the vocabulary, split like the embedding (a tied model has
    no separate head: its embedding's split matrix serves both)."""


def vocab_parallel_logits(hidden: torch.Tensor, head: VocabParallelEmbedding) -> torch.Tensor | None:
    """Logits [N, vocab] in the head's dtype on rank 0, None on the others: each rank's run of
    the vocabulary, gathered (gathering to one rank moves 1/N of what an all-gather would). The
    sampler takes its own fp32 copy where it processes or samples them (`Sampler._prepare`)."""
    n = hidden.shape[0]
    rows = logits_rows(n)
    if rows != n:
        hidden = F.pad(hidden, (0, 0, 0, rows - n))
    # A decode step's few rows only stream the head's matrix (1 GB for Llama 3's 128k vocabulary
    # in bf16): the skinny GEMM chosen for it at start, launched eagerly (the step's graph is
    # still running when the host gets here, so its launch cost is hidden).
    cfg = head.decode_gemm
    if cfg is not None and rows <= SKINNY_MAX_ROWS:
        from kernels.triton.skinny_gemm import skinny_gemm

        local = skinny_gemm(hidden, head.weight, None, cfg)
    else:
        local = F.linear(hidden, head.weight)
    full = head.tp.gather_last_dim(local)
    if full is None:
        return None
    return full[:n, : head.vocab_size]


def logits_rows(n: int) -> int:
    """The row count the lm_head computes for `n` wanted rows: powers of two up to 64, then
    multiples of 64.

    The first GEMM of a new shape can cost milliseconds of host time (cuBLAS choosing an
    algorithm: 3-5 ms for 11 of 60 new row counts on the H100), and a decode batch shrinks one
    finished sequence at a time: unpadded, a long run meets every row count from its largest
    batch down to 1. The padding is free where the GEMM only streams the weights (up to a few
    hundred rows)."""
    if n <= 64:
        return 1 << (n - 1).bit_length() if n else 0
    return -(-n // 64) * 64
