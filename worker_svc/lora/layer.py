"""A linear layer's LoRA: stacked A/B of every slot, and the batched products after its GEMM.

Layout (`kernels.lora_reference` describes the kernels'): for a layer of output segments
q|k|v (or gate|up, or one segment for o_proj / down_proj), A is [slots, segments * R, in] (each
segment's A in its own R rank rows) and B is [slots, out, R] (output rows of segment j read
rank columns j*R .. (j+1)*R of the shrink). R is the worker's `max_lora_rank`; an adapter of a
lower rank, or one that leaves a segment out, leaves zeros there. On a tensor-parallel rank
`in` and `out` are the base layer's local sizes: B is split like a column-parallel weight's
rows, A like a row-parallel weight's columns; a row-parallel layer's partial products (its
LoRA delta included, since (x_i A_i) B summed over ranks is x A B) are all-reduced after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import lora_reference
from worker_svc.models.parallel_layers import ShardedLinear


@dataclass
class LoRABatch:
    """A step's rows that use an adapter, on the device: `perm` lists them sorted by slot, rows
    perm[starts[s]:starts[s+1]] use slot s; `max_rows` bounds any slot's count (it sizes grids)."""

    perm: torch.Tensor  # int32 [rows using an adapter]
    starts: torch.Tensor  # int32 [num_slots + 1]
    max_rows: int


class BatchRef:
    """The batch every layer of a model reads (None: no row uses an adapter; the layers do nothing),
    and the side stream the layers' shrinks run on (CUDA)."""

    batch: LoRABatch | None = None
    # Off: each shrink runs on the current stream, after its GEMM (as before the side stream).
    overlap: bool = True
    _streams: dict[torch.device, torch.cuda.Stream]

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        streams = self.__dict__.setdefault("_streams", {})
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        return streams[device]


class LoRALayer:
    def __init__(
        self, base: ShardedLinear, num_slots: int, rank: int, dtype: torch.dtype, ref: BatchRef
    ) -> None:
        self.base = base
        self.ref = ref
        self.rank = rank
        out_local, in_local = base.weight.shape
        device = base.weight.device
        # Column-parallel layers (dim 0) have one LoRA per segment; row-parallel ones one.
        self.segments = list(base.local_segments) if base.dim == 0 else ["in"]
        sizes = list(base.local_segments.values()) if base.dim == 0 else [out_local]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        self.seg_offsets = offsets
        self.seg_starts = torch.tensor(offsets, dtype=torch.int32, device=device)
        self.max_seg_n = max(sizes)
        self.a = torch.zeros(num_slots, len(self.segments) * rank, in_local, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out_local, rank, dtype=dtype, device=device)
        self._pending: tuple[torch.Tensor, torch.cuda.Stream] | None = None  # (y, its stream)

    def before(self, x: torch.Tensor) -> None:
        """Start the shrink (x @ A[slot].T) ahead of the base GEMM, on a side stream: it reads
        only x, so it runs beside the GEMM (memory-bound, it leaves SMs to spare) instead of
        after it, and a decode step no longer waits for a shrink launch per projection. In a
        CUDA graph the fork and join are edges of the graph. `__call__` joins it."""
        batch = self.ref.batch
        self._pending = None
        if batch is None or not x.is_cuda or not self.ref.overlap:
            return
        from kernels.triton import lora as kt

        x2 = x.reshape(-1, x.shape[-1])
        # Allocated on the current stream, which frees it after the expand (past the join).
        y = kt.shrink_output(x2, self.a, batch.max_rows)
        main = torch.cuda.current_stream(x.device)
        side = self.ref.side_stream(x.device)
        side.wait_stream(main)  # x is written
        with torch.cuda.stream(side):
            kt.lora_shrink(x2, self.a, batch.perm, batch.starts, batch.max_rows, y=y)
        self._pending = (y, side)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base GEMM's output for `x`) plus each adapter row's low-rank product, in place."""
        batch = self.ref.batch
        if batch is None:
            return out
        x2 = x.reshape(-1, x.shape[-1])
        out2 = out.view(-1, out.shape[-1])
        if x2.is_cuda:
            from kernels.triton import lora as kt

            pending, self._pending = self._pending, None
            if pending is None:
                y = kt.lora_shrink(x2, self.a, batch.perm, batch.starts, batch.max_rows)
            else:
                y, side = pending
                torch.cuda.current_stream(x.device).wait_stream(side)
            rows = batch.perm.shape[0]  # the expand's grid: all the adapter rows (its blocks mix slots)
            kt.lora_expand(y, self.b, out2, batch.perm, batch.starts, self.seg_starts, rows, self.max_seg_n)
        else:
            y = lora_reference.lora_shrink(x2, self.a, batch.perm, batch.starts)
            lora_reference.lora_expand(y, self.b, out2, batch.perm, batch.starts, self.seg_starts)
        return out

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def load(self, slot: int, segment: str | None, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """Copy one PEFT module's full A [r, in] and B [out, r] into `slot`, this rank's part
        of them (B's rows of the segment on a column-parallel layer, A's columns on a row-parallel
        one), with the scale folded into B."""
        base = self.base
        tp = base.tp
        r = a.shape[0]
        if r > self.rank:
            raise ValueError(f"rank {r} exceeds the worker's max_lora_rank {self.rank}")
        if base.dim == 0:
            seg = segment or self.segments[0]
            j = self.segments.index(seg)
            full_out, local = base.segments[seg], base.local_segments[seg]
            _check_shapes(a, b, base.full_in, full_out)
            a_part = a
            b_part = b[tp.rank * local : (tp.rank + 1) * local]
            a_rows, out_lo = slice(j * self.rank, j * self.rank + r), self.seg_offsets[j]
        else:
            _check_shapes(a, b, base.full_in, base.full_out)
            local = base.weight.shape[1]
            a_part = a[:, tp.rank * local : (tp.rank + 1) * local]
            b_part = b
            a_rows, out_lo = slice(0, r), 0
        self.a[slot, a_rows].copy_(a_part)
        out_hi = out_lo + b_part.shape[0]
        self.b[slot, out_lo:out_hi, :r].copy_(b_part.float() * scale)


def _check_shapes(a: torch.Tensor, b: torch.Tensor, full_in: int, full_out: int) -> None:
    r = a.shape[0]
    if tuple(a.shape) != (r, full_in) or tuple(b.shape) != (full_out, r):
        raise ValueError(f"A {tuple(a.shape)}, B {tuple(b.shape)} do not fit {full_in} -> {full_out}")
