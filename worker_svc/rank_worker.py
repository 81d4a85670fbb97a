"""A tensor-parallel rank other than 0: `python -m worker_svc.rank_worker` (started by `RankGroup`).

It loads its shard of the model and its share of the KV cache, captures the same CUDA graphs
as rank 0, then runs, for each `ForwardInputs` on stdin, the forward rank 0 runs: same inputs,
same collectives in the same order, its own heads. It keeps no sequence state, samples nothing
and answers nothing (its share of the logits goes to rank 0 through the gather).

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

from kernels.attention_metadata import AttentionMetadata
from services.model_files import default_cache_dir
from worker_svc.config import WorkerConfig
from worker_svc.decode_gemms import choose_decode_gemms
from worker_svc.kv_cache import KVCacheSpec, allocate_kv_cache, num_blocks_for_budget
from worker_svc.kv_shards import serve_gather, serve_scatter
from worker_svc.loader import load_model
from worker_svc.parallel import TensorParallel, backend_for, open_group
from worker_svc.rank_channel import KV_GATHER, KV_SCATTER, STEP, STOP, ForwardInputs, read_message
from worker_svc.rank_group import joined_key
from worker_svc.runner import _round16, make_backend, pack_to_device

log = logging.getLogger("llmesh.rank")

PARENT_POLL_S = 0.5


class RankShard:
    """The parts of a `ModelRunner` that a rank other than 0 needs (and `DecodeGraphs` reads)."""

    def __init__(self, config: WorkerConfig, tp: TensorParallel) -> None:
        self.config = config
        self.tp = tp
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        self.backend = make_backend(config.attention_backend, self.device)
        # The same steps as ModelRunner._build, in the same order: the collectives must match.
        self.model, mc = load_model(
            config.model, dtype=self.dtype, device=self.device, backend=self.backend,
            load_format=config.load_format, tp=tp,
        )  # fmt: skip
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        bs = config.block_size
        spec = KVCacheSpec.of(mc, bs, self.dtype, tp.size)
        num_kv_blocks = config.num_kv_blocks or num_blocks_for_budget(spec, self._kv_budget())
        self.num_kv_blocks = tp.min_int(num_kv_blocks, self.device)
        self.kv_caches = allocate_kv_cache(spec, max(self.num_kv_blocks, 1), self.device)
        self.max_blocks_per_seq = _round16((self.max_model_len + bs - 1) // bs)
        self.draft = None  # a draft model lives whole on rank 0 (DecodeGraphs asks for it)
        self._graphs = None
        if self.device.type == "cuda" and self.backend.name == "triton" and not config.enforce_eager:
            from worker_svc.cuda_graphs import DecodeGraphs, capture_sizes

            if config.decode_gemm == "auto":
                choose_decode_gemms([self.model], self.device, config.cache_dir or default_cache_dir())
            self._graphs = DecodeGraphs(self, capture_sizes(config.resolved_max_num_seqs()))  # type: ignore[arg-type]
            self._graphs.capture()

    def _kv_budget(self) -> int:
        if self.device.type != "cuda":
            return self.config.kv_cache_memory
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = total * (1.0 - self.config.gpu_memory_utilization)
        return int(max(free - reserve - (1 << 30), 0))

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        return pack_to_device(arrays, self.device)

    @torch.inference_mode()
    def step(self, inp: ForwardInputs) -> None:
        patch = None
        if inp.patch_where.size:
            # The tokens rank 0 sampled last step and has not read yet: broadcast from its device.
            values = torch.empty(inp.patch_where.size, dtype=torch.int64, device=self.device)
            self.tp.broadcast_from_first(values)
            patch = (self.upload([inp.patch_where])[0], values)
        sample_index = None
        if inp.graph:
            assert self._graphs is not None, "rank 0 replays a CUDA graph this rank did not capture"
            hidden = self._graphs.run(inp.ids, inp.positions, inp.slots, inp.seq_lens, inp.tables, patch)
            if inp.sample_index is not None:
                sample_index = self.upload([inp.sample_index])[0]
        else:
            arrays = [inp.ids, inp.positions, inp.slots, inp.query_start_loc, inp.seq_lens, inp.tables]
            if inp.sample_index is not None:
                arrays.append(inp.sample_index)
            d = self.upload(arrays)
            d_ids = d[0]
            if patch is not None:
                d_ids.index_copy_(0, *patch)
            meta = AttentionMetadata(
                slot_mapping=d[2],
                query_start_loc=d[3],
                seq_lens=d[4],
                block_tables=d[5],
                max_query_len=inp.max_query_len,
                max_seq_len=inp.max_seq_len,
                query_lens_cpu=inp.query_lens.tolist(),
                seq_lens_cpu=inp.seq_lens.tolist(),
            )
            hidden = self.model(d_ids, d[1], self.kv_caches, meta)
            if inp.sample_index is not None:
                sample_index = d[6]
        if inp.num_sampled:
            self.model.compute_logits(hidden if sample_index is None else hidden[sample_index])


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
            else:
                raise ValueError(f"unknown rank message kind {kind}")
    finally:
        tp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
