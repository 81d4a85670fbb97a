"""`llmesh worker`: load the model, serve the Worker API, register with the scheduler."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import os
import secrets
import socket
import sys
from dataclasses import dataclass

import grpc

from kvstore_svc.client import KVStoreClient
from llmesh.v1 import worker_pb2, worker_pb2_grpc
from services.config import option
from services.grpc_server import (
    ChannelSecurity,
    GrpcServer,
    ServerConfig,
    Service,
    host_port,
    open_channel,
    serve,
    service_main,
)
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner, shorten_gil_switch_interval
from worker_svc.servicer import WorkerServicer

log = logging.getLogger(__name__)


@dataclass
class WorkerServiceConfig(ServerConfig, WorkerConfig):
    """A worker service: the model runner's settings plus where to listen and whom to join."""

    scheduler: str = option("", help="scheduler host:port to register with (empty = wait to be dialled)")
    worker_id: str = option("", help="stable id of this worker (default: hostname-pid)")
    advertise: str = option("", help="host:port the scheduler dials back (default: host:bound port)")
    step_token: str = option(
        "",
        help="secret a scheduler must present to open the Step stream "
        "(default: random when registering with --scheduler, none otherwise)",
    )
    rejoin_after_s: float = option(
        3.0, help="register again after this long without a Step stream (a restarted scheduler)"
    )
    log_level: str = option("info", help="debug | info | warning | error")

    def __post_init__(self) -> None:
        ServerConfig.__post_init__(self)
        if self.rejoin_after_s <= 0:
            raise ValueError(f"rejoin_after_s must be > 0, got {self.rejoin_after_s}")


async def _register_once(stub, address: str, worker_id: str, step_token: str) -> None:
    """Announce this worker until the scheduler accepts (it dials back before answering)."""
    delay = 0.2
    while True:
        try:
            resp = await stub.RegisterWorker(
                worker_pb2.RegisterWorkerRequest(address=address, worker_id=worker_id, step_token=step_token),
                timeout=30,
            )
            if resp.accepted:
                log.info("registered with scheduler", extra={"reply": resp.message})
                return
            log.warning("scheduler refused registration", extra={"reason": resp.message})
        except grpc.aio.AioRpcError as e:
            log.info("scheduler not reachable yet", extra={"code": e.code().name})
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def stay_registered(
    config: WorkerServiceConfig, servicer: WorkerServicer, address: str, worker_id: str
) -> None:
    """Register, then register again whenever no scheduler has held the Step stream for a while.

    That covers a restarted scheduler (it knows no worker until they announce
    themselves) and a scheduler that declared this worker dead while it was
    paused or cut off; a live stream means nothing needs doing.
    """
    security = ChannelSecurity.of(config, config.internal_key)
    async with open_channel(config.scheduler, security, keepalive_s=config.keepalive_s) as channel:
        stub = worker_pb2_grpc.RegistryStub(channel)
        while True:
            await _register_once(stub, address, worker_id, servicer.step_token or "")
            await servicer.wait_orphaned(config.rejoin_after_s)
            log.warning(
                "no Step stream from the scheduler: registering again",
                extra={"after_s": config.rejoin_after_s, "scheduler": config.scheduler},
            )


# Exit status of a worker that lost one of its tensor-parallel ranks.
EXIT_RANK_LOST = 75


def exit_on_rank_failure(why: str) -> None:
    """A worker that lost a tensor-parallel rank can never step again: it exits at once, loudly,
    so that the scheduler moves its requests elsewhere and a supervisor starts it afresh (a step
    blocked in a collective on the dead rank could not be stopped otherwise)."""
    log.critical("tensor-parallel %s: the worker exits", why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(EXIT_RANK_LOST)


def _reachable_host(host: str) -> str:
    """A wildcard bind is no address to dial back: advertise the hostname (a container's DNS name)."""
    try:
        if ipaddress.ip_address(host).is_unspecified:
            return socket.gethostname()
    except ValueError:
        pass
    return host


async def run(config: WorkerServiceConfig) -> None:
    if config.kvstore_address and not config.internal_key:
        # Mutual TLS without a key: nothing to sign KV entries with that the other workers share.
        raise SystemExit(
            "the KV store needs the mesh secret (LLMESH_INTERNAL_KEY or LLMESH_INTERNAL_KEY_FILE) to "
            "sign and verify its entries, also under mutual TLS"
        )
    worker_id = config.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    shorten_gil_switch_interval()  # steps run in a thread beside the gRPC event loop
    step_token = config.step_token or (secrets.token_hex(16) if config.scheduler else None)
    servicer = WorkerServicer(worker_id, step_token)
    background: list[asyncio.Task] = []  # keeps the registration task referenced
    kv_clients: list[KVStoreClient] = []  # closed at exit: unlinks its shared memory segments

    async def on_started(server: GrpcServer) -> None:
        # Health stays NOT_SERVING until the model is loaded and the KV cache allocated.
        kv_store = (
            KVStoreClient(
                config.kvstore_address,
                security=ChannelSecurity.of(config, config.internal_key),
                shared_memory=config.kv_store_shared_memory,
                segment_bytes=config.kv_store_segment_bytes,
                transfer=config.kv_store_transfer,
            )
            if config.kvstore_address
            else None
        )
        if kv_store is not None:
            kv_clients.append(kv_store)
        servicer.runner = await asyncio.to_thread(ModelRunner, config, kv_store, exit_on_rank_failure)
        # The model's imports leave many long-lived objects; frozen, a full collection (which
        # stops the Step stream's loop) skips them.
        gc.collect()
        gc.freeze()
        address = config.advertise or host_port(_reachable_host(config.host), server.port)
        log.info("worker ready", extra={"address": address, "worker_id": worker_id})
        print(f"llmesh worker {worker_id} listening on {address}", flush=True)
        if config.scheduler:
            background.append(asyncio.ensure_future(stay_registered(config, servicer, address, worker_id)))

    services = [Service.of("llmesh.v1.Worker", worker_pb2_grpc.add_WorkerServicer_to_server, servicer)]
    try:
        await serve(services, config, on_started=on_started)
    finally:
        for task in background:
            task.cancel()
        servicer.close()  # its step loop
        if servicer.runner is not None:
            servicer.runner.close()  # the other tensor-parallel ranks, if any
        for client in kv_clients:
            client.close()


def main(argv: list[str] | None = None) -> int:
    return service_main(WorkerServiceConfig, run, "worker", argv)


if __name__ == "__main__":
    sys.exit(main())
