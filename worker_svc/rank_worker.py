"""A tensor-parallel rank other than 0: `python -m worker_svc.rank_worker` (started by `RankGroup`).

It builds the same `ModelExecutor` as rank 0 (its shard of the model, its share of the KV
cache, the same CUDA graphs), then runs, for each `ForwardInputs` on stdin, the forward rank 0
runs: same inputs, same code, same collectives in the same order, its own heads. It keeps no
sequence state, samples nothing and answers nothing (its share of the logits goes to rank 0
through the gather).

It exits when rank 0 says STOP, when its stdin reaches EOF (rank 0 died), or, if blocked in a
collective at that moment, when its watcher sees that its parent is gone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

import numpy as np
import torch

from worker_svc.config import WorkerConfig
from worker_svc.executor import ModelExecutor, Patch
from worker_svc.kv_shards import serve_gather, serve_scatter
from worker_svc.lora.slots import decode_lora_load
from worker_svc.parallel import TensorParallel, backend_for, open_group
from worker_svc.rank_channel import KV_GATHER, KV_SCATTER, LORA_LOAD, STEP, STOP, ForwardInputs, read_message
from worker_svc.rank_group import joined_key

log = logging.getLogger("llmesh.rank")

PARENT_POLL_S = 0.5


class RankShard:
    """Rank 0's `ModelRunner` without sequences: the same `ModelExecutor`, fed by rank 0."""

    def __init__(self, config: WorkerConfig, tp: TensorParallel) -> None:
        self.tp = tp
        # Built like rank 0's (the runner builds its own in between): the collectives match.
        self.executor = ModelExecutor(config, tp, config.model)
        self.executor.capture_graphs()
        self.kv_caches = self.executor.kv_caches

    @torch.inference_mode()
    def step(self, inp: ForwardInputs) -> None:
        ex = self.executor
        patch = None
        if inp.patch_where.size:
            # The tokens rank 0 sampled last step and has not read yet: broadcast from its device.
            values = torch.empty(inp.patch_where.size, dtype=torch.int64, device=ex.device)
            self.tp.broadcast_from_first(values)
            moves = np.stack([inp.patch_where, np.arange(inp.patch_where.size, dtype=np.int64)])
            patch = Patch(moves, values)
        hidden, sample_index = ex.forward(inp, patch)
        if inp.num_sampled:  # its share of the logits goes to rank 0 through the gather
            ex.logits(hidden, sample_index)


def _exit_with_parent(parent_pid: int) -> None:
    """Leave at once when rank 0 is gone, even while blocked inside a collective."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(PARENT_POLL_S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--store-port", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--config", required=True, help="the WorkerConfig as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()
    config = WorkerConfig(**json.loads(args.config))
    device = config.torch_device()
    if device.type == "cpu":
        # The ranks share the host's cores: each takes its part, not all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.size))
    from datetime import timedelta

    import torch.distributed as dist

    timeout_s = config.tp_timeout_s
    store = dist.TCPStore(
        "127.0.0.1", args.store_port, args.size, is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    store.set(joined_key(args.rank), "1")
    tp = open_group(
        args.rank,
        args.size,
        args.store_port,
        backend_for(device),
        timeout_s,
        device,
        store,
        all_reduce=config.tp_all_reduce,
    )
    shard = RankShard(config, tp)
    channel = sys.stdin.buffer
    try:
        while True:
            msg = read_message(channel)
            if msg is None or msg[0] == STOP:
                break  # or rank 0 is gone
            kind, arrays = msg
            if kind == STEP:
                shard.step(ForwardInputs.decode(arrays))
            elif kind == KV_GATHER:
                with torch.inference_mode():
                    serve_gather(tp, shard.kv_caches, arrays[0])
            elif kind == KV_SCATTER:
                with torch.inference_mode():
                    serve_scatter(tp, shard.kv_caches, arrays[0])
            elif kind == LORA_LOAD:
                assert shard.executor.lora is not None  # every rank has LoRA on, or none
                with torch.inference_mode():
                    shard.executor.lora.load_into(*decode_lora_load(arrays))
            else:
                raise ValueError(f"unknown rank message kind {kind}")
    finally:
        tp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
