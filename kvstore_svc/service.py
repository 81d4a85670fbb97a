"""`llmesh kvstore`: the tiered KV store as a gRPC service (llmesh.v1.KVStore, health, reflection).

Binds first (health NOT_SERVING), then builds the tiers (the disk tier scans
its directory, which may take a while), then turns SERVING. On SIGTERM it
drains like every llmesh service, then finishes queued write-behind writes
before exiting. Counters are served by the Stats RPC.

Beside gRPC it serves the bulk path (kvstore_svc/bulk.py) on --host:--bulk-port once the
store is built: entries for clients on other hosts at link speed, authenticated by the mesh
key; Stats advertises its port. No mesh key (mutual TLS only) or gRPC over TLS: no bulk path
(it has no TLS of its own), and clients stream over gRPC as before.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

from kvstore_svc import shm
from kvstore_svc.bulk import BulkServer
from kvstore_svc.config import KVStoreConfig, kvstore_environ
from kvstore_svc.servicer import KVStoreServicer
from kvstore_svc.shm import SegmentMaps
from kvstore_svc.store import TieredKVStore
from kvstore_svc.tiers.redis_tier import redact_url
from llmesh.v1 import kvstore_pb2_grpc
from services.grpc_server import GrpcServer, Service, host_port, serve, service_main, strict_parsing

log = logging.getLogger(__name__)


async def run(config: KVStoreConfig) -> None:
    executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kv-io")
    segments = SegmentMaps() if config.shared_memory and shm.available() else None
    servicer = KVStoreServicer(executor, segments=segments)

    async def on_started(server: GrpcServer) -> None:
        servicer.store = await asyncio.to_thread(TieredKVStore.from_config, config)
        servicer.bulk = await asyncio.to_thread(start_bulk, config, servicer.store)
        address = host_port(config.host, server.port)
        log.info(
            "kvstore ready",
            extra={
                "address": address,
                "tiers": [t.name for t in servicer.store.tiers],
                "memory_bytes": config.memory_bytes,
                "disk_dir": config.disk_dir or None,
                "disk_bytes": config.disk_bytes if config.disk_dir else None,
                "redis": redact_url(config.redis_url) if config.redis_url else None,
                "write_behind": config.write_behind,
                "shared_memory": segments is not None,
                "bulk_port": servicer.bulk.port if servicer.bulk is not None else None,
                "arena": servicer.store.arena.arena.name if servicer.store.arena is not None else None,
            },
        )
        print(f"llmesh kvstore listening on {address}", flush=True)

    add = strict_parsing(kvstore_pb2_grpc.add_KVStoreServicer_to_server)  # garbage in: INVALID_ARGUMENT
    services = [Service.of("llmesh.v1.KVStore", add, servicer)]
    try:
        await serve(services, config, on_started=on_started)
    finally:
        if servicer.bulk is not None:
            servicer.bulk.close()
        if servicer.store is not None:
            await asyncio.to_thread(servicer.store.close, config.shutdown_grace_s)
        executor.shutdown(wait=False, cancel_futures=True)
        if segments is not None:
            segments.close()


def start_bulk(config: KVStoreConfig, store: TieredKVStore) -> BulkServer | None:
    """The bulk path's server, started; None when it is off or cannot run here (logged)."""
    if config.bulk_port < 0:
        return None
    if not config.internal_key:
        log.info("no bulk path: it authenticates by the mesh key, and this store has none (mutual TLS)")
        return None
    if config.tls_cert:
        log.info("no bulk path: gRPC is served over TLS and the bulk path has none (payloads in clear)")
        return None
    try:
        return BulkServer(store, config.internal_key, config.host, config.bulk_port).start()
    except OSError as e:
        log.warning("cannot serve the bulk path: clients stream over gRPC", extra={"error": str(e)})
        return None


def main(argv: list[str] | None = None) -> int:
    return service_main(KVStoreConfig, run, "kvstore", argv, environ=kvstore_environ())


if __name__ == "__main__":
    sys.exit(main())
