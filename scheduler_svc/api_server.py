"""`llmesh scheduler --api-server-count N`: N API processes in front of the scheduler core.

The core (the scheduler process) plans and steps the workers; it listens on a
loopback port of its own. Each API process binds the scheduler's public port
(gRPC sets SO_REUSEPORT, so the kernel spreads connections over them), serves
the public `llmesh.v1.Scheduler` API with the same `SchedulerServicer` the core
runs (tokenizing, stop strings, detokenizing, one stream per caller), and
reaches the core through a `CoreClient`: one Serve stream, one message per step
(protos/llmesh/v1/core.proto). Workers register at the public address as
before: an API process forwards `Registry` calls to the core, and a router's `KVEvents` stream.

The kernel hands each *connection* to one API process, by a hash: a caller that wants its streams
even over the processes must know which one each of its connections reached. `GetModelInfo` says
so in its initial metadata (`x-llmesh-api-process`: this process's id; `x-llmesh-api-processes`:
how many the shard has), and gateway/shard_routing.py's `ShardChannels` asks it once per
connection. Generate itself carries nothing more (no per-token cost).

The core starts the processes (`python -m scheduler_svc.api_server`, the core's
config as JSON in their environment, secrets included: never argv), restarts
one that dies (with a backoff), and they leave when it does (LLMESH_LAUNCHER_PID).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc

from llmesh.v1 import generation_pb2_grpc, router_pb2_grpc, worker_pb2_grpc
from scheduler_svc.core_client import CoreClient
from scheduler_svc.servicer import ModelCard, SchedulerServicer
from services.api_processes import PROCESS_KEY, PROCESSES_KEY
from services.grpc_server import ChannelSecurity, GrpcServer, Service, open_channel, serve
from services.parent_watch import launcher_env

log = logging.getLogger(__name__)

CONFIG_ENV = "LLMESH_SCHEDULER_API_CONFIG"  # the core's config, as JSON, for its API processes
COUNT_ENV = "LLMESH_SCHEDULER_API_COUNT"  # how many API processes the core runs (said to callers)
QUICK_EXIT_S = 10.0  # an API process that dies sooner than this after its start failed to start
RESTART_MAX_S = 30.0


class RegistryProxy(worker_pb2_grpc.RegistryServicer):
    """Workers register at the public address: their calls go on to the core."""

    def __init__(self, core_address: str, security: ChannelSecurity) -> None:
        self._channel = open_channel(core_address, security)
        self._core = worker_pb2_grpc.RegistryStub(self._channel)

    async def RegisterWorker(self, request, context):
        return await self._forward(self._core.RegisterWorker, request, context)

    async def GetStats(self, request, context):
        return await self._forward(self._core.GetStats, request, context)

    @staticmethod
    async def _forward(method, request, context):
        try:
            return await method(request, timeout=context.time_remaining())
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), f"scheduler core: {e.details()}")

    async def close(self) -> None:
        await self._channel.close()


class KVEventsProxy(router_pb2_grpc.KVEventsServicer):
    """A router subscribes at the public address: the core's KV event stream, relayed."""

    def __init__(self, registry: RegistryProxy) -> None:
        self._core = router_pb2_grpc.KVEventsStub(registry._channel)

    async def Subscribe(self, request, context):
        try:
            async for batch in self._core.Subscribe(request, timeout=context.time_remaining()):
                yield batch
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), f"scheduler core: {e.details()}")


class ApiSchedulerServicer(SchedulerServicer):
    """The public API as an API process serves it: GetModelInfo also names the process."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        count = os.environ.get(COUNT_ENV, "")
        self._who = ((PROCESS_KEY, str(os.getpid())), *([(PROCESSES_KEY, count)] if count else []))

    async def GetModelInfo(self, request, context):
        # Sent before the answer, so that a refusal (no worker yet) names the process too.
        await context.send_initial_metadata(self._who)
        return await super().GetModelInfo(request, context)


async def run_api_server(
    config: Any, card: ModelCard, load_tokenizer: Callable[[Any], tuple[Any, int]]
) -> None:
    """Serve the public API on `config.port` for the core at `config.core_address`."""
    security = ChannelSecurity.of(config, config.internal_key)
    core = CoreClient(config.core_address, security)
    scheduler = ApiSchedulerServicer(core, card, config)  # type: ignore[arg-type]
    registry = RegistryProxy(config.core_address, security)
    health_updates: set[asyncio.Task] = set()
    # Ready before it binds: the kernel hands a process connections as soon as it listens, so
    # one still starting (restarted, say) would answer its callers UNAVAILABLE.
    background = [asyncio.ensure_future(core.run())]
    if not config.no_tokenizer:
        scheduler.set_tokenizer(*await asyncio.to_thread(load_tokenizer, config))
    await core.attached.wait()

    async def on_started(server: GrpcServer) -> None:
        def health(_: int = 0) -> None:
            # SERVING while the core has a connected worker, as the core's own health says.
            task = asyncio.ensure_future(server.set_serving(core.num_connected > 0))
            health_updates.add(task)
            task.add_done_callback(health_updates.discard)

        core.on_workers_changed.append(health)
        health()
        print(f"llmesh scheduler api process {os.getpid()} on {config.host}:{server.port}", flush=True)

    services = [
        Service.of("llmesh.v1.Scheduler", generation_pb2_grpc.add_SchedulerServicer_to_server, scheduler),
        Service.of("llmesh.v1.Registry", worker_pb2_grpc.add_RegistryServicer_to_server, registry),
        Service.of(
            "llmesh.v1.KVEvents", router_pb2_grpc.add_KVEventsServicer_to_server, KVEventsProxy(registry)
        ),
    ]
    try:
        await serve(
            services, config, on_started=on_started, set_serving=False,
            public_keys={"llmesh.v1.Scheduler": config.api_key}, reuse_port=True,
        )  # fmt: skip
    finally:
        for task in background:
            task.cancel()
        await registry.close()


class ApiServers:
    """The core's API processes: started, restarted when one dies, stopped with the core."""

    def __init__(self, config: Any, core_address: str, public_port: int) -> None:
        child = flat_values(config)
        child.update(core_address=core_address, port=public_port, api_server_count=0)
        env = {**os.environ, CONFIG_ENV: json.dumps(child, default=str)}
        self._env = launcher_env({**env, COUNT_ENV: str(config.api_server_count)})
        self.count = config.api_server_count
        self._procs: list[subprocess.Popen] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._procs = [self._spawn() for _ in range(self.count)]
        self._task = asyncio.ensure_future(self._supervise())

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "scheduler_svc.api_server"], env=self._env)

    async def _supervise(self) -> None:
        started = [time.monotonic()] * self.count
        quick = [0] * self.count
        # Each dead process waits out its own backoff: one that keeps failing delays no other's restart.
        restart_at: list[float | None] = [None] * self.count
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for i, proc in enumerate(self._procs):
                if restart_at[i] is None:
                    rc = proc.poll()
                    if rc is None:
                        continue
                    quick[i] = quick[i] + 1 if now - started[i] < QUICK_EXIT_S else 0
                    delay = min(2.0 ** quick[i] - 1, RESTART_MAX_S)
                    log.warning(
                        "scheduler api process exited; restarting", extra={"code": rc, "delay_s": delay}
                    )
                    restart_at[i] = now + delay
                if now >= restart_at[i]:  # type: ignore[operator]
                    self._procs[i], started[i], restart_at[i] = self._spawn(), now, None

    async def stop(self, grace_s: float = 10.0) -> None:
        if self._task is not None:
            self._task.cancel()
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()  # each drains its streams
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                proc.kill()


def flat_values(config: Any) -> dict[str, Any]:
    """A config's knobs by name, nested configs' too (`services.config.from_flat` builds it back)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(flat_values(value))
        else:
            out[f.name] = value
    return out


def main() -> int:
    from scheduler_svc.service import SchedulerServiceConfig, run
    from services.config import from_flat
    from services.logging_setup import setup_logging
    from services.parent_watch import watch_launcher

    config = from_flat(SchedulerServiceConfig, json.loads(os.environ.pop(CONFIG_ENV)))
    setup_logging("scheduler-api", config.log_level)
    watch_launcher()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
