"""Admission control (issue 30): a full mesh refuses a request before it starts, with a retry-after,
lets a better priority in, and says so on both wires (the public API, an API process's core stream)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from llmesh.local_link import LocalWorkerLink
from llmesh.v1 import core_pb2_grpc
from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from scheduler_svc.core_client import CoreClient
from scheduler_svc.core_servicer import SchedulerCoreServicer
from scheduler_svc.mesh import RETRY_AFTER_UNKNOWN_S, Mesh, Overloaded
from scheduler_svc.servicer import ModelCard, SchedulerServicer
from services.grpc_server import PLAINTEXT
from services.sampling_params import SamplingParams
from tests.unit.scheduler_svc.test_mesh import INFO, mesh_config
from tests.unit.scheduler_svc.test_planner import CountingWorker

PARAMS = SamplingParams(max_tokens=4)
PROMPT = [5, 6, 7, 8]


class StuckLink(LocalWorkerLink):
    """A worker whose steps never come back: what it holds stays, nothing finishes."""

    async def send(self, plan) -> None:
        await asyncio.Event().wait()


def full_mesh(bound: int = 2) -> Mesh:
    """One worker of 4 batch slots that never finishes a step: every request stays where it is."""
    mesh = Mesh(mesh_config(max_waiting_requests=bound))
    worker = CountingWorker()
    mesh.add_worker("w", INFO, StuckLink(worker.execute, INFO, worker.seqs.clear))
    return mesh


async def test_past_the_bound_a_request_is_refused_before_it_is_queued():
    mesh = full_mesh(bound=2)
    for i in range(6):  # 4 batch slots + 2 waiting beyond them
        mesh.submit(f"r{i}", PROMPT, PARAMS)
    assert mesh.num_backlog == 2
    with pytest.raises(Overloaded) as refused:
        mesh.submit("late", PROMPT, PARAMS)
    assert refused.value.retry_after_s == RETRY_AFTER_UNKNOWN_S  # nothing finished yet to measure
    assert "late" not in mesh.streams and mesh.num_refused == 1 and mesh.num_backlog == 2
    await mesh.remove_worker("w")


async def test_no_bound_queues_everything():
    mesh = full_mesh(bound=0)
    for i in range(50):
        mesh.submit(f"r{i}", PROMPT, PARAMS)
    assert mesh.num_backlog == 46 and mesh.num_refused == 0
    await mesh.remove_worker("w")


async def test_a_better_priority_takes_the_place_of_the_worst_waiting_request():
    mesh = full_mesh(bound=2)
    priorities = [0, 0, 1, 0, 1, 0]
    queues = {f"r{i}": mesh.submit(f"r{i}", PROMPT, PARAMS, priority=p) for i, p in enumerate(priorities)}
    with pytest.raises(Overloaded):  # no waiting request is worse than priority 1
        mesh.submit("same", PROMPT, PARAMS, priority=1)
    mesh.submit("urgent", PROMPT, PARAMS, priority=-1)
    refused = queues["r4"].get_nowait()  # the newest of the worst priority
    assert isinstance(refused, Overloaded) and refused.retry_after_s >= 1
    assert "r4" not in mesh.streams and "urgent" in mesh.streams and mesh.num_backlog == 2
    assert all(queues[r].empty() for r in queues if r != "r4")
    await mesh.remove_worker("w")


async def test_the_choices_of_an_admitted_request_are_all_admitted():
    mesh = full_mesh(bound=1)
    for i in range(4):
        mesh.submit(f"r{i}", PROMPT, PARAMS)
    mesh.submit("n0", PROMPT, PARAMS, group="n")  # backlog 0 -> 1: in
    mesh.submit("n1", PROMPT, PARAMS, group="n")  # full, but its sibling is in
    with pytest.raises(Overloaded):
        mesh.submit("other", PROMPT, PARAMS)
    await mesh.remove_worker("w")


async def test_retry_after_is_the_backlog_over_the_recent_finish_rate():
    mesh = full_mesh(bound=0)
    for i in range(24):
        mesh.submit(f"r{i}", PROMPT, PARAMS)  # backlog 20
    now = time.monotonic()
    mesh._finished_at.extend(now - 1.0 + k / 10 for k in range(10))  # 10 finished in the last second
    assert mesh.retry_after_s() == 2
    mesh._finished_at.clear()
    mesh._finished_at.extend([now - 100.0, now - 99.0])  # too old to count
    assert mesh.retry_after_s() == RETRY_AFTER_UNKNOWN_S
    await mesh.remove_worker("w")


async def test_a_full_scheduler_answers_resource_exhausted_with_retry_after():
    mesh = full_mesh(bound=1)
    server = grpc.aio.server()
    gg.add_SchedulerServicer_to_server(SchedulerServicer(mesh, ModelCard("m", "m")), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    request = g.GenerateRequest(
        prompt_token_ids=g.TokenIds(ids=PROMPT), sampling_params=g.SamplingParams(max_tokens=4)
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = gg.SchedulerStub(channel)
        held = [stub.Generate(request) for _ in range(5)]  # 4 batch slots + 1 waiting
        for _ in range(500):
            if mesh.num_backlog == 1:
                break
            await asyncio.sleep(0.01)
        call = stub.Generate(request)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "full" in refused.value.details()
        assert dict(await call.trailing_metadata())["retry-after"] == str(RETRY_AFTER_UNKNOWN_S)
        for c in held:
            c.cancel()
    await server.stop(0)
    await mesh.remove_worker("w")


async def test_an_api_process_gets_the_core_s_refusal_and_its_retry_after():
    mesh = full_mesh(bound=1)
    for i in range(5):
        mesh.submit(f"r{i}", PROMPT, PARAMS)
    server = grpc.aio.server()
    core_pb2_grpc.add_SchedulerCoreServicer_to_server(SchedulerCoreServicer(mesh), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = CoreClient(f"127.0.0.1:{port}", PLAINTEXT)
    task = asyncio.ensure_future(client.run())
    await asyncio.wait_for(client.attached.wait(), 10)
    item = await asyncio.wait_for(client.submit("x", PROMPT, PARAMS).get(), 10)
    assert isinstance(item, Overloaded) and item.retry_after_s >= 1 and "full" in str(item)
    task.cancel()
    await server.stop(0)
    await mesh.remove_worker("w")
