"""A worker in this process: the Step contract over function calls, for the offline engine.

The offline engine, the benchmarks and the scheduling core's tests drive a
model runner (or any `execute(plan) -> result`) through this link exactly as
the scheduler service drives a remote worker through the gRPC Step stream: the
same `worker_svc.step_loop.StepLoop` runs the plans, strictly in order on a
thread of its own, several may be in flight, and the event loop stays free
while a step runs (so planning step N+1 overlaps step N).
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable

from scheduler_svc.mesh import Connected, LinkBroken
from services.step import StepPlan, StepResult, WorkerInfo
from worker_svc.step_loop import StepLoop, Stepper


class LocalWorkerLink:
    def __init__(
        self,
        runner: Stepper | Callable[[StepPlan], StepResult],
        info: WorkerInfo,
        drop_all: Callable[[], None] | None = None,
    ) -> None:
        self._drop_all = drop_all
        self.info = info
        self._inflight: deque[asyncio.Future] = deque()  # awaited by recv(), oldest first
        self._closed = False
        self._steps = StepLoop(runner, on_thread_start=getattr(runner, "bind_thread", None))
        # A link nobody holds stops its thread, which lets the runner go.
        weakref.finalize(self, self._steps.stop)

    # ----- the link -----
    async def connect(self, timeout_s: float = 10.0) -> Connected:
        """A fresh stream: the worker forgets its sequences (after any step still running)."""
        if self._closed:
            raise LinkBroken("the local worker is closed")
        while self._inflight:  # a lost plan's outcome is not waited for by anyone else
            await asyncio.wait([self._inflight.popleft()])
        if self._drop_all is not None:
            await self._steps.call(self._drop_all)
        return Connected(self.info, self._steps.last_step_id)

    async def send(self, plan: StepPlan) -> None:
        if self._closed:
            raise LinkBroken("the local worker is closed")
        self._inflight.append(self._steps.submit(plan))

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
        self._steps.stop()

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop the step thread once the work queued so far is done, and wait for it to end (the
        runner is then free to be closed); False if it did not end in time, or this is it."""
        self._closed = True
        self._steps.stop()
        return self._steps.join(timeout_s)

    async def run_between_steps(self, fn: Callable[[], object]) -> object:
        """Run `fn` on the step thread once every plan sent so far has completed."""
        return await self._steps.call(fn)
