"""A scheduler shard announces itself to its routers (router.proto ShardRegistry), and leaves.

It registers at start and again every `interval_s`: registering is idempotent, so a router that
restarted (and forgot its shards) learns this one back within a period. On drain it deregisters,
so that routers stop sending it new requests before it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from llmesh.v1 import router_pb2, router_pb2_grpc
from services.grpc_server import ChannelSecurity, open_channel

log = logging.getLogger(__name__)


class ShardRegistration:
    def __init__(
        self, routers: list[str], address: str, shard_id: str, security: ChannelSecurity | None,
        interval_s: float = 5.0,
    ) -> None:  # fmt: skip
        self.address = address
        self.shard_id = shard_id
        self.interval_s = interval_s
        self._channels = [open_channel(r, security) for r in routers]
        self._stubs = [router_pb2_grpc.ShardRegistryStub(c) for c in self._channels]
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._keep_registered())

    async def _keep_registered(self) -> None:
        request = router_pb2.RegisterShardRequest(address=self.address, shard_id=self.shard_id)
        while True:
            for stub in self._stubs:
                try:
                    await stub.RegisterShard(request, timeout=5.0)
                except grpc.aio.AioRpcError as e:
                    log.info("router registration failed", extra={"error": e.details()})
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        """Leave every router (best effort), then stop re-registering."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        request = router_pb2.DeregisterShardRequest(shard_id=self.shard_id, address=self.address)
        for stub in self._stubs:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.DeregisterShard(request, timeout=2.0)
        for channel in self._channels:
            await channel.close()
