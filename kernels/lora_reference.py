"""Plain-PyTorch twins of the batched LoRA kernels (`kernels.triton.lora`), for CPU runs and tests.

A batch mixes rows (tokens) of several adapters and of the base model. Each adapter sits in a
slot s of stacked matrices: A [S, R, K] (rank R, input K) and B [S, N, R] (output N); a row
of slot s gains `(x @ A[s].T) @ B[s].T` (punica / S-LoRA's shrink then expand). The adapter's
scale (lora_alpha / r) is folded into B when it is loaded, so neither step scales.

Which rows use which slot travels as two small int32 tensors (`worker_svc.lora.batch`):
`perm` lists the rows that use an adapter, sorted by slot, and rows perm[starts[s]:starts[s+1]]
use slot s. Base rows (slot -1) appear in neither: they get no work at all.

Merged layers (q|k|v, gate|up) hold one A per segment stacked along R (segment j's rank
columns are j*R_seg .. (j+1)*R_seg of the shrink output), and one B whose output rows
seg_starts[j] .. seg_starts[j+1] read only segment j's rank columns.
"""

from __future__ import annotations

import torch


def lora_rows(perm: torch.Tensor, starts: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """[(slot, its rows)] for the slots that have rows (host reads: a twin runs on the CPU)."""
    bounds = starts.tolist()
    return [
        (s, perm[bounds[s] : bounds[s + 1]].long())
        for s in range(len(bounds) - 1)
        if bounds[s + 1] > bounds[s]
    ]


def lora_shrink(x: torch.Tensor, a: torch.Tensor, perm: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """y [1, T, R] fp32 = x[row] @ A[slot(row)].T for the adapters' rows (0 on base rows, which the
    kernel leaves unspecified: the expand never reads them). One plane: the kernel may give
    several, partial sums over K, which `lora_expand` adds up."""
    y = torch.zeros(1, x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for s, rows in lora_rows(perm, starts):
        y[0, rows] = x[rows].float() @ a[s].float().T
    return y


def lora_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    perm: torch.Tensor,
    starts: torch.Tensor,
    seg_starts: torch.Tensor,
) -> torch.Tensor:
    """out[row, seg j] += y[:, row, j's rank columns].sum(0) @ B[slot(row), seg j].T, in place;
    returns out.

    The planes are summed in order in fp32, then rounded to B's dtype, as the kernel's
    tensor-core product does; the sum is accumulated in fp32 and rounded once to out's dtype.
    """
    n_bounds = seg_starts.tolist()
    r_seg = b.shape[2]
    total = y.sum(0) if y.shape[0] > 1 else y[0]
    for s, rows in lora_rows(perm, starts):
        for j in range(len(n_bounds) - 1):
            lo, hi = n_bounds[j], n_bounds[j + 1]
            ys = total[rows, j * r_seg : (j + 1) * r_seg].to(b.dtype).float()
            delta = ys @ b[s, lo:hi].float().T
            out[rows, lo:hi] = (out[rows, lo:hi].float() + delta).to(out.dtype)
    return out
