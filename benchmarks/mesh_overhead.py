"""Mesh overhead: the same workload through the gRPC mesh and through the in-process engine.

The mesh run starts a scheduler and one worker as processes on loopback and sends
every request at once from concurrent gRPC streams; the in-process run gives the
same requests to `LLM.generate`. Same model, same planner limits, greedy, ignore_eos.

    .venv/bin/python benchmarks/mesh_overhead.py [--num-requests 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offline_throughput import make_workload  # noqa: E402


async def run_mesh_clients(address: str, reqs) -> tuple[float, int]:
    import grpc

    from llmesh.v1 import generation_pb2 as g
    from llmesh.v1 import generation_pb2_grpc as gg

    async with grpc.aio.insecure_channel(address) as channel:
        stub = gg.SchedulerStub(channel)

        async def one(prompt, max_tokens) -> int:
            req = g.GenerateRequest(
                prompt_token_ids=g.TokenIds(ids=prompt),
                sampling_params=g.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            )
            n = 0
            async for resp in stub.Generate(req):
                n += len(resp.token_ids)
            return n

        await one(reqs[0][0][:16], 2)  # warm-up
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p, o) for p, o in reqs))
        return time.perf_counter() - t0, sum(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--output", type=int, nargs=2, default=(16, 64))
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="4 short requests (make test)")
    args = ap.parse_args()
    if args.smoke:
        args.num_requests, args.prompt, args.output = 2, (8, 16), (2, 4)

    from llmesh import LLM, SamplingParams
    from services.launcher import start_mesh
    from services.model_files import resolve_model
    from worker_svc.models.config import ModelConfig

    path = resolve_model(None)
    reqs = make_workload(
        args.num_requests,
        ModelConfig.from_pretrained(path).vocab_size,
        args.seed,
        tuple(args.prompt),
        tuple(args.output),
    )
    out_tokens = sum(o for _, o in reqs)
    prompt_tokens = sum(len(p) for p, _ in reqs)
    print(f"workload: {len(reqs)} requests, {prompt_tokens} prompt tokens, {out_tokens} output tokens")

    # In-process first, then free its memory before the mesh starts.
    llm = LLM(max_num_seqs=args.max_num_seqs)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    llm.generate([{"prompt_token_ids": reqs[0][0][:16]}], SamplingParams(max_tokens=2), use_tqdm=False)
    steps0 = llm.engine.num_steps
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    local_dt = time.perf_counter() - t0
    local_steps = llm.engine.num_steps - steps0
    llm.engine.close()  # its threads too: left running, they took CPU from the mesh's worker
    del llm

    with tempfile.TemporaryDirectory() as logs:
        sched_args = ["--max-num-seqs", str(args.max_num_seqs)]
        worker_args = ["--kv-cache-memory", str(128 << 20)] if args.smoke else []
        with start_mesh(1, scheduler_args=sched_args, worker_args=worker_args, log_dir=logs) as mesh:
            mesh_dt, mesh_tokens = asyncio.run(run_mesh_clients(mesh.scheduler.address, reqs))
            from llmesh.v1 import worker_pb2, worker_pb2_grpc
            from services.grpc_server import open_sync_channel

            with open_sync_channel(mesh.scheduler.address, mesh.security) as channel:  # the mesh's secret
                stats = worker_pb2_grpc.RegistryStub(channel).GetStats(worker_pb2.GetStatsRequest())
    assert mesh_tokens == out_tokens, (mesh_tokens, out_tokens)
    w = stats.workers[0]
    local_step_ms = 1000 * local_dt / local_steps
    mesh_step_ms = 1000 * w.step_seconds / w.steps
    print(f"\n{'path':<14}{'time s':>9}{'out tok/s':>11}{'steps':>8}{'ms/step':>10}")
    for name, dt, steps, step_ms in (
        ("in-process", local_dt, local_steps, local_step_ms),
        ("mesh (gRPC)", mesh_dt, w.steps, mesh_step_ms),
    ):
        print(f"{name:<14}{dt:>9.2f}{out_tokens / dt:>11.1f}{steps:>8}{step_ms:>10.2f}")
    print(f"\nmesh / in-process throughput: {local_dt / mesh_dt:.1%}")
    print(f"per-step overhead (mesh round trip - in-process step): {mesh_step_ms - local_step_ms:.2f} ms")


if __name__ == "__main__":
    main()
