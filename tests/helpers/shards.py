"""Scheduler shards and a router on loopback, in the test's event loop: real gRPC servers, real
`Mesh`es over counting workers (tests/unit/scheduler_svc/test_planner.py), no model."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from llmesh.local_link import LocalWorkerLink
from llmesh.v1 import generation_pb2_grpc, router_pb2_grpc, worker_pb2_grpc
from router_svc.config import RouterConfig
from router_svc.core import Router
from router_svc.picker import ShardPickerServicer
from router_svc.servicer import (
    RouterRegistryServicer,
    RouterServicer,
    ShardRegistryServicer,
    add_router_to_server,
)
from router_svc.shards import ShardPool
from scheduler_svc.kv_events import KVEventLog
from scheduler_svc.kv_events_servicer import KVEventsServicer, pool_load
from scheduler_svc.mesh import Mesh, MeshConfig
from scheduler_svc.planner import PlannerConfig
from scheduler_svc.servicer import ModelCard, RegistryServicer, SchedulerServicer
from services.grpc_server import PLAINTEXT
from services.step import StepPlan, StepResult, WorkerInfo
from tests.unit.scheduler_svc.test_planner import CountingWorker

INFO = WorkerInfo(
    "m", b"fp", block_size=4, num_kv_blocks=400, max_model_len=1024, vocab_size=100, eos_token_ids=[]
)


class SlowLink(LocalWorkerLink):
    """A counting worker whose steps take `step_s` (so a test can act while requests stream)."""

    def __init__(self, worker: CountingWorker, step_s: float) -> None:
        self.step_s = step_s
        super().__init__(self._slow, INFO, worker.seqs.clear)
        self._worker = worker

    def _slow(self, plan: StepPlan) -> StepResult:
        time.sleep(self.step_s)
        return self._worker.execute(plan)


@dataclass
class ShardUnderTest:
    name: str
    mesh: Mesh
    server: grpc.aio.Server
    port: int
    workers: list[CountingWorker] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.server.stop(0)
        for wid in list(self.mesh.workers):
            await self.mesh.remove_worker(wid)


async def start_shard(
    name: str, num_workers: int = 1, step_s: float = 0.0, port: int = 0, max_waiting_requests: int = 1024
) -> ShardUnderTest:
    planner = PlannerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024)
    mesh = Mesh(MeshConfig(planner=planner, max_waiting_requests=max_waiting_requests))
    mesh.kv_events = KVEventLog(name, load=lambda: pool_load(mesh))
    shard = ShardUnderTest(name, mesh, grpc.aio.server(), 0)
    for i in range(num_workers):
        worker = CountingWorker()
        shard.workers.append(worker)
        link = (
            SlowLink(worker, step_s) if step_s else LocalWorkerLink(worker.execute, INFO, worker.seqs.clear)
        )
        mesh.add_worker(f"{name}-w{i}", INFO, link)
    generation_pb2_grpc.add_SchedulerServicer_to_server(
        SchedulerServicer(mesh, ModelCard("m", "m")), shard.server
    )
    worker_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(mesh), shard.server)
    router_pb2_grpc.add_KVEventsServicer_to_server(KVEventsServicer(mesh.kv_events), shard.server)
    shard.port = shard.server.add_insecure_port(f"127.0.0.1:{port}")
    await shard.server.start()
    return shard


@dataclass
class RouterUnderTest:
    router: Router
    pool: ShardPool
    servicer: RouterServicer
    server: grpc.aio.Server
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def wait_ready(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.router.ready_shards) < n:
            assert time.monotonic() < deadline, f"{len(self.router.ready_shards)} of {n} shards ready"
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        await self.server.stop(0)
        await self.pool.close()


async def start_router(addresses: list[str], policy: str = "index", **kw) -> RouterUnderTest:
    config = RouterConfig(
        shards=addresses,
        policy=policy,
        internal_key="test-key-0123456789",
        shard_dead_after_s=2.0,
        load_interval_ms=20,
        **kw,
    )
    router = Router(config.view)
    pool = ShardPool(router, config, PLAINTEXT)
    servicer = RouterServicer(router, pool)
    server = grpc.aio.server()
    add_router_to_server(servicer, server)
    router_pb2_grpc.add_ShardRegistryServicer_to_server(ShardRegistryServicer(pool), server)
    router_pb2_grpc.add_ShardPickerServicer_to_server(ShardPickerServicer(router), server)
    worker_pb2_grpc.add_RegistryServicer_to_server(RouterRegistryServicer(pool), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    for address in addresses:
        pool.add(address, address)
    pool.start_dns()
    return RouterUnderTest(router, pool, servicer, server, port)
