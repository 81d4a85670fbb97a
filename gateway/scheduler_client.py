"""The gateway's gRPC client of the scheduler: one channel, short deadlines, fast reconnects.

The channel has no client interceptor: the key rides as metadata of each call (a grpc.aio
interceptor would wrap every streamed token in one more async iterator). With `direct` (the
address is a router, --direct-to-shards) Generate asks the router's ShardPicker for a shard and
streams from that shard itself (gateway/shard_routing.py); everything else goes to the address.
"""

from __future__ import annotations

import dataclasses
from contextvars import ContextVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import APIError, from_grpc
from gateway.shard_routing import RoutedCall, ShardChannels, ShardRouter
from llmesh.v1 import generation_pb2, generation_pb2_grpc, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.auth import bearer_metadata
from services.grpc_server import DEFAULT_KEEPALIVE_S, ChannelSecurity, default_security, open_channel

# The HTTP request's `x-session-id` header (set by gateway.middleware for the request's context),
# forwarded as gRPC metadata of the same name: a router in front of scheduler shards keeps a
# session on one shard (router_svc); a scheduler ignores it.
SESSION_HEADER = "x-session-id"
SESSION_ID: ContextVar[str] = ContextVar("llmesh_session_id", default="")


class SchedulerClient:
    """Thin async wrapper; every failure surfaces as an APIError (503 when the scheduler is gone)."""

    def __init__(
        self,
        address: str,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        security: ChannelSecurity | None = None,
        direct: bool = False,
    ) -> None:
        self.address = address
        self.keepalive_s = keepalive_s
        self.security = security  # TLS and the key every call carries (None: the host's default)
        self.direct = direct  # `address` is a router: stream from the shard it picks
        key = (default_security() if security is None else security).key
        self._key: tuple[tuple[str, str], ...] = bearer_metadata(key) if key else ()
        self._channel: grpc.aio.Channel | None = None
        self._scheduler: generation_pb2_grpc.SchedulerStub | None = None
        self._registry: worker_pb2_grpc.RegistryStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None
        self.shard_router: ShardRouter | None = None

    async def start(self) -> None:
        """Open the channel (lazily connected); must run inside the serving event loop."""
        # channel_options() agree with every llmesh server's ping policy and re-dial a restarted
        # scheduler within ~2 s (gRPC's default backoff reaches 120 s).
        security = default_security() if self.security is None else self.security
        self._channel = open_channel(
            self.address, dataclasses.replace(security, key=None), keepalive_s=self.keepalive_s
        )
        self._scheduler = generation_pb2_grpc.SchedulerStub(self._channel)
        self._registry = worker_pb2_grpc.RegistryStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        if self.direct:
            picker = _Keyed(router_pb2_grpc.ShardPickerStub(self._channel).Route, self._key)
            channels = ShardChannels(security, self.keepalive_s)
            self.shard_router = ShardRouter(picker, channels, self._relay)  # type: ignore[arg-type]

    async def close(self) -> None:
        if self.shard_router is not None:
            await self.shard_router.channels.close()
            self.shard_router = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    @property
    def scheduler(self) -> generation_pb2_grpc.SchedulerStub:
        if self._scheduler is None:
            raise APIError(
                503, "The gateway is not connected to a scheduler yet.", code="service_unavailable"
            )
        return self._scheduler

    async def model_info(self, timeout: float) -> generation_pb2.ModelInfo:
        try:
            return await self.scheduler.GetModelInfo(
                generation_pb2.GetModelInfoRequest(), timeout=timeout, metadata=self._key or None
            )
        except grpc.RpcError as e:
            raise from_grpc(e, self.address) from e

    async def serving(self, timeout: float) -> bool:
        """Whether the scheduler's grpc.health.v1 says SERVING (every llmesh service turns it on only
        once it would serve a request); a server without the health service is taken at its word."""
        if self._health is None:
            raise APIError(
                503, "The gateway is not connected to a scheduler yet.", code="service_unavailable"
            )
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return True  # another implementation of the contract: ModelInfo still gates readiness
            raise from_grpc(e, self.address) from e
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def stats(self, timeout: float) -> worker_pb2.SchedulerStats:
        if self._registry is None:
            raise APIError(
                503, "The gateway is not connected to a scheduler yet.", code="service_unavailable"
            )
        try:
            return await self._registry.GetStats(
                worker_pb2.GetStatsRequest(), timeout=timeout, metadata=self._key or None
            )
        except grpc.RpcError as e:
            raise from_grpc(e, self.address) from e

    def generate(
        self, request: generation_pb2.GenerateRequest, timeout: float
    ) -> grpc.aio.UnaryStreamCall | RoutedCall:
        """Start a Generate stream; cancel() on the returned call aborts the request upstream."""
        session = SESSION_ID.get()
        if self.shard_router is not None:
            return self.shard_router.generate(request, timeout, session)
        return self._relay(request, timeout, session)

    def _relay(
        self, request: generation_pb2.GenerateRequest, timeout: float, session: str
    ) -> grpc.aio.UnaryStreamCall:
        # wait_for_ready=False: with the scheduler down, fail at once (503) instead of queueing.
        metadata = self._key + ((SESSION_HEADER, session),) if session else self._key
        return self.scheduler.Generate(
            request, timeout=timeout, wait_for_ready=False, metadata=metadata or None
        )


class _Keyed:
    """A stub method with the key as its calls' metadata (the channel has no interceptor)."""

    def __init__(self, method, key: tuple[tuple[str, str], ...]) -> None:
        self._method, self._key = method, key

    def Route(self, request, **kw):  # noqa: N802 - the stub's method name
        return self._method(request, metadata=self._key or None, **kw)
