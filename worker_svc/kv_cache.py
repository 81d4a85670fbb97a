"""The paged KV cache tensors of one worker rank, sized from a memory budget.

The cache's dtype is the model's, or float8_e4m3fn (`kv_cache_dtype="fp8"`): one byte an
element, so the same budget holds twice the blocks of a bf16 cache (`bytes_per_block`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from worker_svc.kv_peer import SHM_DIR, SharedKVSegment
from worker_svc.models.config import ModelConfig

log = logging.getLogger(__name__)


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


def shared_kv_segment(spec: KVCacheSpec, num_blocks: int) -> SharedKVSegment | None:
    """`allocate_kv_cache`'s tensors in a shared-memory segment peers of this host can map (a CPU
    prefill worker's, for direct handovers); None where the host has no /dev/shm or it is too
    small (the cache is then private: handovers go through the store)."""
    if not os.path.isdir(SHM_DIR):
        return None
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    try:
        return SharedKVSegment(shape, spec.dtype, spec.num_layers)
    except OSError as e:
        log.warning("KV cache not exported: no room in shared memory", extra={"error": repr(e)})
        return None


class ByteViews(Sequence[torch.Tensor]):
    """The caches of a list as uint8 views, for code that only moves their bytes (the KV tiers).

    torch has no index_copy_ for float8 on the CPU; bytes move the same whatever they encode
    (the fingerprint says what that is). A view of the live list, not a copy of it: sleeping
    empties and refills the list, and these follow.
    """

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self._caches = caches

    def __len__(self) -> int:
        return len(self._caches)

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        if isinstance(i, slice):
            return [c.view(torch.uint8) for c in self._caches[i]]
        return self._caches[i].view(torch.uint8)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (c.view(torch.uint8) for c in self._caches)


def movable(caches: list[torch.Tensor]) -> Sequence[torch.Tensor]:
    """`caches` as code that moves whole blocks should see them: bytes for an fp8 cache."""
    return ByteViews(caches) if caches and caches[0].dtype == torch.float8_e4m3fn else caches
