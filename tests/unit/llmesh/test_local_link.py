"""LocalWorkerLink's step thread: a plan that arrives while a step runs on the device is launched
at once, before the running step's results are read."""

from __future__ import annotations

import threading

from llmesh.local_link import LocalWorkerLink
from services.step import StepPlan, StepResult, WorkerInfo
from tests.helpers.fake_device import FakeDeviceEvent

INFO = WorkerInfo(
    "m", b"fp", block_size=8, num_kv_blocks=10, max_model_len=64, vocab_size=10, eos_token_ids=[]
)


class PipelinedStepper:
    """Like StepPipeline: push launches a plan, then finishes the one before (waiting on its event)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.events: dict[int, FakeDeviceEvent] = {}
        self._pending: StepPlan | None = None
        self.launched = threading.Condition()

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    @property
    def pending_event(self) -> FakeDeviceEvent | None:
        return self.events[self._pending.step_id] if self._pending is not None else None

    def push(self, plan: StepPlan) -> list[StepResult]:
        with self.launched:
            self.events[plan.step_id] = FakeDeviceEvent()
            self.log.append(f"launch {plan.step_id}")
            self.launched.notify_all()
        out = self.flush()
        self._pending = plan
        return out

    def flush(self) -> list[StepResult]:
        if self._pending is None:
            return []
        plan, self._pending = self._pending, None
        self.events[plan.step_id].synchronize()
        self.log.append(f"finish {plan.step_id}")
        return [StepResult(step_id=plan.step_id)]

    def wait_launched(self, step_id: int) -> None:
        with self.launched:
            assert self.launched.wait_for(lambda: f"launch {step_id}" in self.log, 10)


async def test_a_plan_sent_while_a_step_runs_is_launched_before_that_step_is_read():
    stepper = PipelinedStepper()
    link = LocalWorkerLink(stepper, INFO)
    await link.connect()
    await link.send(StepPlan(step_id=1))
    stepper.wait_launched(1)
    # Step 1 is on the "device" and nothing else is queued: the thread must not sit in flush.
    await link.send(StepPlan(step_id=2))
    stepper.wait_launched(2)
    assert stepper.log == ["launch 1", "launch 2"]
    stepper.events[1].fire()
    assert (await link.recv()).step_id == 1
    stepper.events[2].fire()
    assert (await link.recv()).step_id == 2
    assert stepper.log == ["launch 1", "launch 2", "finish 1", "finish 2"]
    await link.close()


async def test_a_step_whose_device_work_ends_first_is_read_without_waiting_for_a_plan():
    stepper = PipelinedStepper()
    link = LocalWorkerLink(stepper, INFO)
    await link.connect()
    for step_id in (1, 2, 3):
        await link.send(StepPlan(step_id=step_id))
        stepper.wait_launched(step_id)
        stepper.events[step_id].fire()
        assert (await link.recv()).step_id == step_id
    assert stepper.log == [f"{what} {i}" for i in (1, 2, 3) for what in ("launch", "finish")]
    await link.close()


def test_the_step_thread_of_a_pipeline_binds_as_its_runner_does():
    """The offline engine hands its link a StepPipeline, not the runner: the step thread must
    still run the runner's bind_thread (its GPU the thread's current device), or a worker on
    `cuda:1` launches its kernels on device 0."""
    from worker_svc.pipeline import StepPipeline

    class Runner:
        bound_on: list[str] = []

        def bind_thread(self) -> None:
            self.bound_on.append(threading.current_thread().name)

    runner = Runner()
    link = LocalWorkerLink(StepPipeline(runner), INFO)  # type: ignore[arg-type]
    link._steps.stop()
    assert link._steps.join(5.0)
    assert runner.bound_on == ["llmesh-step"]
