"""The worker's gRPC edge: `GetWorkerInfo`, `Ping` and the bidirectional `Step` stream.

A thin adapter: protobuf in, `ModelRunner.execute` (in a thread, so the event
loop keeps answering health checks) and protobuf out. One Step stream at a
time: a new stream means the scheduler reconnected, so sequence state from the
old one is dropped and the old stream ends with ABORTED.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from llmesh.v1 import worker_pb2, worker_pb2_grpc
from services.convert import step_plan_from_proto, step_result_to_proto, worker_info_to_proto
from worker_svc.runner import ModelRunner

log = logging.getLogger(__name__)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.instance_id = uuid.uuid4().hex
        self.runner: ModelRunner | None = None  # set once the model is loaded
        self._lock = asyncio.Lock()
        self._stream_epoch = 0
        self._last_step_id = 0

    def _ready_runner(self, context: grpc.aio.ServicerContext) -> ModelRunner:
        if self.runner is None:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.runner

    async def GetWorkerInfo(self, request, context):
        try:
            runner = self._ready_runner(context)
        except _Abort as e:
            await context.abort(e.code, e.message)
        info = runner.info
        info.worker_id = self.worker_id
        return worker_info_to_proto(
            info,
            instance_id=self.instance_id,
            dtype=str(runner.dtype).removeprefix("torch."),
            device=str(runner.device),
        )

    async def Ping(self, request, context):
        return worker_pb2.PingResponse(
            worker_id=self.worker_id,
            instance_id=self.instance_id,
            stepping=self._lock.locked(),
            num_seqs=len(self.runner.seqs) if self.runner else 0,
            last_step_id=self._last_step_id,
        )

    async def Step(
        self, request_iterator: AsyncIterator[worker_pb2.StepPlan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StepResult]:
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        runner = self.runner
        self._stream_epoch += 1
        epoch = self._stream_epoch
        async with self._lock:
            runner.drop_all()  # state belongs to one stream
        log.info("step stream opened", extra={"epoch": epoch})
        try:
            async for msg in request_iterator:
                if epoch != self._stream_epoch:
                    await context.abort(grpc.StatusCode.ABORTED, "a newer Step stream replaced this one")
                try:
                    plan = step_plan_from_proto(msg)
                except ValueError as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad plan: {e}")
                async with self._lock:
                    try:
                        result = await asyncio.to_thread(runner.execute, plan)
                    except (KeyError, ValueError) as e:
                        # The plan contradicts the worker's state: the scheduler must resync.
                        runner.drop_all()
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"plan rejected: {e}")
                self._last_step_id = plan.step_id
                yield step_result_to_proto(result)
        finally:
            if epoch == self._stream_epoch:
                async with self._lock:
                    runner.drop_all()
            log.info("step stream closed", extra={"epoch": epoch})


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
