"""The scheduler's side of a worker: a gRPC channel and one long-lived bidirectional Step stream."""

from __future__ import annotations

import asyncio

import grpc

from llmesh.v1 import worker_pb2, worker_pb2_grpc
from scheduler_svc.mesh import LinkBroken
from services.convert import step_plan_to_proto, step_result_from_proto, worker_info_from_proto
from services.grpc_server import insecure_channel
from services.step import StepPlan, StepResult, WorkerInfo


class GrpcWorkerLink:
    def __init__(self, address: str, step_timeout_s: float = 300.0) -> None:
        self.address = address
        self.step_timeout_s = step_timeout_s
        self._channel = insecure_channel(address)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._call = None

    async def connect(self, timeout_s: float = 30.0) -> WorkerInfo:
        """Ask the worker who it is and open the Step stream (the worker drops any older stream)."""
        try:
            info = await self._stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise LinkBroken(f"worker {self.address}: {e.code().name}: {e.details()}") from e
        self._call = self._stub.Step()
        return worker_info_from_proto(info)

    async def step(self, plan: StepPlan) -> StepResult:
        if self._call is None:
            raise LinkBroken("not connected")
        try:
            async with asyncio.timeout(self.step_timeout_s):
                await self._call.write(step_plan_to_proto(plan))
                msg = await self._call.read()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, TimeoutError) as e:
            raise LinkBroken(f"worker {self.address}: step failed: {e!r}") from e
        if msg is grpc.aio.EOF:
            raise LinkBroken(f"worker {self.address}: step stream ended")
        return step_result_from_proto(msg)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        await self._channel.close(grace=None)
