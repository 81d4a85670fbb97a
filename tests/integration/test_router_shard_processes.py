"""A scheduler shard as processes behind a router that knows nothing of it at start: the shard
(with 2 API processes in front of its core) registers itself (`--routers`), the router subscribes
to its KV events through the API processes, and a repeated prefix is served from cache. A null
worker (benchmarks/null_worker.py): no model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from services.grpc_server import open_sync_channel
from services.launcher import free_port, grpc_serving, wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_a_shard_with_api_processes_registers_and_routes_by_prefix(tmp_path):
    host = "127.0.0.1"
    shard, router = f"{host}:{free_port(host)}", f"{host}:{free_port(host)}"
    commands = {
        "shard": ["-m", "scheduler_svc.service", "--port", shard.split(":")[1], "--no-tokenizer",
                  "--api-server-count", "2", "--routers", router, "--shard-id", "only"],
        "worker": [str(ROOT / "benchmarks" / "null_worker.py"), "--port", str(free_port(host)),
                   "--scheduler", shard, "--worker-id", "w0"],
        "router": ["-m", "router_svc.service", "--port", router.split(":")[1]],
    }  # fmt: skip
    procs = []
    for name, args in commands.items():
        with open(tmp_path / f"{name}.log", "wb") as out:
            procs.append(subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT))
    try:
        wait_until(lambda: grpc_serving(router), "the router with its registered shard", procs, 120)
        prefix = list(range(100, 164))
        with open_sync_channel(router) as channel:
            stub = gg.SchedulerStub(channel)
            cached = []
            for i in range(3):
                req = g.GenerateRequest(
                    prompt_token_ids=g.TokenIds(ids=[*prefix, i]),
                    sampling_params=g.SamplingParams(max_tokens=4, ignore_eos=True),
                )
                last = list(stub.Generate(req, timeout=30))[-1]
                cached.append(last.usage.cached_prompt_tokens)
        assert cached[0] == 0 and cached[1:] == [64, 64]
    except BaseException:
        for name in commands:
            print(f"--- {name}\n" + (tmp_path / f"{name}.log").read_text(errors="replace")[-2000:])
        raise
    finally:
        for p in reversed(procs):  # the router and the worker before the shard they talk to
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:  # draining is not what this test checks (it once
                p.kill()  # outlived 30 s: the null worker waits out its grace for a shard gone)
                p.wait()
