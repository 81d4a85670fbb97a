"""`llmesh worker`: load the model, serve the Worker API, register with the scheduler."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import sys
from dataclasses import dataclass

import grpc

from llmesh.v1 import worker_pb2, worker_pb2_grpc
from services.config import option
from services.grpc_server import (
    GrpcServer,
    ServerConfig,
    Service,
    host_port,
    insecure_channel,
    serve,
    service_main,
)
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner
from worker_svc.servicer import WorkerServicer

log = logging.getLogger(__name__)


@dataclass
class WorkerServiceConfig(ServerConfig, WorkerConfig):
    """A worker service: the model runner's settings plus where to listen and whom to join."""

    scheduler: str = option("", help="scheduler host:port to register with (empty = wait to be dialled)")
    worker_id: str = option("", help="stable id of this worker (default: hostname-pid)")
    advertise: str = option("", help="host:port the scheduler dials back (default: host:bound port)")
    log_level: str = option("info", help="debug | info | warning | error")


async def register_forever(scheduler: str, address: str, worker_id: str) -> None:
    """Announce this worker until the scheduler accepts; scheduler restarts are handled by re-running."""
    delay = 0.2
    async with insecure_channel(scheduler) as channel:
        stub = worker_pb2_grpc.RegistryStub(channel)
        while True:
            try:
                resp = await stub.RegisterWorker(
                    worker_pb2.RegisterWorkerRequest(address=address, worker_id=worker_id), timeout=10
                )
                if resp.accepted:
                    log.info("registered with scheduler", extra={"scheduler": scheduler})
                    return
                log.warning("scheduler refused registration", extra={"reason": resp.message})
            except grpc.aio.AioRpcError as e:
                log.info("scheduler not reachable yet", extra={"code": e.code().name})
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


def _reachable_host(host: str) -> str:
    """A wildcard bind is no address to dial back: advertise the hostname (a container's DNS name)."""
    try:
        if ipaddress.ip_address(host).is_unspecified:
            return socket.gethostname()
    except ValueError:
        pass
    return host


async def run(config: WorkerServiceConfig) -> None:
    worker_id = config.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    servicer = WorkerServicer(worker_id)
    background: list[asyncio.Task] = []  # keeps the registration task referenced

    async def on_started(server: GrpcServer) -> None:
        # Health stays NOT_SERVING until the model is loaded and the KV cache allocated.
        servicer.runner = await asyncio.to_thread(ModelRunner, config)
        address = config.advertise or host_port(_reachable_host(config.host), server.port)
        log.info("worker ready", extra={"address": address, "worker_id": worker_id})
        print(f"llmesh worker {worker_id} listening on {address}", flush=True)
        if config.scheduler:
            background.append(asyncio.ensure_future(register_forever(config.scheduler, address, worker_id)))

    services = [Service.of("llmesh.v1.Worker", worker_pb2_grpc.add_WorkerServicer_to_server, servicer)]
    await serve(services, config, on_started=on_started)


def main(argv: list[str] | None = None) -> int:
    return service_main(WorkerServiceConfig, run, "worker", argv)


if __name__ == "__main__":
    sys.exit(main())
