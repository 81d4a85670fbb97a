"""Decode graphs that include the LoRA kernels, for decode steps whose rows use adapters.

The base model's graphs (`worker_svc.cuda_graphs.DecodeGraphs`) hold no LoRA work, so a base-only
step replays exactly what it replays without LoRA. A second set, captured when the worker serves
LoRA, records every layer's shrink and expand over static row lists: `perm` (the rows that use
an adapter, sorted by slot) and `starts` (each slot's first), written before each replay. The
kernels' grids are sized by the graph's batch (`max_rows` = its size) and their programs past a
slot's rows return at once, so one graph serves every mix of adapters and base rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from worker_svc.cuda_graphs import DecodeGraphs
from worker_svc.lora.layer import LoRABatch
from worker_svc.lora.slots import LoRASlots, lora_batch_arrays

if TYPE_CHECKING:
    from worker_svc.executor import ModelExecutor


class LoRADecodeGraphs(DecodeGraphs):
    def __init__(
        self, executor: ModelExecutor, sizes: list[int], slots: LoRASlots, capture: bool = True
    ) -> None:
        super().__init__(executor, sizes, capture)
        self.slots = slots
        dev = executor.device
        self.perm = torch.zeros(self.max_size, dtype=torch.int32, device=dev)
        self.starts = torch.zeros(slots.max_loras + 1, dtype=torch.int32, device=dev)

    def _forward(self, b: int) -> torch.Tensor:
        self.slots.set_batch(LoRABatch(self.perm[:b], self.starts, max_rows=b))
        try:
            return super()._forward(b)
        finally:
            self.slots.set_batch(None)

    def with_rows(self, row_slots: np.ndarray) -> LoRADecodeGraphs:
        """Set the next replay's rows (one per sequence: its adapter's slot, -1 for the base)."""
        arrays = lora_batch_arrays(row_slots, self.slots.max_loras)
        perm, starts = (arrays[0], arrays[1]) if arrays is not None else (np.zeros(0, np.int32), None)
        if starts is None:
            starts = np.zeros(self.slots.max_loras + 1, dtype=np.int32)
        d_perm, d_starts = self.executor.upload([perm, starts])
        self.perm[: len(perm)].copy_(d_perm)
        self.starts.copy_(d_starts)
        return self
