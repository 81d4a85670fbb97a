"""The scheduler core's Serve stream over a real gRPC server on loopback, with a CoreClient (what
an API process runs) in front: the same tokens as the mesh itself, one message per step, aborts,
refusals, and a core that goes away."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from llmesh.v1 import core_pb2_grpc
from scheduler_svc.core_client import CoreClient
from scheduler_svc.core_servicer import SchedulerCoreServicer
from scheduler_svc.mesh import Mesh, NoWorkerAvailable
from scheduler_svc.planner import RequestRejected
from scheduler_svc.request import FinishReason
from services.grpc_server import PLAINTEXT
from services.sampling_params import SamplingParams
from tests.unit.scheduler_svc.test_mesh import INFO, PROMPTS, collect, local, mesh_config
from tests.unit.scheduler_svc.test_planner import CountingWorker


async def start_core() -> tuple[Mesh, grpc.aio.Server, int]:
    mesh = Mesh(mesh_config())
    mesh.add_worker("w", INFO, local(CountingWorker()))
    server = grpc.aio.server()
    core_pb2_grpc.add_SchedulerCoreServicer_to_server(SchedulerCoreServicer(mesh), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return mesh, server, port


@pytest.fixture
async def core():
    mesh, server, port = await start_core()
    client = CoreClient(f"127.0.0.1:{port}", PLAINTEXT)
    task = asyncio.ensure_future(client.run())
    await asyncio.wait_for(client.attached.wait(), 10)
    yield mesh, client
    task.cancel()
    await server.stop(0)
    await mesh.remove_worker("w")


async def generate(client: CoreClient, rid: str, prompt: list[int], max_tokens: int = 30) -> list[int]:
    queue = client.submit(rid, prompt, SamplingParams(max_tokens=max_tokens))
    tokens: list[int] = []
    while True:
        item = await queue.get()
        if isinstance(item, Exception):
            raise item
        tokens.extend(item.new_token_ids)
        if item.finished:
            return tokens


async def test_tokens_through_the_core_stream_equal_the_mesh_s_own(core):
    mesh, client = core
    assert client.model_info == INFO and client.num_connected == 1
    outs = await asyncio.gather(*(generate(client, rid, p) for rid, p in PROMPTS.items()))
    reference_mesh = Mesh(mesh_config())
    reference_mesh.add_worker("w", INFO, local(CountingWorker()))
    assert dict(zip(PROMPTS, outs, strict=True)) == await collect(reference_mesh)
    await reference_mesh.remove_worker("w")
    assert not mesh.streams  # every request finished and was let go


async def test_an_abort_ends_the_request_here_at_once_and_frees_it_in_the_core(core):
    mesh, client = core
    queue = client.submit("a", PROMPTS["r1"], SamplingParams(max_tokens=10_000, ignore_eos=True))
    first = await queue.get()
    assert not first.finished
    assert client.abort("a") and not client.abort("a")
    while not (last := await queue.get()).finished:
        pass
    assert last.finish_reason == FinishReason.ABORT
    for _ in range(100):
        if not mesh.streams:
            break
        await asyncio.sleep(0.01)
    assert not mesh.streams


async def test_what_the_core_refuses_comes_back_as_a_refusal(core):
    _, client = core
    with pytest.raises(RequestRejected):  # checked here already: outside the vocabulary
        client.submit("v", [INFO.vocab_size], SamplingParams(max_tokens=2))
    with pytest.raises(RequestRejected, match="context|long|max_model_len"):  # checked by the core
        await generate(client, "long", [5] * (INFO.max_model_len + 1), max_tokens=2)


async def test_requests_end_unavailable_when_the_core_goes_away():
    mesh, server, port = await start_core()
    client = CoreClient(f"127.0.0.1:{port}", PLAINTEXT)
    task = asyncio.ensure_future(client.run())
    await asyncio.wait_for(client.attached.wait(), 10)
    queue = client.submit("x", PROMPTS["r2"], SamplingParams(max_tokens=10_000, ignore_eos=True))
    await queue.get()
    await server.stop(0)
    while not isinstance(item := await asyncio.wait_for(queue.get(), 10), Exception):
        assert not item.finished
    assert isinstance(item, NoWorkerAvailable)
    with pytest.raises(NoWorkerAvailable):
        client.submit("y", PROMPTS["r2"], SamplingParams(max_tokens=2))
    task.cancel()
    for _ in range(200):  # the core aborted what the gone API process had submitted
        if not mesh.streams:
            break
        await asyncio.sleep(0.01)
    assert not mesh.streams
    await mesh.remove_worker("w")
