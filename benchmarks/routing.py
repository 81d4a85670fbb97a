"""Routing across scheduler shards: round-robin, load only, and the KV-event prefix index.

    .venv/bin/python benchmarks/routing.py                       # the full run (16-core host)
    .venv/bin/python benchmarks/routing.py --smoke               # tiny, every policy (make test)
    [--tenants 64] [--context-len 4096] [--question-len 512] [--output-len 64] [--rate 80]
    [--num-requests 2400] [--shards 4] [--workers 8] [--kv-tokens-per-worker 65536]
    [--client-procs 4] [--policies index load round-robin]

A prefix-heavy multi-tenant workload (llm-d's "shared prefix" benchmark): every tenant has a long
context of its own (a system prompt, documents), every request is one tenant's context plus a
fresh question, arriving as a Poisson process. The mesh: `--shards` scheduler shards, `--workers`
null workers split among them, each simulating an H100 running Llama-3.1-8B
(`null_worker.py --cost-model h100-8b`: prefill time per uncached token, decode time by batch),
and one router per policy in front of the same shards (`router_svc --policy`). Each policy runs
with its own cache salt, so it starts from caches as cold as the first one did.

The workers' caches hold `--kv-tokens-per-worker` tokens: all tenants' contexts together
(64 x 4k = 262k tokens) are 4x one worker's cache, a quarter of the cluster's: a router that keeps
each tenant on one shard serves almost every context from cache, one that spreads tenants over
every worker recomputes most of them (as llm-d's 150 tenants x 6k tokens over 16 H100s).

Reported per policy: TTFT P50/P90 (send -> first token), output tokens per second and requests per
second over the run (first send -> last finish), the prompt tokens served from cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.launcher import free_port, grpc_serving, wait_until  # noqa: E402

VOCAB = 49152
HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Workload:
    tenants: int
    context_len: int
    question_len: int
    output_len: int
    rate: float  # requests per second over all client processes
    num_requests: int
    seed: int = 0


def tenant_context(tenant: int, length: int) -> list[int]:
    rng = random.Random(1_000_003 * (tenant + 1))
    return [rng.randrange(100, VOCAB) for _ in range(length)]


# ----- one client process: Poisson arrivals, one stream per request, JSON results on stdout -----
async def _client(spec: dict) -> dict:
    import grpc

    from llmesh.v1 import generation_pb2 as g
    from llmesh.v1 import generation_pb2_grpc as gg
    from services.grpc_server import open_channel

    w = Workload(**spec["workload"])
    rng = random.Random(spec["seed"])
    contexts = [tenant_context(t, w.context_len) for t in range(w.tenants)]
    channel = open_channel(spec["target"])
    stub = gg.SchedulerStub(channel)
    ttfts: list[float] = []
    ends: list[float] = []
    errors: list[str] = []
    cached = [0]
    out_tokens = [0]

    async def one(prompt: list[int]) -> None:
        req = g.GenerateRequest(
            prompt_token_ids=g.TokenIds(ids=prompt),
            sampling_params=g.SamplingParams(max_tokens=w.output_len, ignore_eos=True, temperature=0),
            cache_salt=spec["salt"],
        )
        sent = time.time()
        first = None
        try:
            async for resp in stub.Generate(req, timeout=spec["timeout"]):
                if first is None and resp.token_ids:
                    first = time.time()
                out_tokens[0] += len(resp.token_ids)
                if resp.HasField("usage"):
                    cached[0] += resp.usage.cached_prompt_tokens
        except grpc.aio.AioRpcError as e:
            errors.append(e.code().name)
            return
        ttfts.append((first or time.time()) - sent)
        ends.append(time.time())

    tasks = []
    start = time.time()
    for _ in range(spec["count"]):
        await asyncio.sleep(rng.expovariate(spec["rate"]))
        tenant = rng.randrange(w.tenants)
        question = [rng.randrange(100, VOCAB) for _ in range(w.question_len)]
        tasks.append(asyncio.ensure_future(one(contexts[tenant] + question)))
    await asyncio.gather(*tasks)
    await channel.close()
    return {
        "ttft": ttfts,
        "start": start,
        "end": max(ends, default=time.time()),
        "errors": errors,
        "cached": cached[0],
        "out_tokens": out_tokens[0],
    }


def run_clients(target: str, workload: Workload, procs: int, salt: str, timeout: float) -> dict:
    """`procs` client processes, each a Poisson process of rate/procs (together: rate)."""
    spec = {"workload": workload.__dict__, "target": target, "salt": salt, "timeout": timeout}
    children = []
    for p in range(procs):
        count = workload.num_requests // procs + (p < workload.num_requests % procs)
        mine = {**spec, "seed": workload.seed * 1000 + p, "count": count, "rate": workload.rate / procs}
        children.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--client-spec", json.dumps(mine)],
                stdout=subprocess.PIPE,
            )
        )
    parts = [json.loads(c.communicate()[0]) for c in children]
    return {
        "ttft": sorted(t for p in parts for t in p["ttft"]),
        "wall": max(p["end"] for p in parts) - min(p["start"] for p in parts),
        "errors": [e for p in parts for e in p["errors"]],
        "cached": sum(p["cached"] for p in parts),
        "out_tokens": sum(p["out_tokens"] for p in parts),
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


# ----- the mesh -----
@dataclass
class Mesh:
    procs: list[subprocess.Popen]
    routers: dict[str, str]  # policy -> address
    shards: list[str]


def start(args: argparse.Namespace, logs: str) -> Mesh:
    host = "127.0.0.1"
    procs: list[subprocess.Popen] = []

    env = {**os.environ, "LLMESH_NULL_COST_SCALE": str(args.cost_scale)}

    def spawn(name: str, cmd: list[str]) -> None:
        with open(os.path.join(logs, f"{name}.log"), "wb") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))

    shards = [f"{host}:{free_port(host)}" for _ in range(args.shards)]
    limits = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", "8192"]
    limits += ["--stream-interval", str(args.stream_interval), "--max-waiting-requests", "0"]
    for i, address in enumerate(shards):
        spawn(f"shard{i}", [sys.executable, "-m", "scheduler_svc.service", "--host", host,
                            "--port", address.rsplit(":", 1)[1], "--no-tokenizer", *limits])  # fmt: skip
    blocks = args.kv_tokens_per_worker // args.block_size
    for w in range(args.workers):
        spawn(f"worker{w}", [
            sys.executable, os.path.join(HERE, "null_worker.py"), "--host", host,
            "--port", str(free_port(host)), "--scheduler", shards[w % args.shards],
            "--worker-id", f"null-{w}", "--max-num-seqs", str(args.max_num_seqs),
            "--num-kv-blocks", str(blocks), "--block-size", str(args.block_size),
            "--max-model-len", str(args.context_len + args.question_len + args.output_len + 64),
            "--cost-model", args.cost_model,
        ])  # fmt: skip
    routers = {}
    for policy in args.policies:
        address = f"{host}:{free_port(host)}"
        spawn(f"router-{policy}", [sys.executable, "-m", "router_svc.service", "--host", host,
                                   "--port", address.rsplit(":", 1)[1], "--shards", ",".join(shards),
                                   "--policy", policy, "--load-interval-ms", "20",
                                   *args.router_args])  # fmt: skip
        routers[policy] = address
    mesh = Mesh(procs, routers, shards)
    for address in [*shards, *routers.values()]:
        wait_until(lambda a=address: grpc_serving(a), address, procs, 300)
    wait_until(lambda: workers_in(shards) >= args.workers, "the null workers", procs, 300)
    return mesh


def shard_stats(address: str):
    from llmesh.v1 import worker_pb2, worker_pb2_grpc
    from services.grpc_server import open_sync_channel

    with open_sync_channel(address) as channel:
        return worker_pb2_grpc.RegistryStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=10)


def workers_in(shards: list[str]) -> int:
    return sum(sum(w.connected for w in shard_stats(s).workers) for s in shards)


def idle(shards: list[str]) -> bool:
    return all(shard_stats(s).active_requests == 0 for s in shards)


def stop(mesh: Mesh) -> None:
    for p in mesh.procs:
        p.terminate()
    for p in mesh.procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=64)
    ap.add_argument("--context-len", type=int, default=4096)
    ap.add_argument("--question-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rate", type=float, default=80.0, help="requests per second (Poisson)")
    ap.add_argument("--num-requests", type=int, default=2400)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--kv-tokens-per-worker", type=int, default=65536)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument(
        "--stream-interval", type=int, default=16, help="the shards' (the first token is never held)"
    )
    ap.add_argument("--cost-model", default="h100-8b")
    ap.add_argument(
        "--cost-scale",
        type=float,
        default=1.0,
        help="every step takes this many times the cost model's time: a slower GPU, so that a small "
        "host can drive the workers to their limits at a lower request rate (development runs)",
    )
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--router-args", nargs="*", default=[], help="more flags for every router")
    ap.add_argument("--policies", nargs="+", default=["round-robin", "load", "index"])
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument(
        "--smoke", action="store_true", help="tiny: 2 shards, 2 workers, every policy (make test)"
    )
    ap.add_argument("--client-spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client_spec:
        print(json.dumps(asyncio.run(_client(json.loads(args.client_spec)))))
        return 0
    if args.smoke:
        args.tenants, args.context_len, args.question_len, args.output_len = 4, 128, 32, 4
        args.rate, args.num_requests, args.shards, args.workers = 20.0, 16, 2, 2
        args.kv_tokens_per_worker, args.client_procs, args.timeout = 4096, 1, 60.0
    workload = Workload(
        args.tenants, args.context_len, args.question_len, args.output_len, args.rate, args.num_requests
    )
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        mesh = None
        try:
            mesh = start(args, logs)
            for n, policy in enumerate(args.policies):
                wait_until(lambda: idle(mesh.shards), "the shards to drain", mesh.procs, 600)
                res = run_clients(mesh.routers[policy], workload, args.client_procs, f"run-{n}", args.timeout)
                done = len(res["ttft"])
                prompt_tokens = done * (args.context_len + args.question_len)
                row = {
                    "policy": policy,
                    "done": done,
                    "failed": len(res["errors"]),
                    "ttft_p50": pct(res["ttft"], 0.5),
                    "ttft_p90": pct(res["ttft"], 0.9),
                    "tok_s": res["out_tokens"] / res["wall"],
                    "req_s": done / res["wall"],
                    "cached": res["cached"] / max(prompt_tokens, 1),
                }
                rows.append(row)
                print(
                    f"{policy}: P90 TTFT {row['ttft_p90']:.3f} s, {row['tok_s']:,.0f} out tok/s, "
                    f"{row['req_s']:.1f} req/s, {100 * row['cached']:.0f}% of prompt tokens cached, "
                    f"{row['failed']} failed",
                    flush=True,
                )
        except BaseException:
            for name in sorted(os.listdir(logs)):
                with open(os.path.join(logs, name), errors="replace") as f:
                    print(f"--- {name} (last lines)\n" + "".join(f.readlines()[-20:]), file=sys.stderr)
            raise
        finally:
            if mesh is not None:
                stop(mesh)
    print()
    print(
        f"{args.tenants} tenants x {args.context_len}-token contexts, {args.question_len}-token questions, "
        f"{args.output_len} out, {args.rate:g} req/s Poisson, {args.num_requests} requests; "
        f"{args.workers} null workers ({args.cost_model} x{args.cost_scale:g}, "
        f"{args.kv_tokens_per_worker} KV tokens each) "
        f"over {args.shards} shards"
    )
    print(f"{'policy':<12}{'done':>6}{'failed':>7}{'TTFT P50 s':>11}{'TTFT P90 s':>11}"
          f"{'out tok/s':>10}{'req/s':>7}{'cached':>8}")  # fmt: skip
    for r in rows:
        print(
            f"{r['policy']:<12}{r['done']:>6}{r['failed']:>7}{r['ttft_p50']:>11.3f}{r['ttft_p90']:>11.3f}"
            f"{r['tok_s']:>10,.0f}{r['req_s']:>7.1f}{100 * r['cached']:>7.0f}%"
        )
    by = {r["policy"]: r for r in rows}
    if {"index", "round-robin", "load"} <= by.keys():
        idx, rr, load = by["index"], by["round-robin"], by["load"]
        print(
            f"\nindex vs round-robin: P90 TTFT {rr['ttft_p90'] / idx['ttft_p90']:.1f}x better, "
            f"throughput {idx['tok_s'] / rr['tok_s']:.2f}x; vs load only: P90 TTFT "
            f"{load['ttft_p90'] / idx['ttft_p90']:.1f}x better"
        )
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
