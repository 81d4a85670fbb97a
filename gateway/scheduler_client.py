"""The gateway's gRPC client of the scheduler: one channel, short deadlines, fast reconnects."""

from __future__ import annotations

from contextvars import ContextVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import APIError, from_grpc
from llmesh.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.grpc_server import DEFAULT_KEEPALIVE_S, ChannelSecurity, open_channel

# The HTTP request's `x-session-id` header (set by gateway.middleware for the request's context),
# forwarded as gRPC metadata of the same name: a router in front of scheduler shards keeps a
# session on one shard (router_svc); a scheduler ignores it.
SESSION_HEADER = "x-session-id"
SESSION_ID: ContextVar[str] = ContextVar("llmesh_session_id", default="")


class SchedulerClient:
    """Thin async wrapper; every failure surfaces as an APIError (503 when the scheduler is gone)."""

    def __init__(
        self, address: str, keepalive_s: float = DEFAULT_KEEPALIVE_S, security: ChannelSecurity | None = None
    ) -> None:
        self.address = address
        self.keepalive_s = keepalive_s
        self.security = security  # TLS and the key every call carries (None: plaintext, no key)
        self._channel: grpc.aio.Channel | None = None
        self._scheduler: generation_pb2_grpc.SchedulerStub | None = None
        self._registry: worker_pb2_grpc.RegistryStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None

    async def start(self) -> None:
        """Open the channel (lazily connected); must run inside the serving event loop."""
        # channel_options() agree with every llmesh server's ping policy and re-dial a restarted
        # scheduler within ~2 s (gRPC's default backoff reaches 120 s).
        self._channel = open_channel(self.address, self.security, keepalive_s=self.keepalive_s)
        self._scheduler = generation_pb2_grpc.SchedulerStub(self._channel)
        self._registry = worker_pb2_grpc.RegistryStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self) -> None:
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
            return await self.scheduler.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout)
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
            return await self._registry.GetStats(worker_pb2.GetStatsRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise from_grpc(e, self.address) from e

    def generate(self, request: generation_pb2.GenerateRequest, timeout: float) -> grpc.aio.UnaryStreamCall:
        """Start a Generate stream; cancel() on the returned call aborts the request upstream."""
        # wait_for_ready=False: with the scheduler down, fail at once (503) instead of queueing.
        session = SESSION_ID.get()
        metadata = ((SESSION_HEADER, session),) if session else None
        return self.scheduler.Generate(request, timeout=timeout, wait_for_ready=False, metadata=metadata)
