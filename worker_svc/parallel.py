"""Tensor parallelism's ground floor: which rank this process is, and the collectives the model uses.

A worker with `tensor_parallel_size` N runs N processes, one per device (or per CPU
process with gloo), each holding 1/N of the attention heads, of the MLP and of the
vocabulary (`worker_svc.models.parallel_layers`). The model needs four collectives:
all-reduce (after o_proj, down_proj and the vocab-parallel embedding), gather to rank 0
(the vocab-parallel logits: only rank 0 samples), broadcast from rank 0 (token ids that
a previous step sampled on rank 0's device) and a MIN of one integer at start (the KV
block count every rank can hold).

The process group is made directly (`ProcessGroupGloo` / `ProcessGroupNCCL` over a
`TCPStore` on loopback), not through `torch.distributed.init_process_group`: no global
default group, so one Python process can open, close and reopen engines (tests, notebooks),
and every collective has the group's timeout, so a dead peer fails a step instead of
hanging it. Size 1 needs no group at all: every collective is the identity, so the model
has one code path.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from worker_svc.p2p_all_reduce import P2PAllReduce

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the models import this module: only the type, no import loop
    from worker_svc.models.config import ModelConfig


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch ProcessGroup (None at size 1)
    store: object | None = None  # the TCPStore the group met through (kept alive with it)
    p2p: P2PAllReduce | None = None  # small CUDA messages' all-reduce (None: NCCL/gloo for all)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def shard(self, total: int, what: str = "size") -> int:
        """total / size, refusing a remainder (a checked model never has one)."""
        if total % self.size:
            raise ValueError(f"{what} {total} does not divide by tensor_parallel_size {self.size}")
        return total // self.size

    # ----- collectives (identity at size 1) -----
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        if self.size > 1:
            if self.p2p is not None and self.p2p.fits(x):
                self.p2p.all_reduce(x)
            else:
                self.group.allreduce([x]).wait()  # type: ignore[union-attr]
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` concatenated along the last dim, on rank 0; None on the others."""
        return self.gather_dim(x, -1)

    def gather_dim(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Every rank's `x` (same shapes) concatenated along `dim` in rank order, on rank 0;
        None on the others."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.is_first:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.group.gather([parts], [x], _gather_options()).wait()  # type: ignore[union-attr]
            return torch.cat(parts, dim=dim)
        self.group.gather([], [x], _gather_options()).wait()  # type: ignore[union-attr]
        return None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place; the others pass a buffer of the same shape)."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self.group.broadcast([x], opts).wait()  # type: ignore[union-attr]
        return x

    def min_int(self, value: int, device: torch.device | str = "cpu") -> int:
        """The smallest of every rank's `value` (e.g. the KV blocks each rank's memory holds)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], opts).wait()  # type: ignore[union-attr]
        return int(t.item())

    def close(self, timeout_s: float = 10.0) -> None:
        """Tear the group down; every rank calls this as it leaves (NCCL's teardown is collective).

        Bounded: a teardown that waits on a rank that is gone (NCCL's does, seen on two H200s)
        is left to a daemon thread after `timeout_s`, so that closing an engine never hangs.
        """
        if self.p2p is not None:
            self.p2p.close()
        group, self.group, self.store, self.p2p = self.group, None, None, None
        if group is not None and not run_bounded(group.shutdown, timeout_s):  # type: ignore[attr-defined]
            log.warning("tensor-parallel group did not close within %.0f s; left behind", timeout_s)

    def abort(self) -> None:
        """Fail every collective in flight (a rank died), without waiting for the teardown."""
        if self.group is not None:
            run_bounded(self.group.abort, 0.0)  # type: ignore[attr-defined]


def run_bounded(fn: Callable[[], object], timeout_s: float) -> bool:
    """Run `fn` on a daemon thread; True when it returned (or raised) within `timeout_s`."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a group whose peer died may refuse a clean teardown
            pass
        finally:
            done.set()

    threading.Thread(target=run, name="llmesh-tp-teardown", daemon=True).start()
    return done.wait(timeout_s)


def _gather_options() -> dist.GatherOptions:
    opts = dist.GatherOptions()
    opts.rootRank = 0
    return opts


def open_group(
    rank: int,
    size: int,
    store_port: int,
    backend: str,
    timeout_s: float,
    device: torch.device | None = None,
    store: dist.TCPStore | None = None,
    all_reduce: str = "nccl",
) -> TensorParallel:
    """Join the `size`-rank group that meets at 127.0.0.1:`store_port` (rank 0 passes its store).

    Blocks until every rank has joined (at most `timeout_s`). `all_reduce` "auto" adds the
    peer-to-peer all-reduce for small messages on CUDA (`worker_svc.p2p_all_reduce`).
    """
    if all_reduce not in ("auto", "nccl"):
        raise ValueError(f"tp_all_reduce must be auto or nccl, got {all_reduce!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False, timeout=timeout)
    # A prefix per group: the store is the group's own, but the name says whose keys these are.
    prefixed = dist.PrefixStore("llmesh-tp", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        if device is not None:
            torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        if device is not None:
            # Bind the communicator to this rank's device now (eager init), not at the first
            # collective: the first one may be inside a CUDA graph capture.
            group.eager_connect_single_device(torch.device(device))
    else:
        raise ValueError(f"tensor-parallel backend must be gloo or nccl, got {backend!r}")
    tp = TensorParallel(rank=rank, size=size, group=group, store=store)
    if backend == "nccl" and all_reduce == "auto" and device is not None:
        tp.p2p = P2PAllReduce.open(
            rank,
            size,
            dist.PrefixStore("llmesh-p2p", store),
            group,
            torch.device(device),
            agree=lambda ok: tp.min_int(int(ok), device) == 1,
        )
    return tp


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def check_shardable(config: ModelConfig, size: int) -> None:
    """Refuse a tensor-parallel size the model cannot be split by (clear error at startup).

    Query heads, KV heads and the MLP's intermediate size are split evenly (no KV head is
    replicated); the vocabulary is padded to a multiple of the size, so it never refuses.
    """
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    problems = [
        f"{what} ({n})"
        for what, n in (
            ("query heads", config.num_heads),
            ("KV heads", config.num_kv_heads),
            ("intermediate size", config.intermediate_size),
        )
        if n % size
    ]
    if problems:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the {' and the '.join(problems)} of "
            f"{config.architecture}: choose a size that divides {config.num_heads} query and "
            f"{config.num_kv_heads} KV heads"
        )
