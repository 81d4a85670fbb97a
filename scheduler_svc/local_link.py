"""A worker in this process: the Step contract over a function call on a thread of its own.

The offline engine, the benchmarks and the scheduling core's tests drive a
model runner (or any `execute(plan) -> result`) through this link exactly as
the service drives a remote worker through the gRPC Step stream: plans run
strictly in order on one thread, several may be in flight, and the event loop
stays free while a step runs (so planning step N+1 overlaps step N).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from scheduler_svc.mesh import Connected, LinkBroken
from services.step import StepPlan, StepResult, WorkerInfo


class LocalWorkerLink:
    def __init__(
        self,
        execute: Callable[[StepPlan], StepResult],
        info: WorkerInfo,
        drop_all: Callable[[], None] | None = None,
    ) -> None:
        self._execute = execute
        self._drop_all = drop_all
        self.info = info
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="llmesh-step")
        self._inflight: deque[asyncio.Future] = deque()
        self._last_step_id = 0
        self._closed = False

    def _run(self, plan: StepPlan) -> StepResult:
        result = self._execute(plan)
        self._last_step_id = plan.step_id
        return result

    async def connect(self, timeout_s: float = 10.0) -> Connected:
        """A fresh stream: the worker forgets its sequences (after any step still running)."""
        if self._closed:
            raise LinkBroken("the local worker is closed")
        while self._inflight:
            fut = self._inflight.popleft()
            await asyncio.wait([fut])
            if not fut.cancelled():
                fut.exception()  # retrieved: a lost plan's failure is not an unhandled error
        if self._drop_all is not None:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._drop_all)
        return Connected(self.info, self._last_step_id)

    async def send(self, plan: StepPlan) -> None:
        if self._closed:
            raise LinkBroken("the local worker is closed")
        self._inflight.append(asyncio.get_running_loop().run_in_executor(self._thread, self._run, plan))

    async def recv(self) -> StepResult:
        if not self._inflight:
            raise LinkBroken("no plan in flight")
        try:
            return await self._inflight.popleft()
        except (KeyError, ValueError) as e:  # the plan contradicts the worker's state
            raise LinkBroken(f"local worker rejected a plan: {e}") from e

    @property
    def alive(self) -> bool:
        return not self._closed

    def abandon(self) -> None:
        pass  # nothing can be half-open in one process

    async def close(self) -> None:
        self._closed = True
        self._thread.shutdown(wait=False, cancel_futures=True)
