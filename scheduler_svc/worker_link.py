"""The scheduler's side of a worker: a gRPC channel and one long-lived bidirectional Step stream.

`connect()` can be called again after the stream broke: the channel re-dials
the same address, a fresh Step stream replaces the old one at the worker, and
the answer says whether the worker is the same process (`instance_id`) and
which plan it executed last, so the mesh knows what survived.
"""

from __future__ import annotations

import asyncio

import grpc

from llmesh.v1 import worker_pb2, worker_pb2_grpc
from scheduler_svc.mesh import Connected, LinkBroken
from services.convert import step_plan_to_proto, step_result_from_proto, worker_info_from_proto
from services.grpc_server import DEFAULT_KEEPALIVE_S, ChannelSecurity, open_channel
from services.step import STEP_TOKEN_METADATA, StepPlan, StepResult, WorkerInfo


class GrpcWorkerLink:
    def __init__(
        self,
        address: str,
        step_timeout_s: float = 300.0,
        step_token: str = "",
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        security: ChannelSecurity | None = None,
    ) -> None:
        self.address = address
        self.step_timeout_s = step_timeout_s
        self.step_token = step_token
        self._channel = open_channel(address, security, keepalive_s=keepalive_s)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._call = None

    def _broken(self, what: str, e: BaseException) -> LinkBroken:
        if isinstance(e, grpc.aio.AioRpcError):
            return LinkBroken(f"worker {self.address}: {what}: {e.code().name}: {e.details()}")
        return LinkBroken(f"worker {self.address}: {what}: {e!r}")

    async def probe(self, timeout_s: float = 10.0) -> WorkerInfo:
        """Who the worker is (no stream opened: registering a live worker again changes nothing)."""
        try:
            msg = await self._stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=timeout_s)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            raise self._broken("GetWorkerInfo", e) from e
        return worker_info_from_proto(msg)

    async def connect(self, timeout_s: float = 10.0) -> Connected:
        """(Re)open the Step stream, prove it with a sync plan, then read what the worker executed."""
        self._cancel_call()
        info = await self.probe(timeout_s)
        metadata = ((STEP_TOKEN_METADATA, self.step_token),) if self.step_token else None
        try:
            async with asyncio.timeout(timeout_s):
                call = self._stub.Step(metadata=metadata)
                await call.write(worker_pb2.StepPlan(step_id=0))
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    raise LinkBroken(f"worker {self.address}: the Step stream ended at once")
                # Read after the sync: the worker has finished any step of an older stream by now.
                ping = await self._stub.Ping(worker_pb2.PingRequest())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, TimeoutError) as e:
            raise self._broken("opening the Step stream", e) from e
        if ping.instance_id != info.instance_id:
            raise LinkBroken(f"worker {self.address} restarted while connecting")
        self._call = call
        return Connected(info, ping.last_step_id)

    async def send(self, plan: StepPlan) -> None:
        if self._call is None:
            raise LinkBroken("not connected")
        try:
            await self._call.write(step_plan_to_proto(plan))
        except BaseException as e:
            raise self._translate("sending a plan", e) from e

    async def recv(self) -> StepResult:
        if self._call is None:
            raise LinkBroken("not connected")
        try:
            async with asyncio.timeout(self.step_timeout_s):
                msg = await self._call.read()
        except BaseException as e:
            raise self._translate("step failed", e) from e
        if msg is grpc.aio.EOF:
            raise LinkBroken(f"worker {self.address}: step stream ended")
        return step_result_from_proto(msg)

    def _translate(self, what: str, e: BaseException) -> BaseException:
        """Every way a call can fail becomes LinkBroken, except the cancellation of this task."""
        if isinstance(e, asyncio.CancelledError):
            # grpc raises CancelledError in a read when the *call* was cancelled (abandon()); only a
            # cancellation of this task itself may propagate as one.
            if asyncio.current_task().cancelling():
                return e
            return self._broken(f"{what}: stream cancelled", e)
        if isinstance(e, Exception):  # AioRpcError, UsageError, InvalidStateError, TimeoutError, ...
            return self._broken(what, e)
        return e

    async def stepping(self, timeout_s: float = 5.0) -> bool:
        """Whether the worker has a Step stream open (Ping); False when it cannot be asked."""
        try:
            return (await self._stub.Ping(worker_pb2.PingRequest(), timeout=timeout_s)).stepping
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):
            return False

    def abandon(self) -> None:
        """Give up the current stream (the worker no longer has it): the next step or idle check fails."""
        self._cancel_call()

    @property
    def alive(self) -> bool:
        return self._call is not None and not self._call.done()

    def _cancel_call(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        self._cancel_call()
        await self._channel.close(grace=None)
