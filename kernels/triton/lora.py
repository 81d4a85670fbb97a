"""Batched LoRA for a batch that mixes adapters: shrink (x @ A[slot].T) and expand (+= y @ B[slot].T).

Twins: `kernels.lora_reference.lora_shrink` / `lora_expand` (the layout is described there).

Punica / S-LoRA's SGMV, as vLLM's Triton LoRA kernels do it: the rows that use an adapter are
listed sorted by slot (`perm`, with `starts[s]` the first of slot s), and each program gathers
its rows of x by `perm`, so one launch serves every adapter and base rows cost nothing. Grids
are sized by a bound on the rows (no host read of the counts), so a CUDA graph may replay them
with other counts; programs past the rows return at once.

* shrink: program (s, m-block of slot s's rows, n-block of R x split) walks K in BLOCK_K tiles;
  with SPLIT_K > 1 the K range is split among programs (a decode batch has few rows per
  adapter and R is small, so K is where the parallelism is), each writing its partial sum to
  its own plane of y [SPLIT_K, T, R]: no atomics and no zeroed buffer, and the sum is the same
  every run. The slot axis gives each adapter its own programs: A is the bulk of the bytes.
* expand: program (m-block of `perm`, segment x n-block) holds BLOCK_M consecutive entries of
  `perm` whatever their slots: it sums their rank columns over the planes once, then for each
  slot among them multiplies those rows (the others masked to zero) by B[s]'s rows of its
  segment, and adds the whole tile into `out` once. So the grid has no slot axis: a decode
  batch is one m-block, and no program is launched only to find no rows of its slot (the
  expand's output is wide: a slot axis made most of its programs empty). Every (row, column)
  of `out` belongs to one program, and its sum is the twin's (masked rows add exact zeros).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit, is_interpreted


@dual_jit(do_not_specialize=["K"])
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    perm_ptr,
    starts_ptr,
    N,
    K,
    stride_xm,
    stride_as,
    stride_an,
    stride_yk,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    s = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2) // SPLIT_K
    pid_k = tl.program_id(2) % SPLIT_K
    lo = tl.load(starts_ptr + s)
    hi = tl.load(starts_ptr + s + 1)
    first = lo + pid_m * BLOCK_M
    if first >= hi:
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    m_mask = offs_m < hi
    rows = tl.load(perm_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None] * stride_xm
    a_rows = a_ptr + s.to(tl.int64) * stride_as + offs_n.to(tl.int64)[:, None] * stride_an
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        ks = k0 + offs_k
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_FP32:  # the interpreter's dot reads 16-bit floats as garbage: exact fp32 instead
            acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x.to(a.dtype), tl.trans(a))
    y = y_ptr + pid_k.to(tl.int64) * stride_yk + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc, mask=m_mask[:, None] & n_mask[None, :])


@dual_jit
def _lora_expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    perm_ptr,
    starts_ptr,
    seg_starts_ptr,
    R,
    stride_yk,
    stride_ym,
    stride_bs,
    stride_bn,
    stride_om,
    NUM_SLOTS: tl.constexpr,
    PLANES: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = tl.program_id(1) // N_BLOCKS
    pid_n = tl.program_id(1) % N_BLOCKS
    total = tl.load(starts_ptr + NUM_SLOTS)  # rows that use an adapter
    first = pid_m * BLOCK_M
    n_lo = tl.load(seg_starts_ptr + seg)
    n_hi = tl.load(seg_starts_ptr + seg + 1)
    if (first >= total) | (n_lo + pid_n * BLOCK_N >= n_hi):
        return
    offs_m = first + tl.arange(0, BLOCK_M)  # positions in perm
    m_mask = offs_m < total
    rows = tl.load(perm_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = n_lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_hi
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    y_rows = y_ptr + rows[:, None] * stride_ym + (seg * R + offs_r)[None, :]
    y_mask = m_mask[:, None] & r_mask[None, :]
    y = tl.load(y_rows, mask=y_mask, other=0.0)
    for p in range(1, PLANES):  # the shrink's split-K partial sums, in a fixed order
        y += tl.load(y_rows + p * stride_yk, mask=y_mask, other=0.0)
    b_cols = offs_n.to(tl.int64)[:, None] * stride_bn + offs_r[None, :]
    b_mask = n_mask[:, None] & r_mask[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    last = first + BLOCK_M
    for s in range(NUM_SLOTS):
        lo = tl.load(starts_ptr + s)
        hi = tl.load(starts_ptr + s + 1)
        if (lo < last) & (hi > first) & (lo < hi):  # slot s has rows in this block
            b = tl.load(b_ptr + s * stride_bs + b_cols, mask=b_mask, other=0.0)
            sel = (offs_m >= lo) & (offs_m < hi)
            # as the twin: the shrink's fp32 sum is rounded to B's dtype once; rows of other
            # slots are exact zeros, so they add nothing
            ys = tl.where(sel[:, None], y, 0.0).to(b.dtype)
            if DOT_FP32:
                acc += tl.dot(ys.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(ys, tl.trans(b))
    out = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    old = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (old.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


# Decode-sized batches (at most this many adapter rows): the shrink splits K finer and the
# expand takes smaller tiles, for more programs over the SMs (rows are too few to spread work).
DECODE_ROWS = 128


def shrink_planes(k: int, max_rows: int, interpreted: bool = False) -> int:
    """The shrink's split-K partial sums (y's planes) for K and a bound on a slot's rows.

    Decode batches have few rows per adapter, so K is where the programs come from. H200, 8B
    shapes, 64 rows over 8 adapters: alone, 32 planes (~128 K a program) took a shrink from
    5-12 us to 3-7 us, and the expand pays ~1 us more to sum 32 planes rather than 8; with the
    shrink beside the base GEMM (`worker_svc.lora.layer`), 16 planes gave the fastest decode
    graph (LoRA's cost a step: 16 planes 1154 us, 32: 1322, 8: 1235). Prefill has rows to
    spread: 8 at most.
    """
    if interpreted:
        return 1
    if max_rows <= DECODE_ROWS:
        return max(1, min(16, k // 256))
    return max(1, min(8, k // 512))


def shrink_output(x: torch.Tensor, a: torch.Tensor, max_rows: int | None = None) -> torch.Tensor:
    """An empty y for `lora_shrink(x, a, ..., max_rows, y=...)`: [planes, T, R] fp32."""
    t, k = x.shape
    planes = shrink_planes(k, t if max_rows is None else max_rows, is_interpreted(x.device))
    return torch.empty((planes, t, a.shape[1]), dtype=torch.float32, device=x.device)


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    perm: torch.Tensor,
    starts: torch.Tensor,
    max_rows: int | None = None,
    split_k: int | None = None,
    y: torch.Tensor | None = None,
    block_k: int | None = None,
    block_m: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """y [P, T, R] fp32: P partial sums (split K) of x[row] @ A[slot(row)].T on the adapters' rows
    (base rows: unspecified); `lora_expand` sums the planes.

    `max_rows`: a bound on the rows of any one slot (default: all rows); it sizes the grid.
    `split_k`: programs sharing each K range (default: `shrink_planes`); `y`: the output
    to write (its planes are the split), e.g. allocated on another stream's behalf.
    """
    t, k = x.shape
    num_slots, n, _ = a.shape
    assert a.stride(-1) == 1 and x.stride(-1) == 1
    interpreted = is_interpreted(x.device)
    max_rows = t if max_rows is None else max_rows
    block_m = block_m or (16 if max_rows <= 16 else 32)
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    if y is None:
        split_k = split_k or shrink_planes(k, max_rows, interpreted)
        # Base rows of y are never read by the expand: left unwritten.
        y = torch.empty((split_k, t, n), dtype=torch.float32, device=x.device)
    split_k = y.shape[0]
    assert tuple(y.shape) == (split_k, t, n) and y.stride(2) == 1
    if t == 0:
        return y
    grid = (num_slots, triton.cdiv(max_rows, block_m), triton.cdiv(n, block_n) * split_k)
    _lora_shrink_kernel[grid](
        x, a, y, perm, starts, n, k,
        x.stride(0), a.stride(0), a.stride(1), y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k or (64 if interpreted else 128),
        SPLIT_K=split_k, DOT_FP32=interpreted or a.dtype == torch.float32,
        **({} if interpreted else {"num_warps": num_warps}),
    )  # fmt: skip
    return y


def lora_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    perm: torch.Tensor,
    starts: torch.Tensor,
    seg_starts: torch.Tensor,
    max_rows: int | None = None,
    max_seg_n: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """out[row, seg j] += y[:, row, j's rank columns].sum(0) @ B[slot(row), seg j].T, in place;
    returns out. `y`: `lora_shrink`'s [P, T, R] planes.

    `seg_starts`: int32 [num_segments + 1] output offsets; `max_seg_n`: the widest segment
    (default: all of N); `max_rows`: a bound on the rows that use an adapter (default: all
    rows), it sizes the grid.
    """
    planes, t = y.shape[0], y.shape[1]
    num_slots, n, r = b.shape
    num_segs = seg_starts.shape[0] - 1
    assert b.stride(-1) == 1 and out.stride(-1) == 1 and out.shape[0] == t
    assert starts.shape[0] == num_slots + 1
    if t == 0:
        return out
    interpreted = is_interpreted(y.device)
    max_rows = t if max_rows is None else max_rows
    # Decode (H200, 8B shapes, 64 rows): 16 x 64 tiles beat larger ones (more programs, each
    # with a slot or two of rows); prefill's many rows read B less often with 64 x 128.
    decode = max_rows <= DECODE_ROWS
    block_m = block_m or (16 if decode else 64)
    block_n = block_n or (64 if decode or interpreted else 128)
    n_blocks = triton.cdiv(max_seg_n or n, block_n)
    grid = (triton.cdiv(max_rows, block_m), num_segs * n_blocks)
    _lora_expand_kernel[grid](
        y, b, out, perm, starts, seg_starts, r,
        y.stride(0), y.stride(1), b.stride(0), b.stride(1), out.stride(0),
        NUM_SLOTS=num_slots, PLANES=planes, N_BLOCKS=n_blocks, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(r)),
        DOT_FP32=interpreted or b.dtype == torch.float32,
        **({} if interpreted else {"num_warps": num_warps or 4}),
    )  # fmt: skip
    return out
