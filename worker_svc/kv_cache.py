"""The paged KV cache tensors of one worker rank, sized from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_svc.models.config import ModelConfig


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def of(
        cls, model: ModelConfig, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1
    ) -> KVCacheSpec:
        """One rank's cache: with tensor parallelism it holds its 1/N of the KV heads of every block."""
        heads = model.num_kv_heads // tensor_parallel_size
        return cls(model.num_layers, heads, model.head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


# Left free on a GPU for the activations of the largest batch (a generous fixed margin).
ACTIVATION_MARGIN_BYTES = 1 << 30


def kv_budget_bytes(device: torch.device, kv_cache_memory: int, gpu_memory_utilization: float) -> int:
    """The bytes a rank's KV cache may take: `kv_cache_memory` off CUDA; on CUDA what is free
    now (weights loaded) beyond the unused share of the device and the activation margin."""
    if device.type != "cuda":
        return kv_cache_memory
    free, total = torch.cuda.mem_get_info(device)
    reserve = total * (1.0 - gpu_memory_utilization)
    return int(max(free - reserve - ACTIVATION_MARGIN_BYTES, 0))


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """Blocks of `bytes_per_block` (every cache that has a slot per block, summed) in the budget."""
    return max(budget_bytes // bytes_per_block, 0)


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer.

    Zero-filled, so that a padded or masked read of a never-written slot is finite.
    """
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
