"""y = x @ W.T for a few rows of x: the decode steps' GEMMs (twin: `kernels.reference.linear`).

At batch 1-16 a decode GEMM only streams its weight matrix: the work is the matrix's bytes, the
arithmetic is nothing. cuBLAS picks kernels tuned for general shapes; on some decode shapes
(an 8B model's o_proj on an H100 reached half the copy bandwidth) it leaves bandwidth unused.
Here one program owns BLOCK_N output columns for every row of x and walks K in BLOCK_K tiles,
so each weight element is read once, by one program, in contiguous rows (W is [N, K] as
`nn.Linear` stores it). Accumulation is fp32; the output is rounded once to out's dtype (fp32
out keeps the sum unrounded, as the tensor-parallel row-parallel layers want).

Two bodies, one kernel: with DOT the rows are padded to BLOCK_M >= 16 and multiplied on the
tensor cores (padding rows cost no bandwidth); without, BLOCK_M is 1 and the tile is reduced
with a plain multiply and sum (no padding, fewer registers).

Split-K (`split_k` > 1): a shape of few output columns (an 8B o_proj or down: 4,096, so 128
programs of 32 columns on 132 multiprocessors, one each, with each program's loads alone to hide
the memory's latency) gets SPLIT_K programs per column block, each over a run of K. They write
their fp32 partial sums to planes of a workspace and count themselves in on a per-block counter;
the last to arrive adds the planes up in plane order (so every run rounds the same way, unlike
atomic adds into the output), applies the scales, writes the output and puts the counter back to
zero for the next call: one launch, no memset. FP8 weights, a byte an element, need twice the
programs (or twice the tiles in flight) of bf16 for the same bytes in flight.

Gated (`gated=True`, an MLP's gate|up weight [2I, K]): out = SiLU(x @ gate.T) * (x @ up.T), [M, I],
with SiLU·mul in the epilogue, so the decode step launches no SiLU·mul kernel (at batch 1 on an
H100 that kernel held the step for ~1.5 us a layer in bf16 and ~5.9 us with its FP8
quantization). A program's BLOCK_N rows of W are BLOCK_N / 2 of gate and the same columns of
up: the tile, and so each column's sum, is the plain GEMM's, and gate and up are rounded to
out's dtype before SiLU·mul as `kernels.triton.silu_mul` reads them: the same bits as the GEMM
then that kernel.

The residual RMSNorms between a decoder layer's GEMMs, folded into them (bf16 decode graphs,
where a norm kernel held the batch-1 step ~2.7 us, twice a layer). RMSNorm(h) * g @ W.T is
1/rms(h) * ((h * g) @ W.T): the row's 1/rms is one factor a row, so it comes out of the sum.
- `residual` (the GEMM before a norm: o_proj, down): the output is h = residual + x @ W.T,
  summed in fp32 and rounded once to the residual's dtype (the bits of the fp32 GEMM then the
  norm kernel's add). With `norm_weight` g the epilogue also writes h * g (rounded to h's
  dtype) for the next GEMM and each row's sum of squares over this program's columns, in
  parts [M, programs]: everything of the norm but 1/rms, which needs the whole row.
- `norm_parts` (the GEMM after it: qkv, gate|up, reading h * g): the epilogue sums the row's
  parts and scales the fp32 sums by 1/rms. The GEMM's body is the plain one.
The rounding differs from the norm kernel's by where bf16 rounds: once, h * g, where the
kernel rounds h / rms, then times g (both are a bf16 rounding of the same product; tests
hold the fold to the chain's tolerance). Normalizing in the GEMM instead, in each of its
programs (h * g and the squares from x's tiles), put x's tiles through registers on their
way to the tensor cores: an 8B qkv GEMM at batch 1 took 31-76 us against 20 on an H100.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit, is_interpreted
from kernels.triton.pdl import L2_PREFETCH_ASM, gdc_launch_dependents, gdc_wait


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True
    split_k: int = 1

    def __str__(self) -> str:
        body = "dot" if self.dot else "sum"
        split = f" split{self.split_k}" if self.split_k > 1 else ""
        return f"{body} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}{split}"


# N and K are fixed per layer (Triton specialising on them lets it prove the K loop needs no
# mask); M varies step to step and the body pads it anyway, so it is not specialised.
@dual_jit(pdl=True, do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    scale_ptr,
    x_scale_ptr,
    ws_ptr,
    count_ptr,
    k_per_split,
    amax_ptr,
    norm_w_ptr,
    residual_ptr,
    stride_rm,
    normed_ptr,
    sq_ptr,
    n_parts,
    eps,
    HAS_SCALE: tl.constexpr,
    HAS_X_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,  # with PDL: W's first lines a row to warm in L2 before the wait
    LINE: tl.constexpr,  # W's elements in a 128-byte line
    GATED: tl.constexpr,  # W is gate | up, N rows: out = SiLU(gate) * up, N // 2 columns
    ROW_AMAX: tl.constexpr,  # GATED: each row's amax over this program's columns to amax_ptr
    NORM_PARTS: tl.constexpr,  # x is h * g: 1 / rms from the squares' parts at sq_ptr ([M, n_parts])
    PARTS_BLOCK: tl.constexpr,  # n_parts, to a power of two
    RESIDUAL: tl.constexpr,  # out = residual + x @ W.T, rounded once to out's dtype
    NORMED_OUT: tl.constexpr,  # RESIDUAL: out * g to normed_ptr, its squares' parts to sq_ptr
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    if GATED:  # this program's BLOCK_N // 2 output columns, of gate (first half) and of up
        tile_rows = tl.arange(0, BLOCK_N)
        cols = pid_n * (BLOCK_N // 2) + tile_rows % (BLOCK_N // 2)
        offs_n = cols + (tile_rows // (BLOCK_N // 2)) * (N // 2)
        n_mask = cols < N // 2
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SPLIT_K > 1:
        k_begin = tl.program_id(1) * k_per_split  # a multiple of BLOCK_K
        k_end = tl.minimum(k_begin + k_per_split, K)
    else:  # the whole of K, whose bounds Triton knows (K is specialised)
        k_begin = 0
        k_end = K
    if PDL:
        if PREFETCH_LINES > 0:
            # The weights are read-only while a step runs, so this program's first tiles of W
            # can stream into L2 while the kernel before it (whose output is x) still runs:
            # the pipeline's fill, ~5 us a GEMM at batch 1, moves under that kernel's tail.
            pf_k = tl.minimum(k_begin + tl.arange(0, PREFETCH_LINES) * LINE, K - 1)
            pf_n = tl.minimum(offs_n, N - 1).to(tl.int64)
            pf = w_ptr + pf_n[:, None] * stride_wn + pf_k[None, :]
            tl.inline_asm_elementwise(L2_PREFETCH_ASM, "=r,l", [pf], dtype=tl.int32, is_pure=False, pack=1)
        gdc_wait()  # x (and split-K's workspace) are the grid before's: see kernels.triton.pdl_enabled
        gdc_launch_dependents()
    # The epilogue's inputs, loaded before the loop so that their latency hides under it.
    if RESIDUAL:
        r_rows = residual_ptr + offs_m.to(tl.int64)[:, None] * stride_rm
        r = tl.load(r_rows + offs_n[None, :], mask=m_mask[:, None] & n_mask[None, :], other=0.0)
    if NORMED_OUT:
        g = tl.load(norm_w_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if NORM_PARTS:  # the row's squares in parts, summed
        offs_p = tl.arange(0, PARTS_BLOCK)
        sq_rows = sq_ptr + offs_m[:, None] * n_parts + offs_p[None, :]
        sq_mask = m_mask[:, None] & (offs_p < n_parts)[None, :]
        sumsq = tl.sum(tl.load(sq_rows, mask=sq_mask, other=0.0), axis=1)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_FP32:  # the interpreter's dot reads 16-bit floats as garbage: exact fp32 instead
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif DOT and HAS_SCALE and not HAS_X_SCALE:  # FP8 W, 16-bit x: W widened
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        elif DOT:  # same dtypes (FP8 x FP8 included: Hopper's FP8 tensor cores)
            acc += tl.dot(x.to(w.dtype), tl.trans(w))
        else:  # BLOCK_M == 1: [1, K] * [N, K] summed over K
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        # This program's partial sums to its plane, [SPLIT_K, BLOCK_M, N]; then the count. The
        # barrier orders every thread's stores before the (acquire-release) atomic, which one
        # thread issues; the planes are read back past L1 (.cg), which is not coherent.
        plane = ws_ptr + tl.program_id(1) * BLOCK_M * N
        ws_offs = offs_m[:, None] * N + offs_n[None, :]
        tl.store(plane + ws_offs, acc, mask=n_mask[None, :])
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1)
        last = (tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32) + arrived) == SPLIT_K - 1
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        part_mask = n_mask[None, :] & last
        for s in range(SPLIT_K):  # in plane order: the same sum whichever program came last
            part = ws_ptr + s * BLOCK_M * N + ws_offs
            acc += tl.load(part, mask=part_mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + pid_n, 0, mask=arrived == SPLIT_K - 1)  # ready for the next call
        out_mask = out_mask & last  # only the last program writes
    # The rows this program writes: all of them, or under split-K only the last program's.
    rows_written = m_mask
    if SPLIT_K > 1:
        rows_written = rows_written & ((tl.zeros((BLOCK_M,), dtype=tl.int32) + arrived) == SPLIT_K - 1)
    if NORM_PARTS:  # the row's 1 / rms, over all of K
        acc *= tl.rsqrt(sumsq / K + eps)[:, None]
    if HAS_SCALE:  # the weight's per-output-channel scales, applied once to the fp32 sums
        acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_X_SCALE:  # FP8 rows of x: each row's own scale
        acc *= tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    out_rows = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om
    if GATED:
        # The tile's columns are [gate | up] of the same output columns: split them, round each
        # to out's dtype as the plain GEMM would store it, then `_silu_and_mul_kernel`'s math.
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        odt = out_ptr.dtype.element_ty
        gate = gate.to(odt).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(odt).to(tl.float32)
        y = silu * up.to(odt).to(tl.float32)
        out_cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        y_mask = rows_written[:, None] & (out_cols < N // 2)[None, :]
        y = y.to(odt)
        tl.store(out_rows + out_cols[None, :], y, mask=y_mask)
        if ROW_AMAX:  # [M, programs]: the max of a row's parts is its amax, for the FP8 quantization
            part = tl.max(tl.where(y_mask, tl.abs(y.to(tl.float32)), 0.0), axis=1)
            tl.store(amax_ptr + offs_m * tl.num_programs(0) + pid_n, part, mask=rows_written)
    else:
        if RESIDUAL:  # the norm kernel's add: in fp32, rounded once to the stream's dtype
            acc += r.to(tl.float32)
        y = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_rows + offs_n[None, :], y, mask=out_mask)
        if NORMED_OUT:  # the next norm's share of these columns: h * g, and h's squares
            hf = tl.where(out_mask, y.to(tl.float32), 0.0)
            normed_rows = normed_ptr + offs_m.to(tl.int64)[:, None] * stride_om
            tl.store(normed_rows + offs_n[None, :], (hf * g[None, :]).to(y.dtype), mask=out_mask)
            tl.store(sq_ptr + offs_m * n_parts + pid_n, tl.sum(hf * hf, axis=1), mask=rows_written)


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    config: SkinnyConfig | None = None,
    scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    gated: bool = False,
    row_amax: bool = False,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_parts: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """x [..., K] @ weight[N, K].T -> [..., N] in `out_dtype` (x's by default), fp32 accumulation.

    For few rows (the body pads them to BLOCK_M): meant for M <= 16; any M is computed right.
    `scale` ([N] fp32): FP8 weights' per-output-channel scales (W8A16: x is not quantized, the
    GEMM only streams the weight's bytes, one per element), output column n times scale[n].
    `x_scale` ([M] or [M, 1] fp32): x is FP8 too, quantized per row (W8A8, the FP8 tensor
    cores), output row m times x_scale[m]; `out_dtype` must then be given.
    `gated`: weight is an MLP's gate | up ([2I, K]); returns SiLU(gate) * up, [..., I] (see the
    module doc), in `out_dtype`, which must then be a 16-bit float. With `row_amax` also each
    row's amax in parts, [M, P] fp32 (its max over P is the row's amax(|out|)), for
    `quantize_fp8_rows(out, partial_amax=...)`: returns (out, parts).
    The residual norm folded in (see the module doc):
    `residual` ([..., N], the output's shape): returns h = residual + x @ W.T in the residual's
    dtype (the default `out_dtype`), the fp32 sum rounded once. Not with `gated`. With
    `norm_weight` g ([N]) returns (h, h * g, parts): the next norm's input to its GEMM and the
    squares of h's rows in parts, [M, P] fp32 (their sum over P is the row's sum of squares).
    `norm_parts` ([M, P]): x is such an h * g and these its parts: returns RMSNorm(h) * g @
    W.T (with `eps`), as the norm kernel and the GEMM would, up to where bf16 rounds.
    """
    cfg = config or SkinnyConfig()
    n, k = weight.shape
    n_out = n // 2 if gated else n
    if gated:
        assert n % 2 == 0 and cfg.block_n >= 2, (n, cfg)
        assert (out_dtype or x.dtype) in (torch.bfloat16, torch.float16), "SiLU·mul rounds to a 16-bit dtype"
    assert gated or not row_amax, "row amax parts come with the gated epilogue"
    assert residual is None or not gated, "the residual add is the plain GEMM's epilogue"
    assert norm_weight is None or (residual is not None and norm_weight.shape == (n,)), "h * g needs h"
    assert norm_parts is None or norm_parts.shape[0] == x.numel() // k, (norm_parts.shape, x.shape)
    assert x.shape[-1] == k, (x.shape, weight.shape)
    assert weight.stride(-1) == 1, "the weight's rows must be contiguous"
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    residual_rows = None
    if residual is not None:
        assert residual.shape[-1] == n and residual.numel() == m * n, (residual.shape, x.shape, weight.shape)
        residual_rows = residual.reshape(m, n)
        if residual_rows.stride(-1) != 1:
            residual_rows = residual_rows.contiguous()
        out_dtype = out_dtype or residual.dtype
    out = torch.empty((m, n_out), dtype=out_dtype or x.dtype, device=x.device)
    blocks_n = triton.cdiv(n_out, cfg.block_n // 2) if gated else triton.cdiv(n, cfg.block_n)
    parts = torch.empty((m, blocks_n), dtype=torch.float32, device=x.device) if row_amax else None
    normed = torch.empty_like(out) if norm_weight is not None else None
    squares = torch.empty((m, blocks_n), dtype=torch.float32, device=x.device) if normed is not None else None
    if m == 0:
        return _results(out.reshape(*x.shape[:-1], n_out), parts, normed, squares)
    dot = cfg.dot or m > 1
    block_m = max(16, triton.next_power_of_2(m)) if dot else 1
    split = min(cfg.split_k, triton.cdiv(k, cfg.block_k))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), split) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # no empty run of K
    workspace = _split_k_workspace(x.device, split * block_m * n, blocks_n) if split > 1 else None
    if workspace is None:
        split, k_per_split = 1, k
    ws, counts = workspace if workspace is not None else (out, out)
    _skinny_gemm_kernel[(blocks_n, split)](
        rows,
        weight,
        out,
        m,
        n,
        k,
        rows.stride(0),
        weight.stride(0),
        out.stride(0),
        scale if scale is not None else out,
        x_scale if x_scale is not None else out,
        ws,
        counts,
        k_per_split,
        parts if parts is not None else out,
        norm_weight if norm_weight is not None else out,
        residual_rows if residual_rows is not None else out,
        residual_rows.stride(0) if residual_rows is not None else 0,
        normed if normed is not None else out,
        norm_parts if norm_parts is not None else squares if squares is not None else out,
        norm_parts.shape[1] if norm_parts is not None else blocks_n,
        eps,
        HAS_SCALE=scale is not None,
        HAS_X_SCALE=x_scale is not None,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT=dot,
        DOT_FP32=dot
        and (is_interpreted(x.device) or x.dtype == torch.float32 or weight.dtype == torch.float32),
        SPLIT_K=split,
        PREFETCH_LINES=_prefetch_lines(cfg.block_k, weight.element_size()),
        LINE=128 // weight.element_size(),
        GATED=gated,
        ROW_AMAX=row_amax,
        NORM_PARTS=norm_parts is not None,
        PARTS_BLOCK=triton.next_power_of_2(norm_parts.shape[1]) if norm_parts is not None else 1,
        RESIDUAL=residual is not None,
        NORMED_OUT=normed is not None,
        num_warps=cfg.num_warps,
        num_stages=_fitting_stages(cfg, block_m, rows.element_size(), weight.element_size(), x.device),
    )
    return _results(out.reshape(*x.shape[:-1], n_out), parts, normed, squares)


def _results(
    out: torch.Tensor, parts: torch.Tensor | None, normed: torch.Tensor | None, squares: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    if parts is not None:
        return out, parts
    if normed is not None and squares is not None:
        return out, normed.view(out.shape), squares
    return out


def _fitting_stages(cfg: SkinnyConfig, block_m: int, x_bytes: int, w_bytes: int, device: torch.device) -> int:
    """cfg's pipeline depth, less where its buffers would not fit in a program's shared memory:
    a deep config chosen at batch 1 also serves the decode graphs of up to 64 rows, whose x tiles
    are 4x those of 16. Triton's pipeliner keeps num_stages - 1 buffers of (BLOCK_M + BLOCK_N) x
    BLOCK_K. The depth changes no result, only how many tiles are in flight."""
    if device.type != "cuda":
        return cfg.num_stages
    per_stage = (block_m * x_bytes + cfg.block_n * w_bytes) * cfg.block_k
    return min(cfg.num_stages, max(2, _shared_memory(device) // per_stage + 1))


@functools.cache
def _shared_memory(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


@functools.cache
def _prefetch_lines(block_k: int, element_size: int) -> int:
    """128-byte lines of each W row a program warms in L2 before its wait (PDL launches only):
    LLMESH_PDL_PREFETCH_TILES K tiles (default 2), a power of two, 0 for none."""
    tiles = int(os.environ.get("LLMESH_PDL_PREFETCH_TILES", "2"))
    lines = tiles * block_k * element_size // 128
    return triton.next_power_of_2(lines) if lines > 0 else 0


class _Workspaces:
    """Split-K's partial-sum planes and per-block counters, one set per device, never freed (a
    graph captured with them replays them, on whatever thread). One set serves every GEMM of a
    device because a worker runs its GEMMs one after the other, on its step's stream: split-K
    GEMMs on one device must not run concurrently on two streams."""

    def __init__(self) -> None:
        self.by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.outgrown: list[torch.Tensor] = []  # planes outgrown, kept for the graphs using them
        self.lock = threading.Lock()


_WORKSPACES = _Workspaces()
_COUNTERS = 1 << 16  # column blocks a split-K GEMM may have (N / BLOCK_N)


def _split_k_workspace(
    device: torch.device, plane_floats: int, blocks_n: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(fp32 planes of at least `plane_floats`, int32 counters, all zero), or None where none
    can be made: too many column blocks, or first asked for inside a graph capture (the
    counters must be zeroed by a kernel that runs now, which a capture only records). The
    decode graphs' GEMMs run eagerly (warm-up, decode_gemms' timing) before any capture."""
    if blocks_n > _COUNTERS:
        return None
    have = _WORKSPACES.by_device.get(device)
    if have is not None and have[0].numel() >= plane_floats:
        return have
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if have is None and capturing:
        return None
    with _WORKSPACES.lock:
        have = _WORKSPACES.by_device.get(device)
        if have is not None and have[0].numel() >= plane_floats:
            return have
        # Planes may grow (their contents never outlive a call); the counters, always zero
        # between calls, are kept.
        counts = have[1] if have is not None else torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
        if have is not None:
            _WORKSPACES.outgrown.append(have[0])
        planes = torch.empty(max(plane_floats, 1 << 20), dtype=torch.float32, device=device)
        _WORKSPACES.by_device[device] = (planes, counts)
        return planes, counts
