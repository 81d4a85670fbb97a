"""The Step stream over a real gRPC server on loopback, with a stand-in runner: plan order,
syncs, rejected plans, and a newer stream replacing an older one."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import grpc
import pytest

from llmesh.v1 import worker_pb2, worker_pb2_grpc
from services.convert import step_result_from_proto
from services.step import StepPlan, StepResult
from worker_svc.servicer import WorkerServicer
from worker_svc.step_loop import StepLoop


class Runner:
    """What the servicer reads of a runner; steps wait on `gate` when one is set."""

    def __init__(self) -> None:
        self.seqs: dict[str, object] = {}
        self.log: list[str] = []
        self.gate: threading.Event | None = None

    def drop_all(self) -> None:
        self.log.append("drop")

    def execute(self, plan: StepPlan) -> StepResult:
        if self.gate is not None:
            assert self.gate.wait(10)
        if plan.finished_ids == ["nobody"]:
            raise KeyError("unknown sequence 'nobody'")
        self.log.append(f"step {plan.step_id}")
        return StepResult(step_id=plan.step_id)


@pytest.fixture
async def worker():
    runner = Runner()
    servicer = WorkerServicer("w0")
    servicer.runner = runner  # type: ignore[assignment]
    servicer._steps = StepLoop(runner.execute)  # a serial stand-in for the runner's pipeline
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield SimpleNamespace(runner=runner, servicer=servicer, stub=worker_pb2_grpc.WorkerStub(channel))
    await channel.close()
    await server.stop(0)
    servicer.close()


def plan(step_id: int, **kw) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(step_id=step_id, **kw)


async def test_results_come_back_in_plan_order_with_syncs_between(worker):
    call = worker.stub.Step(iter([plan(1), plan(2), plan(0), plan(3)]))
    ids = [step_result_from_proto(r).step_id async for r in call]
    assert ids == [1, 2, 0, 3]
    ping = await worker.stub.Ping(worker_pb2.PingRequest())
    assert ping.last_step_id == 3
    assert worker.runner.log == ["drop", "step 1", "step 2", "step 3", "drop"]


async def test_a_plan_the_state_contradicts_ends_the_stream_with_invalid_argument(worker):
    call = worker.stub.Step(iter([plan(1), plan(2, finished_ids=["nobody"]), plan(3)]))
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for r in call:
            got.append(r.step_id)
    assert got == [1] and e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "plan rejected" in e.value.details()


async def test_a_sync_plan_must_be_empty(worker):
    call = worker.stub.Step(iter([plan(0, finished_ids=["a"])]))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_newer_stream_replaces_the_old_after_its_steps_ran_whole(worker):
    worker.runner.gate = threading.Event()
    queue: asyncio.Queue = asyncio.Queue()

    async def plans():
        while (p := await queue.get()) is not None:
            yield p

    old = worker.stub.Step(plans())
    await queue.put(plan(1))
    await asyncio.sleep(0.2)  # step 1 is running (held at the gate)
    new = worker.stub.Step(iter([plan(7)]))
    new_ids = asyncio.ensure_future(_ids(new))
    await asyncio.sleep(0.2)
    worker.runner.gate.set()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _ids(old)
    assert e.value.code() == grpc.StatusCode.ABORTED
    assert await new_ids == [7]
    # The old stream's step ran whole, then the new stream dropped the state, then its plan ran.
    assert worker.runner.log[:4] == ["drop", "step 1", "drop", "step 7"]
    await queue.put(None)


async def _ids(call) -> list[int]:
    return [r.step_id async for r in call]
