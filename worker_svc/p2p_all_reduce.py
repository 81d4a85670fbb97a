"""A one-shot all-reduce over PyTorch symmetric memory, for the small messages of decode steps.

Why: a decode step of a tensor-parallel model all-reduces twice per layer, a few KiB each
(160 messages of 16 KiB a step for a 70B shape at batch 1). NCCL's latency for such a message,
even replayed inside a CUDA graph, is ~16 us on two H200s: 2.5 ms of a 22 ms step. A
one-shot all-reduce is one kernel in which every rank reads every peer's copy of the message
straight over NVLink (peer-to-peer loads) and sums them; vLLM's custom all-reduce is the same
idea. NVLink multicast is not used (it stays off on shared hosts): PyTorch's `one_shot_all_reduce`
reads peers through their mapped buffers and meets them through signal pads.

Each rank owns one symmetric buffer of `max_bytes` (bytes, viewed as each message's dtype); a
message is copied into it (by the all-reduce kernel itself where PyTorch has that variant) and
reduced from it into the caller's tensor. Larger messages
(prefill chunks) go to NCCL, which moves them at link bandwidth. Every failure to set up
leaves the group on NCCL alone (`open` returns None), and the ranks agree on it, so no rank
waits in a collective another rank skipped.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8 << 20  # vLLM's symmetric-memory limit for two ranks
_NAME_KEY = "llmesh-p2p-all-reduce-name"


DTYPES = (torch.float32, torch.bfloat16)  # what PyTorch's one-shot kernel sums


class P2PAllReduce:
    """Sums a contiguous CUDA tensor over the ranks in place, through the symmetric buffer."""

    def __init__(self, buffer: torch.Tensor, group_name: str, group: object, size: int) -> None:
        self.buffer = buffer  # this rank's symmetric buffer (flat bytes)
        self.size = size
        self.group_name = group_name
        self._group = group  # the ProcessGroup registered under group_name (unregistered at close)
        # The kernel that copies the message into the buffer itself (one launch, not two).
        self._copy_in = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in DTYPES and x.numel() * x.element_size() <= self.buffer.numel() and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> None:
        flat = x.view(-1)
        staged = self.buffer.view(x.dtype)[: flat.numel()]
        if self._copy_in:
            # In place: each thread copies its elements in, then (after the ranks meet) sums
            # the same elements out; the kernel meets the ranks again before it ends, so the
            # next message may be written into the buffer at once.
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum", self.group_name, flat)
        else:
            staged.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)

    def check(self, device: torch.device) -> None:
        """One small all-reduce on every rank (each rank decides alike: same code, same torch):
        the copy-in kernel where it runs, else the copy and the plain kernel. Raises when
        neither gives the sum."""
        for copy_in in [True, False] if self._copy_in else [False]:
            self._copy_in = copy_in
            probe = torch.ones(64, dtype=torch.float32, device=device)
            try:
                self.all_reduce(probe)
                torch.cuda.synchronize(device)
            except RuntimeError as e:
                log.info("one-shot all-reduce with copy-in refused (%s)", str(e))
                continue
            if int(probe[0].item()) != self.size:
                raise RuntimeError(f"one-shot all-reduce probe summed to {probe[0].item()}")
            return
        raise RuntimeError("no one-shot all-reduce kernel runs here")

    def close(self) -> None:
        if self._group is not None:
            from torch._C._distributed_c10d import _unregister_process_group

            _unregister_process_group(self.group_name)
            self._group = None

    @classmethod
    def open(
        cls,
        rank: int,
        size: int,
        store: object,
        backend: object,
        device: torch.device,
        agree: Callable[[bool], bool],
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> P2PAllReduce | None:
        """Set up the buffer on every rank (a collective), or None on every rank.

        `backend` is the group's ProcessGroupNCCL; symmetric memory finds groups by name, so a
        ProcessGroup over it is registered under a name of its own. `agree(ok)` is True only
        when every rank's `ok` is (a MIN over the NCCL group): once before the rendezvous (so
        that no rank enters it alone) and once after it.
        """
        try:
            import torch.distributed._symmetric_memory as symm_mem
            from torch._C._distributed_c10d import ProcessGroup, _register_process_group

            ready = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out")
        except (ImportError, AttributeError) as e:
            log.info("peer-to-peer all-reduce unavailable (%s); NCCL only", str(e))
            ready = False
        if not agree(ready and device.type == "cuda"):
            return None
        group = None
        try:
            # One name for the group on every rank, new for every engine: a process may open
            # several engines in turn, and a name is registered once per process.
            if rank == 0:
                store.set(_NAME_KEY, f"llmesh-tp-{uuid.uuid4().hex[:12]}")  # type: ignore[attr-defined]
            name = store.get(_NAME_KEY).decode()  # type: ignore[attr-defined]
            group = ProcessGroup(store, rank, size)
            group._register_backend(device, ProcessGroup.BackendType.NCCL, backend)
            group._set_default_backend(ProcessGroup.BackendType.NCCL)
            group._set_group_name(name)
            _register_process_group(name, group)
            buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, name)
            made: P2PAllReduce | None = cls(buffer, name, group, size)
            made.check(device)
        except Exception as e:  # noqa: BLE001 - any failure here means NCCL alone, on every rank
            # str(e), not e: a log record holding the exception holds its traceback's frames,
            # and with them the engine being built (its weights and KV cache) for as long as
            # a handler keeps the record.
            log.warning("peer-to-peer all-reduce could not start (%s); NCCL only", str(e))
            made = None
            if group is not None:
                _unregister_quietly(name)
        if not agree(made is not None):
            if made is not None:
                made.close()
            return None
        log.info("tensor-parallel all-reduce: peer-to-peer one-shot up to %d bytes, NCCL above", max_bytes)
        return made


def _unregister_quietly(name: str) -> None:
    try:
        from torch._C._distributed_c10d import _unregister_process_group

        _unregister_process_group(name)
    except Exception:  # noqa: BLE001 - it was never registered
        pass
