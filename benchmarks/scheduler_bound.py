"""The scheduler's ceiling: the mesh with a worker that costs nothing (`null_worker.py`).

    .venv/bin/python benchmarks/scheduler_bound.py [--concurrency 16 64 256] [--num-requests 512]
        [--prompt-len 128] [--output-len 128] [--client-procs 2] [--gateway] [--stream-interval 1]
        [--api-server-count N] [--workers M] [--max-waiting-requests N] [--cost-model none|h100-8b]

A real scheduler service and a real worker service whose runner samples instantly, driven by
streaming gRPC clients (and, with --gateway, the OpenAI gateway): every second of a run is the
scheduler's planning and per-token work, the Step stream, the response streams and the clients.
Its out tok/s bound what the mesh can deliver for any model, and show where the host, not the
GPU, limits a small model (issue 17's 0.5B shape) or a large batch. The scheduler's own steps
are reported too (GetStats: steps and the mean send -> result time of a plan).

`--cost-model h100-8b` gives the null workers the step times of an H100 running Llama-3.1-8B
(`benchmarks/step_cost.py`): out tok/s are then bounded by the simulated GPUs, and routing and
scale-out over many workers can be measured on one host.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from null_worker import VOCAB  # noqa: E402
from serving import Clients, _wait_http, make_prompts, report, table  # noqa: E402
from step_cost import COST_MODELS  # noqa: E402

from services.grpc_server import open_sync_channel
from services.launcher import free_port, grpc_serving, wait_until  # noqa: E402


def scheduler_stats(address: str):

    from llmesh.v1 import worker_pb2, worker_pb2_grpc

    with open_sync_channel(address) as channel:
        return worker_pb2_grpc.RegistryStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gateway", action="store_true", help="also through the OpenAI gateway")
    ap.add_argument("--stream-interval", type=int, default=1, help="the scheduler's --stream-interval")
    ap.add_argument(
        "--api-server-count",
        type=int,
        default=0,
        help="the scheduler's API processes in front of its core (0: the core serves callers itself)",
    )
    ap.add_argument("--workers", type=int, default=1, help="null workers behind the scheduler")
    ap.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="the scheduler's admission bound (default: its own); requests it refuses are counted "
        "as refused, not failed",
    )
    ap.add_argument(
        "--cost-model",
        choices=list(COST_MODELS),
        default="none",
        help="the null workers' step times (benchmarks/step_cost.py); none: they answer at once",
    )
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--smoke", action="store_true", help="a few tiny requests at one concurrency (make test)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.concurrency, args.num_requests, args.prompt_len, args.output_len = [4], 8, 8, 4
        args.client_procs, args.max_num_seqs, args.timeout = 1, 8, 60.0

    host = "127.0.0.1"
    sched = f"{host}:{free_port(host)}"
    here = os.path.dirname(os.path.abspath(__file__))
    procs: list[subprocess.Popen] = []
    rows = []
    clients = Clients(args.client_procs)
    with tempfile.TemporaryDirectory() as logs:
        try:
            limits = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", "16384"]
            limits += ["--stream-interval", str(args.stream_interval)]
            limits += ["--api-server-count", str(args.api_server_count)]
            if args.max_waiting_requests is not None:
                limits += ["--max-waiting-requests", str(args.max_waiting_requests)]
            with open(os.path.join(logs, "scheduler.log"), "wb") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "scheduler_svc.service", "--host", host,
                     "--port", sched.rsplit(":", 1)[1], "--no-tokenizer", *limits],
                    stdout=out, stderr=subprocess.STDOUT,
                ))  # fmt: skip
            for w in range(args.workers):
                with open(os.path.join(logs, f"worker{w}.log"), "wb") as out:
                    procs.append(subprocess.Popen(
                        [sys.executable, os.path.join(here, "null_worker.py"), "--host", host,
                         "--port", str(free_port(host)), "--scheduler", sched, "--worker-id", f"null-{w}",
                         "--max-num-seqs", str(args.max_num_seqs), "--cost-model", args.cost_model],
                        stdout=out, stderr=subprocess.STDOUT,
                    ))  # fmt: skip
            wait_until(lambda: grpc_serving(sched), "scheduler", procs, 120)
            wait_until(
                lambda: len(scheduler_stats(sched).workers) >= args.workers, "the null workers", procs, 120
            )
            targets = [("grpc", sched)]
            if args.gateway:
                gw = f"{host}:{free_port(host)}"
                with open(os.path.join(logs, "gateway.log"), "wb") as out:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "gateway.service", "--host", host,
                         "--port", gw.rsplit(":", 1)[1], "--scheduler", sched],
                        stdout=out, stderr=subprocess.STDOUT,
                    ))  # fmt: skip
                _wait_http(f"http://{gw}", procs[-1])
                targets.append(("gateway", f"http://{gw}"))
            prompts = make_prompts(args.num_requests, args.prompt_len, VOCAB, seed=0)
            for concurrency in args.concurrency:
                for kind, target in targets:
                    before = scheduler_stats(sched).workers
                    results, wall = clients.run(
                        kind, target, prompts, args.output_len, concurrency, args.timeout
                    )
                    after = scheduler_stats(sched).workers
                    row = report(kind, concurrency, results, wall)
                    steps = sum(a.steps for a in after) - sum(b.steps for b in before)
                    seconds = sum(a.step_seconds for a in after) - sum(b.step_seconds for b in before)
                    row["steps_s"] = steps / wall
                    row["plan_ms"] = 1000 * seconds / max(steps, 1)
                    rows.append(row)
                    print(
                        f"{kind} x{concurrency}: {row['tok_s']:,.0f} out tok/s, "
                        f"{row['steps_s']:,.0f} steps/s, "
                        f"{row['plan_ms']:.2f} ms send->result per plan, {row['failed']} failed, "
                        f"{row['refused']} refused",
                        flush=True,
                    )
        except BaseException:
            for name in sorted(os.listdir(logs)):  # the services' own words on why
                with open(os.path.join(logs, name), errors="replace") as f:
                    print(f"--- {name} (last lines)\n" + "".join(f.readlines()[-20:]), file=sys.stderr)
            raise
        finally:
            clients.close()
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
    print()
    print(table(rows, None))
    print(f"\n{'clients':>8}{'steps/s':>10}{'ms/plan':>9}   (scheduler GetStats)")
    for r in rows:
        if r["path"] == "grpc":
            print(f"{r['concurrency']:>8}{r['steps_s']:>10,.0f}{r['plan_ms']:>9.2f}")
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
