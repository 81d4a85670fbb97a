"""A worker in this process: the Step contract over function calls on a thread of its own.

The offline engine, the benchmarks and the scheduling core's tests drive a
model runner (or any `execute(plan) -> result`) through this link exactly as
the service drives a remote worker through the gRPC Step stream: plans run
strictly in order on one thread, several may be in flight, and the event loop
stays free while a step runs (so planning step N+1 overlaps step N).

The runner may be a `Stepper` that launches a plan before the previous one's
result is read (worker_svc.pipeline.StepPipeline): the thread then pushes each
plan as it comes and, when no plan is waiting, flushes the one in flight once
its device work is done, unless a plan arrives first: a watcher thread waits on
the device (the GIL released) and wakes the step thread, which meanwhile stays
free to launch the next plan the moment the planner sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from scheduler_svc.mesh import Connected, LinkBroken
from services.step import StepPlan, StepResult, WorkerInfo

Outcome = StepResult | Exception


class Stepper(Protocol):
    @property
    def has_pending(self) -> bool: ...

    def push(self, plan: StepPlan) -> list[Outcome]:
        """Take a plan; outcomes of the plans completed meanwhile, oldest first."""
        ...

    def flush(self) -> list[Outcome]:
        """Complete the plan still in flight."""
        ...

    @property
    def pending_event(self) -> Any:
        """An event (`.synchronize()`) after which `flush` does not block; None: it never waits
        on a device, or nothing is in flight."""
        ...


class SerialStepper:
    """One plan at a time, to the end: any `execute(plan) -> result` as a Stepper."""

    has_pending = False
    pending_event = None

    def __init__(self, execute: Callable[[StepPlan], StepResult]) -> None:
        self._execute = execute

    def push(self, plan: StepPlan) -> list[Outcome]:
        try:
            return [self._execute(plan)]
        except (KeyError, ValueError) as e:
            return [e]

    def flush(self) -> list[Outcome]:
        return []


_STOP = object()
# How often an idle step thread checks whether the program is exiting.
IDLE_CHECK_S = 0.5


class _Ready:
    """Put on the step thread's queue when the device has finished the step of `event`."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event


class _DeviceWatcher:
    """A thread that waits for device events (the GIL released) and reports each on `report`."""

    def __init__(self, report: queue.SimpleQueue) -> None:
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self._report = report
        threading.Thread(target=self._work, name="llmesh-step-watch").start()  # not a daemon: as below

    def _work(self) -> None:
        while True:
            try:
                event = self.events.get(timeout=IDLE_CHECK_S)
            except queue.Empty:
                if not threading.main_thread().is_alive():
                    return
                continue
            if event is _STOP:
                return
            try:
                event.synchronize()
            finally:  # a failed wait still wakes the step thread, whose flush then raises
                self._report.put(_Ready(event))


class _StepThread:
    """The link's thread and what it shares with the link: never the link itself, so that a
    link nobody holds is collected, which stops the thread and lets the runner go."""

    def __init__(self, stepper: Stepper) -> None:
        self.stepper = stepper
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.unresolved: deque[asyncio.Future] = deque()  # resolved in order by the thread
        self.loop: asyncio.AbstractEventLoop | None = None
        self.last_step_id = 0
        self._watcher: _DeviceWatcher | None = None
        self._watched: Any = None  # the event last handed to the watcher
        # Not a daemon: a daemon thread may still be inside torch while the interpreter tears
        # torch down, which aborts the process. It leaves when the main thread has ended.
        threading.Thread(target=self._work, name="llmesh-step").start()

    def _work(self) -> None:
        try:
            self._serve()
        finally:
            if self._watcher is not None:
                self._watcher.events.put(_STOP)

    def _serve(self) -> None:
        stepper = self.stepper
        while True:
            if stepper.has_pending:
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:  # nothing else to launch yet: the device's end or a plan
                    event = stepper.pending_event
                    if event is None:
                        self._deliver(self._guard(stepper.flush))
                        continue
                    self._watch(event)
                    item = self.queue.get()
            else:
                try:
                    item = self.queue.get(timeout=IDLE_CHECK_S)
                except queue.Empty:
                    if not threading.main_thread().is_alive():
                        return  # the program is exiting
                    continue
            if item is _STOP:
                return
            if isinstance(item, _Ready):  # stale once that step was finished by a push
                if stepper.has_pending and item.event is stepper.pending_event:
                    self._deliver(self._guard(stepper.flush))
                continue
            if isinstance(item, StepPlan):
                self._deliver(self._guard(lambda plan=item: stepper.push(plan)))
                continue
            fn, fut = item  # a call between plans (drop_all on reconnect)
            self._deliver(self._guard(stepper.flush))
            try:
                self._resolve(fut, fn())
            except Exception as e:
                self._resolve(fut, e)

    def _watch(self, event: Any) -> None:
        if event is self._watched:
            return  # already watched: its _Ready is on the way
        if self._watcher is None:
            self._watcher = _DeviceWatcher(self.queue)
        self._watched = event
        self._watcher.events.put(event)

    @staticmethod
    def _guard(fn: Callable[[], list[Outcome]]) -> list[Outcome]:
        try:
            return fn()
        except Exception as e:  # the oldest plan in flight takes the blame; the link breaks on it
            return [e]

    def _deliver(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            if isinstance(outcome, StepResult):
                self.last_step_id = outcome.step_id
            self._resolve(self.unresolved.popleft(), outcome)

    def _resolve(self, fut: asyncio.Future, outcome: object) -> None:
        def settle() -> None:
            if fut.done():
                return
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

        assert self.loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(settle)


class LocalWorkerLink:
    def __init__(
        self,
        runner: Stepper | Callable[[StepPlan], StepResult],
        info: WorkerInfo,
        drop_all: Callable[[], None] | None = None,
    ) -> None:
        stepper = runner if hasattr(runner, "push") else SerialStepper(runner)  # type: ignore[arg-type]
        self._drop_all = drop_all
        self.info = info
        self._inflight: deque[asyncio.Future] = deque()  # awaited by recv(), oldest first
        self._closed = False
        self._steps = _StepThread(stepper)  # type: ignore[arg-type]
        weakref.finalize(self, self._steps.queue.put, _STOP)

    # ----- the link -----
    async def connect(self, timeout_s: float = 10.0) -> Connected:
        """A fresh stream: the worker forgets its sequences (after any step still running)."""
        if self._closed:
            raise LinkBroken("the local worker is closed")
        self._steps.loop = asyncio.get_running_loop()
        while self._inflight:
            fut = self._inflight.popleft()
            await asyncio.wait([fut])
            if not fut.cancelled():
                fut.exception()  # retrieved: a lost plan's failure is not an unhandled error
        if self._drop_all is not None:
            done = self._steps.loop.create_future()
            self._steps.queue.put((self._drop_all, done))
            await done
        return Connected(self.info, self._steps.last_step_id)

    async def send(self, plan: StepPlan) -> None:
        if self._closed:
            raise LinkBroken("the local worker is closed")
        loop = self._steps.loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._inflight.append(fut)
        self._steps.unresolved.append(fut)
        self._steps.queue.put(plan)

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
        self._steps.queue.put(_STOP)
