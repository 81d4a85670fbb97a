"""The KV payload digest as one streaming pass (twin: `kernels.kv_digest.kv_digest_reference`).

`torch._int_mm` reaches only ~490 GB/s on an H100 for this shape (a [rows, 64 KiB] int8 matrix
times a [64 KiB, 16] key: cuBLAS tiles for wide outputs, not 16 lanes). The digest is a read of
the payload and nothing else, so here each program streams BLOCK_M rows once, BLOCK_K bytes at a
time, through int8 tensor-core dots against the key's matching slice (1 MiB in all, L2-resident),
accumulating int32 exactly as the twin does in float64. Rows of different chunks never mix, so a
whole load's chunks are one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import dual_jit

BLOCK_M = 64
BLOCK_K = 256


@dual_jit
def _kv_digest_kernel(
    a_ptr,
    k_ptr,
    out_ptr,
    n_rows,
    ROW: tl.constexpr,
    LANES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    lanes = tl.arange(0, LANES)
    row_ok = rows[:, None] < n_rows
    base = a_ptr + rows[:, None].to(tl.int64) * ROW
    acc = tl.zeros((BLOCK_M, LANES), dtype=tl.int32)
    for k0 in range(0, ROW, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(base + cols[None, :], mask=row_ok, other=0)
        k = tl.load(k_ptr + cols[:, None] * LANES + lanes[None, :])
        acc += tl.dot(a, k, out_dtype=tl.int32)
    tl.store(out_ptr + rows[:, None] * LANES + lanes[None, :], acc, mask=row_ok)


def kv_digest_rows(rows: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """[n, ROW] int8 rows @ [ROW, LANES] int8 key -> [n, LANES] int32 (exact)."""
    n, row = rows.shape
    lanes = key.shape[1]
    assert rows.dtype == key.dtype == torch.int8 and key.shape[0] == row and rows.is_contiguous()
    out = torch.empty((n, lanes), dtype=torch.int32, device=rows.device)
    if n:
        grid = (triton.cdiv(n, BLOCK_M),)
        _kv_digest_kernel[grid](
            rows, key.contiguous(), out, n, ROW=row, LANES=lanes, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K
        )
    return out
