"""Kernels that read or write page-locked host memory directly (twins in `kernels.reference`).

A decode step moves a few hundred bytes each way between the host and the GPU: its inputs
(token ids, positions, slots, context lengths, block tables) before its forward, the sampled
ids after. Through the copy engine each small copy held an H100's stream for ~5-10 us (the
engine's own start, then the stream's switch back to kernels), and the inputs then needed four
more kernels to reach the decode graph's static buffers (three copies and the patch of ids still
on the device). Page-locked memory is mapped into the GPU's address space (unified addressing),
so a kernel can load and store it over PCIe like global memory: here one kernel places a step's
inputs where the graph reads them, and one stores a step's int32 results into host memory.

The caller keeps a host buffer untouched until the kernel that reads or writes it has run (an
event recorded after the launch; `worker_svc.pinned_slots`). Under the interpreter (CPU tensors)
the same kernels run on ordinary host tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit, is_interpreted
from kernels.triton.pdl import gdc_launch_dependents, gdc_wait

_BLOCK = 1024  # elements a program moves in one pass


class _HostPointer:
    """A page-locked host tensor as a kernel argument on CUDA. Triton launches a kernel with
    the first tensor argument's device, and reaches the tensor's memory through its (mapped)
    address; this hides the tensor from the first, and hands over the second."""

    def __init__(self, t: torch.Tensor) -> None:
        assert t.is_pinned(), "a kernel reaches only page-locked host memory"
        self.tensor = t
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


def _host_arg(t: torch.Tensor, device: torch.device) -> Any:
    return t if is_interpreted(device) else _HostPointer(t)


@dual_jit()
def _fill_decode_inputs_kernel(
    i64_ptr,  # [3, stride_i64] int64 on the device: ids, positions, slots
    lens_ptr,  # [>= b] int32 on the device
    tables_ptr,  # [>= b, stride_table] int32 on the device
    sampled_ptr,  # int32 / int64 on the device: the ids a step still running sampled
    src_i64_ptr,  # [3, rows] int64, host
    src_i32_ptr,  # [b + b * w] int32, host: lengths, then the [b, w] table
    moves_ptr,  # [2, n_patch] int64, host: rows of ids to overwrite, rows of sampled to take
    stride_i64,
    stride_table,
    rows,
    b,
    w,
    n_patch,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid == 0:  # the small arrays, then the patch over the ids it wrote
        for r in range(3):
            for c0 in range(0, rows, BLOCK):
                offs = c0 + tl.arange(0, BLOCK)
                m = offs < rows
                v = tl.load(src_i64_ptr + r * rows + offs, mask=m)
                tl.store(i64_ptr + r * stride_i64 + offs, v, mask=m)
        for c0 in range(0, b, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            m = offs < b
            tl.store(lens_ptr + offs, tl.load(src_i32_ptr + offs, mask=m), mask=m)
        # Every thread's stores to the ids above are visible to the whole program past the
        # barrier, so a patched row ends with the patch's id whichever thread wrote it first.
        tl.debug_barrier()
        for c0 in range(0, n_patch, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            m = offs < n_patch
            at = tl.load(moves_ptr + offs, mask=m, other=0)
            src = tl.load(moves_ptr + n_patch + offs, mask=m, other=0)
            ids = tl.load(sampled_ptr + src, mask=m, other=0).to(tl.int64)
            tl.store(i64_ptr + at, ids, mask=m)
    else:  # the block table, BLOCK entries a program
        offs = (pid - 1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < b * w
        v = tl.load(src_i32_ptr + b + offs, mask=m)
        row = offs // w
        tl.store(tables_ptr + row.to(tl.int64) * stride_table + (offs - row * w), v, mask=m)


def fill_decode_inputs(
    i64: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    src_i64: torch.Tensor,
    src_i32: torch.Tensor,
    b: int,
    w: int,
    patch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One step's inputs from host memory into a decode graph's static buffers, in one launch.

    i64 [3, >= rows] (ids, positions, slots), seq_lens [>= b], block_tables [>= b, >= w]: the
    device buffers (contiguous rows). src_i64 [3, rows] int64 and src_i32 [b + b * w] int32
    (the lengths, then the [b, w] table, row by row): page-locked host tensors on CUDA.
    Writes i64[:, :rows], seq_lens[:b] and block_tables[:b, :w]; then, for `patch` = (moves
    [2, n] int64 on the host like the sources, sampled [m] int32 / int64 on the device: ids a
    step still running sampled), i64[0][moves[0, j]] = sampled[moves[1, j]].
    """
    rows = src_i64.shape[1]
    assert src_i64.shape == (3, rows) and src_i64.dtype == torch.int64 and src_i64.is_contiguous()
    assert src_i32.shape == (b + b * w,) and src_i32.dtype == torch.int32 and src_i32.is_contiguous()
    assert i64.dtype == torch.int64 and i64.shape[0] == 3 and i64.shape[1] >= rows and i64.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.shape[0] >= b and seq_lens.stride(0) == 1
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert block_tables.shape[0] >= b and block_tables.shape[1] >= w
    device = i64.device
    if patch is None:
        moves, sampled, n_patch = src_i64, seq_lens, 0  # any pointers when unused
    else:
        moves, sampled = patch
        assert (
            moves.dtype == torch.int64 and moves.dim() == 2 and moves.shape[0] == 2 and moves.is_contiguous()
        )
        assert sampled.dtype in (torch.int32, torch.int64) and sampled.stride(0) == 1, sampled.dtype
        n_patch = moves.shape[1]
    _fill_decode_inputs_kernel[(1 + triton.cdiv(b * w, _BLOCK),)](
        i64,
        seq_lens,
        block_tables,
        sampled,
        _host_arg(src_i64, device),
        _host_arg(src_i32, device),
        _host_arg(moves, device),
        i64.stride(0),
        block_tables.stride(0),
        rows,
        b,
        w,
        n_patch,
        BLOCK=_BLOCK,
        num_warps=4,
    )


@dual_jit(pdl=True)
def _copy_to_host_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # src is the grid before's (see kernels.triton.pdl_enabled)
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=m).to(tl.int32), mask=m)


def copy_to_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[:] = src as int32: src [n] int32 / int64 on the device, dst [n] int32 page-locked
    on the host (on CUDA). Stores land over PCIe as the kernel runs; an event recorded after
    the launch marks them complete."""
    assert src.dim() == 1 and src.stride(0) == 1 and src.dtype in (torch.int32, torch.int64), src.dtype
    assert dst.shape == src.shape and dst.dtype == torch.int32 and dst.is_contiguous(), (dst.shape, dst.dtype)
    n = src.shape[0]
    if n == 0:
        return
    _copy_to_host_kernel[(triton.cdiv(n, _BLOCK),)](
        src, _host_arg(dst, src.device), n, BLOCK=_BLOCK, num_warps=4
    )
