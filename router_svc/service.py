"""`llmesh router`: the front door of many scheduler shards (router.proto, docs/architecture.md)."""

from __future__ import annotations

import asyncio
import sys

from llmesh.v1 import router_pb2_grpc, worker_pb2_grpc
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
from services.grpc_server import ChannelSecurity, GrpcServer, Service, serve, service_main


async def run(config: RouterConfig) -> None:
    router = Router(config.view)
    # The router calls its shards' public API and KV events with the mesh's internal key.
    pool = ShardPool(router, config, ChannelSecurity.of(config, config.internal_key))
    health_updates: set[asyncio.Task] = set()

    async def on_started(server: GrpcServer) -> None:
        def health() -> None:  # SERVING while some shard would take a request
            task = asyncio.ensure_future(server.set_serving(bool(router.ready_shards)))
            health_updates.add(task)
            task.add_done_callback(health_updates.discard)

        pool.on_change.append(health)
        for address in config.shards:
            pool.add(address)
        pool.start_dns()
        print(f"llmesh router listening on {config.host}:{server.port}", flush=True)

    services = [
        Service.of("llmesh.v1.Scheduler", add_router_to_server, RouterServicer(router, pool)),
        Service.of("llmesh.v1.ShardRegistry", router_pb2_grpc.add_ShardRegistryServicer_to_server,
                   ShardRegistryServicer(pool)),
        Service.of("llmesh.v1.ShardPicker", router_pb2_grpc.add_ShardPickerServicer_to_server,
                   ShardPickerServicer(router)),
        Service.of("llmesh.v1.Registry", worker_pb2_grpc.add_RegistryServicer_to_server,
                   RouterRegistryServicer(pool)),
    ]  # fmt: skip
    # The public API takes the API key (or the internal key); ShardRegistry, ShardPicker and Registry
    # only the latter (Route names the shards' addresses: the mesh's topology).
    keys = {"llmesh.v1.Scheduler": config.api_key}
    try:
        await serve(
            services, config, on_started=on_started, set_serving=False, public_keys=keys,
            reuse_port=config.reuse_port,
        )  # fmt: skip
    finally:
        await pool.close()


def main(argv: list[str] | None = None) -> int:
    return service_main(RouterConfig, run, "router", argv)


if __name__ == "__main__":
    sys.exit(main())
