"""The worker's StepLoop: plans in order on one thread, calls behind them, errors to their own plan."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.step import StepPlan, StepResult
from worker_svc.step_loop import StepLoop


def _execute_log() -> tuple[list[int], object]:
    ran: list[int] = []

    def execute(plan: StepPlan) -> StepResult:
        if plan.step_id == 3:
            raise KeyError("unknown sequence")
        ran.append(plan.step_id)
        return StepResult(step_id=plan.step_id)

    return ran, execute


async def test_plans_resolve_in_order_and_a_rejected_plan_fails_alone():
    ran, execute = _execute_log()
    steps = StepLoop(execute)
    futures = [steps.submit(StepPlan(step_id=i)) for i in (1, 2, 3, 4)]
    assert (await futures[0]).step_id == 1
    assert (await futures[1]).step_id == 2
    with pytest.raises(KeyError):
        await futures[2]
    assert (await futures[3]).step_id == 4
    assert ran == [1, 2, 4] and steps.last_step_id == 4
    steps.stop()


async def test_a_call_runs_on_the_step_thread_after_every_plan_before_it():
    ran, execute = _execute_log()
    steps = StepLoop(execute)
    plans = [steps.submit(StepPlan(step_id=i)) for i in (1, 2)]
    seen = await steps.call(lambda: (list(ran), threading.current_thread().name))
    assert seen == ([1, 2], "llmesh-step")
    await asyncio.gather(*plans)
    with pytest.raises(ZeroDivisionError):  # a call's error is its own
        await steps.call(lambda: 1 / 0)
    steps.stop()


async def test_an_outcome_nobody_awaits_is_not_an_unhandled_error(caplog):
    _, execute = _execute_log()
    steps = StepLoop(execute)
    steps.submit(StepPlan(step_id=3))  # its caller left
    await steps.call(lambda: None)
    await asyncio.sleep(0)
    steps.stop()
    assert "never retrieved" not in caplog.text


async def test_work_handed_over_after_stop_fails_at_once():
    """A Step stream ending after the servicer closed hands its last drop_all to a stopped loop:
    it must fail, not hang (the worker's exit waited on it until it was killed)."""
    from worker_svc.step_loop import StepLoopStopped

    _, execute = _execute_log()
    steps = StepLoop(execute)
    queued = steps.submit(StepPlan(step_id=1))  # before the stop: still runs
    steps.stop()
    with pytest.raises(StepLoopStopped):
        await asyncio.wait_for(steps.call(lambda: None), 5)
    with pytest.raises(StepLoopStopped):
        await asyncio.wait_for(steps.submit(StepPlan(step_id=2)), 5)
    assert (await asyncio.wait_for(queued, 5)).step_id == 1
    assert steps.join(5)
