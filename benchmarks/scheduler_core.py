"""The scheduler core's host cost per sequence and step: the offline engine's Mesh without a model.

    .venv/bin/python benchmarks/scheduler_core.py [--num-requests 1000] [--max-num-seqs 1024]
        [--max-num-batched-tokens 16384] [--repeats 3]
    .venv/bin/python benchmarks/scheduler_core.py --smoke     # 40 requests (make test)

The Mesh, its planner and block manager, and the worker's `StepPipeline` behind a
`LocalWorkerLink`, exactly as `LLM` composes them, over `null_worker.NullRunner` (a runner that
samples instantly) instead of a model, on `gpu_mesh.py --workload sharegpt`'s workload (1,000
ShareGPT-shaped requests, all submitted at once). Every second of a run is the host's: the
loop thread's planning (`schedule`), applying results (`update`), and handing deltas to the
callers; the step thread's pipeline. The loop thread's CPU time per sequence-step is what an
engine pays between two GPU steps of a large batch (at ~750 sequences a step, 18 ms of GPU on an
H100 with FP8: docs/benchmarks.md), and what bounds one scheduler process of the mesh.

Side by side: the offline engine's stream interval (16 tokens a delta) and the served one's (1).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from null_worker import VOCAB, NullRunner  # noqa: E402
from offline_throughput import make_sharegpt_workload  # noqa: E402

from llmesh.engine import offline_mesh_config  # noqa: E402
from llmesh.local_link import LocalWorkerLink  # noqa: E402
from scheduler_svc.mesh import Mesh  # noqa: E402
from scheduler_svc.planner import PlannerConfig  # noqa: E402
from services.sampling_params import SamplingParams  # noqa: E402
from worker_svc.config import WorkerConfig  # noqa: E402
from worker_svc.pipeline import StepPipeline  # noqa: E402


async def one_run(reqs: list[tuple[list[int], int]], args: argparse.Namespace, stream_interval: int) -> dict:
    planner = PlannerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )
    mesh = Mesh(dataclasses.replace(offline_mesh_config(), planner=planner, stream_interval=stream_interval))
    runner = NullRunner(WorkerConfig(max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks))
    link = LocalWorkerLink(StepPipeline(runner), runner.info, runner.drop_all)  # type: ignore[arg-type]
    slot = mesh.add_worker("null", runner.info, link)

    async def consume(i: int, prompt: list[int], max_tokens: int) -> int:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        n = 0
        async for delta in mesh.generate(f"r{i}", prompt, sp):
            n += len(delta.new_token_ids)
        return n

    wall, cpu = time.perf_counter(), time.thread_time()  # this thread runs the event loop
    tokens = sum(await asyncio.gather(*(consume(i, p, o) for i, (p, o) in enumerate(reqs))))
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    steps = slot.num_steps
    await mesh.remove_worker("null")
    assert tokens == sum(o for _, o in reqs), (tokens, sum(o for _, o in reqs))
    # One sampled sequence per output token (no speculation): a sequence-step per token.
    return {"wall": wall, "cpu": cpu, "steps": steps, "seq_steps": tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-kv-blocks", type=int, default=40000)
    ap.add_argument("--repeats", type=int, default=3, help="runs per row (the table gives the median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="40 requests, one run a row (make test)")
    args = ap.parse_args()
    if args.smoke:
        args.num_requests, args.repeats = 40, 1
    reqs = make_sharegpt_workload(args.num_requests, VOCAB, args.seed)
    print(
        f"{len(reqs)} ShareGPT-shaped requests ({sum(len(p) for p, _ in reqs):,} prompt, "
        f"{sum(o for _, o in reqs):,} output tokens), {args.max_num_seqs} seqs / "
        f"{args.max_num_batched_tokens} tokens a step, no model"
    )
    print(f"{'stream interval':<22}{'wall s':>9}{'loop CPU s':>12}{'steps':>7}{'us / seq-step':>15}")
    for label, interval in (("16 (offline engine)", 16), ("1 (served)", 1)):
        runs = [asyncio.run(one_run(reqs, args, interval)) for _ in range(args.repeats)]
        cpu = statistics.median(r["cpu"] for r in runs)
        wall = statistics.median(r["wall"] for r in runs)
        per = 1e6 * cpu / runs[0]["seq_steps"]
        print(f"{label:<22}{wall:>9.2f}{cpu:>12.2f}{runs[0]['steps']:>7}{per:>15.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
