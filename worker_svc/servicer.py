"""The worker's gRPC edge: `GetWorkerInfo`, `Ping` and the bidirectional `Step` stream.

A thin adapter: protobuf in, `ModelRunner.execute` (in a thread, so the event
loop keeps answering health checks) and protobuf out. One Step stream at a
time: a new stream means the scheduler reconnected, so the old stream is
cancelled and its sequence state dropped.

A plan that reached the worker is executed whole even when its stream breaks
meanwhile (the step's thread cannot be stopped half-way anyway): the lock is
held until it ends, so a new stream never drops state under a running step,
and `last_step_id` tells a reconnecting scheduler which plans wrote their KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from llmesh.v1 import worker_pb2, worker_pb2_grpc
from services.convert import step_plan_from_proto, step_result_to_proto, worker_info_to_proto
from services.step import STEP_TOKEN_METADATA, StepResult
from worker_svc.pipeline import StepPipeline
from worker_svc.runner import ModelRunner

log = logging.getLogger(__name__)

# How long a worker with a step in flight waits for the next plan before it reads that step's
# results instead: a plan the scheduler already sent is on the socket by then.
ARRIVAL_GRACE_S = 0.0002


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str, step_token: str | None = None) -> None:
        self.worker_id = worker_id
        self.instance_id = uuid.uuid4().hex
        # None: any caller may open the Step stream (a worker dialled by a static list).
        self.step_token = step_token
        self.runner: ModelRunner | None = None  # set once the model is loaded
        self._lock = asyncio.Lock()
        self._stream_epoch = 0
        # The current stream's "a newer stream replaced you" event; None while no stream is open.
        self._replaced: asyncio.Event | None = None
        self._last_step_id = 0
        self._stream_closed_at = time.monotonic()

    def _ready_runner(self) -> ModelRunner:
        if self.runner is None:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.runner

    @property
    def _stream_open(self) -> bool:
        return self._replaced is not None

    # ----- for the registration loop -----
    async def wait_orphaned(self, grace_s: float) -> None:
        """Return once no Step stream has been open for `grace_s` seconds in a row."""
        while self._stream_open or time.monotonic() - self._stream_closed_at < grace_s:
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
            stepping=self._stream_open,
            num_seqs=len(self.runner.seqs) if self.runner else 0,
            last_step_id=self._last_step_id,
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
        self._stream_epoch += 1
        epoch = self._stream_epoch
        if self._replaced is not None:
            self._replaced.set()  # the old stream ends with ABORTED; a step it runs still completes
        replaced = self._replaced = asyncio.Event()
        async with self._lock:  # waits for any step of the old stream to finish
            runner.drop_all()  # state belongs to one stream
        log.info("step stream opened", extra={"epoch": epoch, "peer": context.peer()})
        plans = request_iterator.__aiter__()
        stop = asyncio.ensure_future(replaced.wait())  # one waiter for the stream's life
        # Plans are launched one ahead of reading the previous one's sampled ids when the next
        # plan is already here (the scheduler keeps one in flight ahead): the GPU never waits
        # for this process between two steps.
        pipeline = StepPipeline(runner)
        device = _DeviceDone()
        read: asyncio.Future | None = None
        try:
            while True:
                if read is None:
                    read = asyncio.ensure_future(anext(plans, None))
                if pipeline.has_pending and not await _arrives_first(pipeline, device, read, stop):
                    # No plan came before the step in flight finished: read it now.
                    for outcome in await self._locked(pipeline.flush):
                        yield await self._result_or_abort(outcome, runner, context)
                    continue
                msg = await _next_or_none(read, stop)
                read = None
                if replaced.is_set():
                    await context.abort(grpc.StatusCode.ABORTED, "a newer Step stream replaced this one")
                if msg is None:
                    break
                try:
                    plan = step_plan_from_proto(msg)
                except ValueError as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad plan: {e}")
                if plan.step_id == 0:
                    if plan.num_seqs or plan.finished_ids or plan.preempted_ids or plan.kv:
                        await context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT, "a sync plan (step_id 0) must be empty"
                        )
                    if pipeline.has_pending:  # results go back in plan order
                        for outcome in await self._locked(pipeline.flush):
                            yield await self._result_or_abort(outcome, runner, context)
                    yield step_result_to_proto(StepResult(step_id=0))
                    continue
                for outcome in await self._locked(lambda plan=plan: pipeline.push(plan)):
                    yield await self._result_or_abort(outcome, runner, context)
        finally:
            stop.cancel()
            if read is not None:
                read.cancel()
            # A launched step still writes its KV: wait for it (even when cancelled: this is the end).
            if pipeline.has_pending:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await self._locked(pipeline.flush)
            if epoch == self._stream_epoch:
                self._stream_closed_at = time.monotonic()
                self._replaced = None
                async with self._lock:
                    runner.drop_all()
            log.info("step stream closed", extra={"epoch": epoch})

    async def _result_or_abort(self, outcome, runner: ModelRunner, context) -> worker_pb2.StepResult:
        if isinstance(outcome, KeyError | ValueError):
            # The plan contradicts the worker's state: the scheduler must resync.
            runner.drop_all()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"plan rejected: {outcome}")
        if isinstance(outcome, Exception):
            raise outcome
        return step_result_to_proto(outcome)

    async def _locked(self, fn) -> list:
        """`_run_whole(fn)` under the step lock (a new stream waits for it before dropping state)."""
        async with self._lock:
            return await self._run_whole(fn)

    async def _run_whole(self, fn) -> list:
        """Run pipeline work in a thread; if the stream is cancelled meanwhile, still wait for it to end."""
        task = asyncio.ensure_future(asyncio.to_thread(fn))

        def executed(t: asyncio.Future) -> None:
            if t.cancelled() or t.exception() is not None:
                return
            done = [o.step_id for o in t.result() if isinstance(o, StepResult)]
            if done:
                self._last_step_id = done[-1]

        task.add_done_callback(executed)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await task  # hold the caller's lock until the step's thread is done
            raise


class _DeviceDone:
    """The end of a step's device work as an awaitable: one thread-pool wait per step."""

    def __init__(self) -> None:
        self._event: Any = None
        self._done: asyncio.Future | None = None

    def of(self, event: Any) -> asyncio.Future:
        if event is not self._event or self._done is None:
            self._event = event
            self._done = asyncio.ensure_future(asyncio.to_thread(event.synchronize))
            # A failed wait shows again in the flush that follows; not an unretrieved error here.
            self._done.add_done_callback(lambda f: f.cancelled() or f.exception())
        return self._done


async def _arrives_first(
    pipeline: StepPipeline, device: _DeviceDone, read: asyncio.Future, stop: asyncio.Future
) -> bool:
    """Whether the next plan (or the stream's end) comes before the step in flight is done.

    On a GPU the wait is for whichever comes first, so a plan that arrives while the step runs
    is launched at once behind it rather than after its results are read; where the step's end
    cannot be awaited (nothing on a device), one short look at the socket.
    """
    event = pipeline.pending_event
    if event is None:
        return await _arrives_now(read, stop)
    if not read.done() and not stop.done():
        await asyncio.wait((read, stop, device.of(event)), return_when=asyncio.FIRST_COMPLETED)
    return read.done() or stop.done()


async def _arrives_now(read: asyncio.Future, stop: asyncio.Future) -> bool:
    """Whether the next plan (or the stream's end) is already here, after one look at the socket."""
    if not read.done() and not stop.done():
        await asyncio.wait((read, stop), timeout=ARRIVAL_GRACE_S)
    return read.done() or stop.done()


async def _next_or_none(read: asyncio.Future, stop: asyncio.Future):
    """The next plan, or None at the end of the stream or once `stop` is done (the stream was replaced)."""
    if not stop.done():
        await asyncio.wait((read, stop), return_when=asyncio.FIRST_COMPLETED)
    if stop.done():
        return None
    return read.result() if not read.cancelled() else None


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
