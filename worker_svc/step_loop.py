"""The worker's step loop: plans run strictly in order on one thread of their own.

One loop serves both ways a worker is driven: the gRPC `Step` stream
(`worker_svc.servicer`) and the in-process link of the offline engine
(`llmesh.local_link`). Callers on an asyncio event loop `submit` plans and
await each plan's future; the event loop stays free while a step runs, so the
scheduler plans step N+1 while step N is on the device.

The stepper may launch a plan before the previous one's sampled ids are read
(`worker_svc.pipeline.StepPipeline`). The thread then pushes each plan as it
comes and, when no plan is waiting, finishes the one in flight once its device
work is done, unless a plan arrives first: a watcher thread waits on the
device (the GIL released) and wakes the step thread, which meanwhile stays free
to launch the next plan the moment it is submitted. Where the step's end cannot
be awaited (nothing runs on a device), the thread looks for a plan for
`ARRIVAL_GRACE_S` and then finishes the step.

A plan that reached the loop runs whole even when its caller has gone (a step
cannot be stopped half-way): `call` queues work behind every plan already
submitted (dropping sequence state on a new stream, say), so it never runs
under a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from services.step import StepPlan, StepResult

Outcome = StepResult | Exception

# How long a step thread with a step in flight, and no device event to wait on, looks for the
# next plan before it reads that step's results: a plan already sent is on its way by then.
ARRIVAL_GRACE_S = 0.0002
# How often an idle step thread checks whether the program is exiting.
IDLE_CHECK_S = 0.5


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


def as_stepper(runner: Stepper | Callable[[StepPlan], StepResult]) -> Stepper:
    """A Stepper as is; any `execute(plan) -> result` callable run one plan at a time."""
    return runner if hasattr(runner, "push") else SerialStepper(runner)  # type: ignore[arg-type,return-value]


_STOP = object()


class StepLoopStopped(RuntimeError):
    """Work handed to a StepLoop after its stop(): it would never run."""


class _Ready:
    """Put on the step thread's queue when the device has finished the step of `event`."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event


class _Call:
    """Work for the step thread between plans; its outcome resolves `future`."""

    __slots__ = ("fn", "future", "loop")

    def __init__(
        self, fn: Callable[[], Any], future: asyncio.Future, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.fn = fn
        self.future, self.loop = future, loop


class _DeviceWatcher:
    """A thread that waits for device events (the GIL released) and reports each on `report`."""

    def __init__(self, report: queue.SimpleQueue) -> None:
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self._report = report
        self.thread = threading.Thread(target=self._work, name="llmesh-step-watch")  # not a daemon: as below
        self.thread.start()

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


class StepLoop:
    """Runs a Stepper's plans in order on a thread of its own; outcomes come back as futures.

    Holds nothing that refers back to its owner, so that an owner nobody holds is collected
    (and can stop the loop from a finalizer).
    """

    def __init__(
        self,
        stepper: Stepper | Callable[[StepPlan], StepResult],
        on_thread_start: Callable[[], None] | None = None,
    ) -> None:
        self.stepper = as_stepper(stepper)
        # Run first on the step thread (the runner binds its GPU there: CUDA's current device is
        # per thread).
        self._on_thread_start = on_thread_start
        self.last_step_id = 0  # the last plan whose step completed (its KV written)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # Set by stop(), under the lock that orders it against submit/call: work queued behind the
        # stop would never run, and its future never resolve (a Step stream's last drop_all, when
        # the stream ends after the servicer closed, hung the worker's exit until it was killed).
        self._stopped = False
        self._stop_lock = threading.RLock()  # reentrant: stop() may run from a finalizer mid-submit
        # Futures of submitted plans, resolved in order by the thread, with their event loops.
        self._unresolved: deque[tuple[asyncio.Future, asyncio.AbstractEventLoop]] = deque()
        self._watcher: _DeviceWatcher | None = None
        self._watched: Any = None  # the event last handed to the watcher
        # Not a daemon: a daemon thread may still be inside torch while the interpreter tears
        # torch down, which aborts the process. It leaves when the main thread has ended.
        self._thread = threading.Thread(target=self._work, name="llmesh-step")
        self._thread.start()

    # ----- from the event loop -----
    def submit(self, plan: StepPlan) -> asyncio.Future:
        """Queue `plan`; its future resolves to its StepResult, or to the error it raised."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._stop_lock:
            if self._stopped:
                fut.set_exception(StepLoopStopped("the step loop has stopped"))
                return fut
            self._unresolved.append((fut, loop))
            self._queue.put(plan)
        return fut

    def call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Run `fn` on the step thread after every plan submitted so far has completed."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._stop_lock:
            if self._stopped:
                fut.set_exception(StepLoopStopped("the step loop has stopped"))
                return fut
            self._queue.put(_Call(fn, fut, loop))
        return fut

    def stop(self) -> None:
        """End the thread once the work queued so far is done (safe from any thread, or a finalizer);
        what is submitted or called afterwards fails at once with StepLoopStopped."""
        with self._stop_lock:
            self._stopped = True
            self._queue.put(_STOP)

    def join(self, timeout_s: float = 30.0) -> bool:
        """After `stop`: wait until the step thread and then its device watcher (which only the step
        thread starts, and stops on leaving) have ended: nothing runs the stepper any more. False
        if one is still running, or if this is one of them."""
        watcher = self._watcher.thread if self._watcher is not None else None
        if threading.current_thread() in (self._thread, watcher):
            return False
        self._thread.join(timeout_s)
        if self._watcher is not None:
            self._watcher.thread.join(timeout_s)
            return not (self._thread.is_alive() or self._watcher.thread.is_alive())
        return not self._thread.is_alive()

    # ----- the step thread -----
    def _work(self) -> None:
        try:
            if self._on_thread_start is not None:
                self._on_thread_start()
            self._serve()
        finally:
            if self._watcher is not None:
                self._watcher.events.put(_STOP)

    def _serve(self) -> None:
        stepper = self.stepper
        while True:
            item = self._next_item(stepper)
            if item is _STOP:
                return
            if item is None:  # the step in flight is done, or no plan came in time: read it
                self._deliver(self._guard(stepper.flush))
            elif isinstance(item, _Ready):  # stale once that step was finished by a push
                if stepper.has_pending and item.event is stepper.pending_event:
                    self._deliver(self._guard(stepper.flush))
            elif isinstance(item, StepPlan):
                self._deliver(self._guard(lambda plan=item: stepper.push(plan)))
            else:
                self._deliver(self._guard(stepper.flush))
                try:
                    self._resolve(item.future, item.loop, item.fn())
                except Exception as e:
                    self._resolve(item.future, item.loop, e)

    def _next_item(self, stepper: Stepper) -> Any:
        """The next plan, call or wake-up; None when the step in flight should be read now."""
        if not stepper.has_pending:
            while True:
                try:
                    return self._queue.get(timeout=IDLE_CHECK_S)
                except queue.Empty:
                    if not threading.main_thread().is_alive():
                        return _STOP  # the program is exiting
        try:
            return self._queue.get_nowait()
        except queue.Empty:  # nothing else to launch yet: the device's end or a plan
            pass
        event = stepper.pending_event
        if event is None:
            try:
                return self._queue.get(timeout=ARRIVAL_GRACE_S)
            except queue.Empty:
                return None
        self._watch(event)
        return self._queue.get()

    def _watch(self, event: Any) -> None:
        if event is self._watched:
            return  # already watched: its _Ready is on the way
        if self._watcher is None:
            self._watcher = _DeviceWatcher(self._queue)
        self._watched = event
        self._watcher.events.put(event)

    @staticmethod
    def _guard(fn: Callable[[], list[Outcome]]) -> list[Outcome]:
        try:
            return fn()
        except Exception as e:  # the oldest plan in flight takes the blame; its caller breaks on it
            return [e]

    def _deliver(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            if isinstance(outcome, StepResult):
                self.last_step_id = outcome.step_id
            fut, loop = self._unresolved.popleft()
            self._resolve(fut, loop, outcome)

    @staticmethod
    def _resolve(fut: asyncio.Future, loop: asyncio.AbstractEventLoop, outcome: object) -> None:
        def settle() -> None:
            if fut.done():
                return
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
                fut.exception()  # retrieved here: a caller that left does not make it "unhandled"
            else:
                fut.set_result(outcome)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle)
