"""Giving a worker's device memory back: for good (`release`) or for a while (`ExecutorSleep`).

An engine's device memory is the weights, the paged KV cache and the CUDA graphs (their private
pool holds every intermediate the captured forwards wrote), plus small change. The graphs hold
the executor (cycles), the tiers share the executor's list of KV tensors, the LoRA slots and the
draft model hold the weights: dropping the runner alone leaves all of it to the cyclic collector,
which may run much later, after a second engine already failed to allocate. So it is let go of
explicitly, in place: the list of KV tensors is emptied (every holder shares that list), graphs
are reset, and the executor forgets its model.

Sleep (vLLM's `LLM.sleep` / `wake_up`, for RL loops that train between generations):
- level 1: the weights move to host memory and the KV cache is discarded; waking moves them back;
- level 2: both are discarded; waking reloads the weights from the checkpoint (or the same dummy
  initialisation) into the same parameters.
Graphs record device addresses, so they are released at sleep and captured again at wake (the
decode-GEMM choices are cached on disk, so that is the capture alone). KV contents are gone: the
caller must forget its prefix cache.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from worker_svc.loader import load_model

if TYPE_CHECKING:
    from worker_svc.executor import ModelExecutor

log = logging.getLogger(__name__)

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
SLEEP_TAGS = (WEIGHTS, KV_CACHE)


def release_graphs(ex: ModelExecutor) -> None:
    """Reset every captured graph (its pool's memory returns to the allocator) and drop them."""
    for graphs in (ex.graphs, ex.verify_graphs, ex.lora_graphs):
        if graphs is not None:
            graphs.release()
    ex.graphs = ex.verify_graphs = ex.lora_graphs = None


def release(ex: ModelExecutor) -> None:
    """Let go of every device tensor the executor holds, for good (the executor is unusable after)."""
    release_graphs(ex)
    ex.kv_caches.clear()  # shared with the runner and the KV tiers: emptied for all of them
    if ex.draft is not None:
        ex.draft.kv_caches.clear()
        ex.draft.model = None
    ex.draft = None
    ex.lora = None
    ex.model = None


def free_cached_memory(device: torch.device) -> None:
    """Collect what only cycles held, then hand the allocator's cached blocks back to the driver
    (so that another engine or process can have them) together with cuBLAS's workspaces."""
    gc.collect()
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()


@dataclass
class ExecutorSleep:
    """What a sleeping executor put away, and how it comes back (`wake`)."""

    ex: ModelExecutor
    level: int
    asleep: set[str] = field(default_factory=lambda: set(SLEEP_TAGS))
    kv_shapes: list[tuple[torch.Size, torch.dtype]] = field(default_factory=list)

    @classmethod
    def start(cls, ex: ModelExecutor, level: int) -> ExecutorSleep:
        """Put the executor to sleep: graphs and KV cache released, weights offloaded (level 1)
        or discarded (level 2)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if ex.tp.size > 1 or ex.draft is not None:
            raise NotImplementedError("sleep is not supported with tensor parallelism or a draft model")
        state = cls(ex, level, kv_shapes=[(t.shape, t.dtype) for t in ex.kv_caches])
        release_graphs(ex)
        ex.kv_caches.clear()
        if level == 1:
            ex.model.to("cpu")  # in place: every parameter keeps its identity, the LoRA hooks theirs
        else:
            _discard_parameters(ex.model)
        free_cached_memory(ex.device)
        return state

    def wake(self, tags: list[str] | None = None) -> bool:
        """Restore `tags` (default: both); True once nothing sleeps any more (graphs captured again)."""
        wanted = set(SLEEP_TAGS if tags is None else tags)
        unknown = wanted - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"wake_up tags must be among {list(SLEEP_TAGS)}, got {sorted(unknown)}")
        ex = self.ex
        if WEIGHTS in wanted & self.asleep:
            if self.level == 1:
                ex.model.to(ex.device)
            else:
                _reload_parameters(ex)
            self.asleep.discard(WEIGHTS)
        if KV_CACHE in wanted & self.asleep:
            # Zero-filled as at start: a padded read of a never-written slot stays finite.
            ex.kv_caches.extend(torch.zeros(s, dtype=d, device=ex.device) for s, d in self.kv_shapes)
            self.asleep.discard(KV_CACHE)
        if self.asleep:
            return False
        ex.capture_graphs()
        return True


def _discard_parameters(model: nn.Module) -> None:
    """Every parameter keeps its module, name, dtype and device but holds no element."""
    for p in model.parameters():
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _reload_parameters(ex: ModelExecutor) -> None:
    """Load the weights again as at start, and give each of the sleeping model's parameters
    its new tensor (the module tree, its hooks and every reference to a parameter stay valid)."""
    c = ex.config
    fresh, _ = load_model(
        ex.model_path,
        dtype=ex.dtype,
        device=ex.device,
        backend=ex.backend,
        load_format=c.load_format,
        tp=ex.tp,
        quantization=c.quantization,
    )
    new = dict(fresh.named_parameters(remove_duplicate=False))
    for name, p in ex.model.named_parameters(remove_duplicate=False):
        p.data = new[name].data
    del fresh, new
    log.info("weights reloaded after sleep level 2")
