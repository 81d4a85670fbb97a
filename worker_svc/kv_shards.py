"""KV tiers under tensor parallelism: the tiers hold whole blocks, each rank 1/N of their heads.

Every rank's cache holds its heads of every block (`KVCacheSpec.of(..., tensor_parallel_size)`),
while the host tier and the KV store hold whole blocks, in size 1's layout (heads in rank
order), so a chunk is the same bytes whichever ranks computed it. Rank 0 owns the tiers
(`WorkerKVTiers`); a gather or scatter of blocks there becomes one collective:

- gather (a save, a store put): every rank copies its heads of the blocks out of its cache, and
  rank 0 receives them all concatenated along the heads dimension;
- scatter (a host or store load): rank 0 broadcasts the whole blocks, and every rank writes its
  heads of them into its cache.

The other ranks learn of each one from rank 0's step channel (`KV_GATHER` / `KV_SCATTER` with
the block ids, written just before rank 0 enters the collective), in the order rank 0 does them,
so the collectives pair up without any other agreement, also when a store load is cut short
(a miss: rank 0 simply announces fewer blocks).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from worker_svc.kv_cache import movable
from worker_svc.kv_tiers import gather_blocks, scatter_blocks
from worker_svc.parallel import TensorParallel
from worker_svc.rank_channel import KV_GATHER, KV_SCATTER

HEADS_DIM = -2  # of a [n, layers, 2, block_size, heads, head_dim] block tensor


def heads_of(whole: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's heads of whole blocks."""
    per_rank = whole.shape[HEADS_DIM] // tp.size
    return whole.narrow(HEADS_DIM, tp.rank * per_rank, per_rank)


class KVShardExchange:
    """Rank 0's side: gathers and scatters whole blocks with the other ranks."""

    def __init__(self, tp: TensorParallel, announce: Callable[[int, np.ndarray], None]) -> None:
        self.tp = tp
        self.announce = announce  # writes (kind, block ids) to every other rank's step channel

    def gather(self, local: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
        """Whole blocks from rank 0's heads of them (`local`) and every other rank's."""
        self.announce(KV_GATHER, np.asarray(block_ids, dtype=np.int64))
        whole = self.tp.gather_dim(local, HEADS_DIM)
        assert whole is not None  # rank 0
        return whole

    def scatter(self, whole: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
        """Rank 0's heads of whole blocks; every other rank gets and writes its own."""
        self.announce(KV_SCATTER, np.asarray(block_ids, dtype=np.int64))
        # A broadcast may write its root's buffer too: never hand it a view of the store's
        # bytes (read-only, or a shared segment the store reuses). On a GPU it is a device copy.
        # Contiguous either way: the other ranks receive into a contiguous buffer of this shape
        # (a host tier laid out layer-major hands over a transposed view).
        if whole.device.type == "cpu":
            whole = whole.clone(memory_format=torch.contiguous_format)
        else:
            whole = whole.contiguous()
        self.tp.broadcast_from_first(whole)
        return heads_of(whole, self.tp)


def serve_gather(tp: TensorParallel, kv_caches: list[torch.Tensor], block_ids: np.ndarray) -> None:
    """Another rank's side of `KVShardExchange.gather`."""
    tp.gather_dim(gather_blocks(movable(kv_caches), block_ids.tolist()), HEADS_DIM)  # type: ignore[arg-type]


def serve_scatter(tp: TensorParallel, kv_caches: list[torch.Tensor], block_ids: np.ndarray) -> None:
    """Another rank's side of `KVShardExchange.scatter`."""
    kv_caches = movable(kv_caches)  # type: ignore[assignment]  # an fp8 cache's blocks as bytes, as rank 0's
    first = kv_caches[0]  # [2, num_blocks, block_size, heads, head_dim]: this rank's heads
    heads = first.shape[3] * tp.size
    shape = (len(block_ids), len(kv_caches), first.shape[0], first.shape[2], heads, first.shape[4])
    whole = torch.empty(shape, dtype=first.dtype, device=first.device)
    tp.broadcast_from_first(whole)
    scatter_blocks(kv_caches, block_ids.tolist(), heads_of(whole, tp))
