"""The worker's gRPC edge: `GetWorkerInfo`, `Ping` and the bidirectional `Step` stream.

A thin adapter: protobuf in, the worker's `StepLoop` (worker_svc.step_loop, the
same loop the in-process link drives) and protobuf out. The plans of a stream
are read by a task of their own and submitted as they come, so a plan that
arrives while a step runs is launched behind it at once; results go back in
plan order. One Step stream at a time: a new stream means the scheduler
reconnected, so the old stream ends (ABORTED, after the results of the plans it
had sent) and the sequence state is dropped.

A plan that reached the worker is executed whole even when its stream breaks
meanwhile (a step cannot be stopped half-way): dropping state is queued on the
step loop behind every plan already submitted, and `last_step_id` tells a
reconnecting scheduler which plans wrote their KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from llmesh.v1 import worker_pb2, worker_pb2_grpc
from services.convert import step_plan_from_proto, step_result_to_proto, worker_info_to_proto
from services.step import STEP_TOKEN_METADATA, StepResult
from worker_svc.pipeline import StepPipeline
from worker_svc.runner import ModelRunner
from worker_svc.step_loop import StepLoop

log = logging.getLogger(__name__)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str, step_token: str | None = None) -> None:
        self.worker_id = worker_id
        self.instance_id = uuid.uuid4().hex
        # None: any caller may open the Step stream (a worker dialled by a static list).
        self.step_token = step_token
        self.runner: ModelRunner | None = None  # set once the model is loaded
        self._steps: StepLoop | None = None  # made with the first stream, kept for the process
        self._stream_epoch = 0
        self._current: _Stream | None = None  # the open stream; None while none is
        self._stream_closed_at = time.monotonic()

    def _ready_runner(self) -> ModelRunner:
        if self.runner is None:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.runner

    def close(self) -> None:
        """Stop the step loop once the work queued on it is done."""
        if self._steps is not None:
            self._steps.stop()

    # ----- for the registration loop -----
    async def wait_orphaned(self, grace_s: float) -> None:
        """Return once no Step stream has been open for `grace_s` seconds in a row."""
        while self._current is not None or time.monotonic() - self._stream_closed_at < grace_s:
            await asyncio.sleep(min(grace_s, 0.25))

    # ----- RPCs -----
    async def GetWorkerInfo(self, request, context):
        try:
            runner = self._ready_runner()
        except _Abort as e:
            await context.abort(e.code, e.message)
        info = runner.info
        info.worker_id = self.worker_id
        info.instance_id = self.instance_id
        return worker_info_to_proto(
            info, dtype=str(runner.dtype).removeprefix("torch."), device=str(runner.device)
        )

    async def Ping(self, request, context):
        return worker_pb2.PingResponse(
            worker_id=self.worker_id,
            instance_id=self.instance_id,
            stepping=self._current is not None,
            num_seqs=len(self.runner.seqs) if self.runner else 0,
            last_step_id=self._steps.last_step_id if self._steps else 0,
        )

    def _authorized(self, context: grpc.aio.ServicerContext) -> bool:
        if self.step_token is None:
            return True
        sent = dict(context.invocation_metadata() or ()).get(STEP_TOKEN_METADATA, "")
        return hmac.compare_digest(str(sent).encode(), self.step_token.encode())

    async def Step(
        self, request_iterator: AsyncIterator[worker_pb2.StepPlan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StepResult]:
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        if not self._authorized(context):
            log.warning("step stream refused: wrong or missing step token", extra={"peer": context.peer()})
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "this worker takes its Step stream only from the scheduler it registered with",
            )
        runner = self.runner
        if self._steps is None:
            # Plans are launched one ahead of reading the previous one's sampled ids when the
            # next plan is already here (the scheduler keeps one in flight ahead): the GPU never
            # waits for this process between two steps.
            self._steps = StepLoop(StepPipeline(runner), on_thread_start=getattr(runner, "bind_thread", None))
        steps = self._steps
        self._stream_epoch += 1
        epoch = self._stream_epoch
        if self._current is not None:
            self._current.replace()  # submits nothing more; ends ABORTED after what it sent
        stream = self._current = _Stream()
        await steps.call(runner.drop_all)  # state belongs to one stream: after the old one's steps
        log.info("step stream opened", extra={"epoch": epoch, "peer": context.peer()})
        reader = asyncio.ensure_future(_read_plans(request_iterator, steps, stream))
        try:
            while True:
                item = await stream.items.get()
                if item is None:
                    break
                if isinstance(item, _Abort):
                    await context.abort(item.code, item.message)
                try:
                    result = await item
                except (KeyError, ValueError) as e:  # the plan contradicts the worker's state: resync
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"plan rejected: {e}")
                yield step_result_to_proto(result)
        finally:
            reader.cancel()
            if epoch == self._stream_epoch:
                self._stream_closed_at = time.monotonic()
                self._current = None
                # Behind the plans this stream sent, which still run whole and write their KV.
                dropped = steps.call(runner.drop_all)
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(dropped)
            log.info("step stream closed", extra={"epoch": epoch})


class _Stream:
    """What one Step stream's reader hands its writer, in plan order: a plan's future, an
    `_Abort`, or None at the end of the plans."""

    def __init__(self) -> None:
        self.items: asyncio.Queue = asyncio.Queue()
        self.replaced = False

    def replace(self) -> None:
        self.replaced = True
        self.items.put_nowait(_Abort(grpc.StatusCode.ABORTED, "a newer Step stream replaced this one"))


async def _read_plans(plans: AsyncIterator[worker_pb2.StepPlan], steps: StepLoop, stream: _Stream) -> None:
    """Submit a stream's plans to the step loop as they arrive, until it ends or is replaced."""
    try:
        async for msg in plans:
            if stream.replaced:
                return  # a newer stream owns the worker's state now
            try:
                plan = step_plan_from_proto(msg)
            except ValueError as e:
                stream.items.put_nowait(_Abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad plan: {e}"))
                return
            if plan.step_id == 0:  # a sync: answered once every plan before it is
                if plan.num_seqs or plan.finished_ids or plan.preempted_ids or plan.kv:
                    stream.items.put_nowait(
                        _Abort(grpc.StatusCode.INVALID_ARGUMENT, "a sync plan (step_id 0) must be empty")
                    )
                    return
                stream.items.put_nowait(steps.call(lambda: StepResult(step_id=0)))
                continue
            stream.items.put_nowait(steps.submit(plan))
    except Exception as e:  # the caller went away (or its stream broke): the writer ends with it
        log.info("step stream read ended", extra={"error": repr(e)})
    finally:
        stream.items.put_nowait(None)


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
