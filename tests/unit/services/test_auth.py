"""Bearer keys on a real grpc.aio server: the public API key, the internal key, open health and reflection."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from llmesh.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.auth import BearerAuth, bearer_metadata, server_auth
from services.grpc_server import PLAINTEXT, ChannelSecurity, GrpcServer, ServerConfig, Service, open_channel

API_KEY, INTERNAL_KEY = "public-key", "internal-key-of-the-test"


class Scheduler(generation_pb2_grpc.SchedulerServicer):
    async def Tokenize(self, request, context):  # noqa: N802  unary-unary
        return generation_pb2.TokenizeResponse(token_ids=[1, 2])

    async def Generate(self, request, context):  # noqa: N802  unary-stream
        yield generation_pb2.GenerateResponse(request_id="r")


class Worker(worker_pb2_grpc.WorkerServicer):
    async def Step(self, request_iterator, context):  # noqa: N802  stream-stream
        async for plan in request_iterator:
            yield worker_pb2.StepResult(step_id=plan.step_id)


class Store(kvstore_pb2_grpc.KVStoreServicer):
    async def Put(self, request_iterator, context):  # noqa: N802  stream-unary
        return kvstore_pb2.PutResponse(num_stored=len([r async for r in request_iterator]))


@pytest.fixture
async def server() -> AsyncIterator[GrpcServer]:
    services = [
        Service.of("llmesh.v1.Scheduler", generation_pb2_grpc.add_SchedulerServicer_to_server, Scheduler()),
        Service.of("llmesh.v1.Worker", worker_pb2_grpc.add_WorkerServicer_to_server, Worker()),
        Service.of("llmesh.v1.KVStore", kvstore_pb2_grpc.add_KVStoreServicer_to_server, Store()),
    ]
    server = GrpcServer(
        services, ServerConfig(internal_key=INTERNAL_KEY), public_keys={"llmesh.v1.Scheduler": API_KEY}
    )
    await server.start()
    await server.set_serving()
    try:
        yield server
    finally:
        await server.stop(0)


async def _calls(channel: grpc.aio.Channel) -> dict[str, object]:
    """One call of each streaming shape; each value is the result or the status code it ended with."""
    scheduler = generation_pb2_grpc.SchedulerStub(channel)
    results: dict[str, object] = {}

    async def attempt(name, make):
        try:
            results[name] = await make()
        except grpc.aio.AioRpcError as e:
            results[name] = e.code()

    await attempt("tokenize", lambda: scheduler.Tokenize(generation_pb2.TokenizeRequest(text="x"), timeout=5))

    async def generate():
        return [r.request_id async for r in scheduler.Generate(generation_pb2.GenerateRequest(), timeout=5)]

    await attempt("generate", generate)

    async def step():  # the Step stream's own style: write, read
        call = worker_pb2_grpc.WorkerStub(channel).Step(timeout=5)
        await call.write(worker_pb2.StepPlan(step_id=7))
        result = await call.read()
        await call.done_writing()
        return result.step_id

    await attempt("step", step)
    put = kvstore_pb2_grpc.KVStoreStub(channel).Put
    await attempt("put", lambda: put(iter([kvstore_pb2.PutRequest()] * 2), timeout=5))
    return results


OK = {"tokenize": generation_pb2.TokenizeResponse(token_ids=[1, 2]), "generate": ["r"], "step": 7}
OK["put"] = kvstore_pb2.PutResponse(num_stored=2)
REFUSED = grpc.StatusCode.UNAUTHENTICATED


async def test_no_key_is_refused_everywhere_but_health_and_reflection(server) -> None:
    async with open_channel(server.address, PLAINTEXT) as channel:  # a stranger: no key at all
        assert await _calls(channel) == dict.fromkeys(OK, REFUSED)
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name async for r in stream for s in r.list_services_response.service}
        assert "llmesh.v1.Scheduler" in names


async def test_the_internal_key_opens_every_service(server) -> None:
    async with open_channel(server.address, ChannelSecurity(key=INTERNAL_KEY)) as channel:
        assert await _calls(channel) == OK


async def test_the_api_key_opens_only_the_public_api(server) -> None:
    async with open_channel(server.address, ChannelSecurity(key=API_KEY)) as channel:
        assert await _calls(channel) == {**dict.fromkeys(OK, REFUSED), "tokenize": OK["tokenize"]} | {
            "generate": ["r"]
        }


async def test_a_wrong_key_or_scheme_is_refused(server) -> None:
    async with open_channel(server.address, ChannelSecurity(key="guess")) as channel:
        assert await _calls(channel) == dict.fromkeys(OK, REFUSED)
    async with open_channel(server.address, PLAINTEXT) as channel:
        stub = generation_pb2_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:  # the key, but not as a bearer token
            await stub.Tokenize(generation_pb2.TokenizeRequest(), metadata=(("authorization", API_KEY),))
        assert e.value.code() == REFUSED
        ok = await stub.Tokenize(generation_pb2.TokenizeRequest(), metadata=bearer_metadata(API_KEY))
        assert list(ok.token_ids) == [1, 2]


def test_server_auth_is_off_without_keys_and_checks_per_service() -> None:
    assert server_auth(None, {"llmesh.v1.Scheduler": None}) is None
    only_public = server_auth(None, {"llmesh.v1.Scheduler": API_KEY})
    assert isinstance(only_public, BearerAuth)
    assert only_public.allows("/llmesh.v1.Registry/GetStats", ())  # no internal key: internal RPCs open
    assert not only_public.allows("/llmesh.v1.Scheduler/Generate", ())
    assert only_public.allows("/llmesh.v1.Scheduler/Generate", (("authorization", f"bearer {API_KEY}"),))
    both = server_auth(INTERNAL_KEY, {"llmesh.v1.Scheduler": API_KEY})
    assert not both.allows("/llmesh.v1.Registry/RegisterWorker", bearer_metadata(API_KEY))
    assert both.allows("/llmesh.v1.Registry/RegisterWorker", bearer_metadata(INTERNAL_KEY))
    assert both.allows("/grpc.health.v1.Health/Check", ())


def test_a_public_api_without_its_key_is_open_and_the_rest_is_not() -> None:
    auth = server_auth(INTERNAL_KEY, {"llmesh.v1.Scheduler": None})
    assert auth.allows("/llmesh.v1.Scheduler/Generate", ())
    assert not auth.allows("/llmesh.v1.Registry/RegisterWorker", ())
    assert not auth.allows("/llmesh.v1.KVStore/Lookup", ())


def test_no_key_given_is_never_no_key(tmp_path, monkeypatch) -> None:
    """Secure by default: on loopback this user's local key, off loopback a refusal."""
    from services.mesh_secret import MissingSecret, local_key

    monkeypatch.setenv("LLMESH_CACHE", str(tmp_path))
    monkeypatch.delenv("LLMESH_INTERNAL_KEY")  # the test session's; here nothing is given
    key = ServerConfig(internal_key="").internal_key
    assert key == local_key() and len(key) >= 32
    assert (tmp_path / "internal.key").stat().st_mode & 0o777 == 0o600
    with pytest.raises(MissingSecret, match="LLMESH_INTERNAL_KEY"):
        ServerConfig(host="0.0.0.0")
    assert ServerConfig(host="0.0.0.0", internal_key=INTERNAL_KEY).internal_key == INTERNAL_KEY
    secret = tmp_path / "mounted"
    secret.write_text(f"  {INTERNAL_KEY}\n")
    assert ServerConfig(host="10.0.0.1", internal_key_file=str(secret)).internal_key == INTERNAL_KEY
    with pytest.raises(ValueError, match="shorter"):
        ServerConfig(internal_key="guessable")


async def test_blocking_channels_send_the_key_too(server) -> None:
    """The worker's KV store client and the health probes use blocking channels."""
    import asyncio

    from services.grpc_server import open_sync_channel

    def calls(key: str | None) -> tuple[object, object]:
        with open_sync_channel(server.address, ChannelSecurity(key=key)) as channel:
            out = []
            for call in (
                lambda: kvstore_pb2_grpc.KVStoreStub(channel).Put(
                    iter([kvstore_pb2.PutRequest()]), timeout=5
                ),
                lambda: [
                    r.step_id
                    for r in worker_pb2_grpc.WorkerStub(channel).Step(
                        iter([worker_pb2.StepPlan(step_id=3)]), timeout=5
                    )
                ],
            ):
                try:
                    out.append(call())
                except grpc.RpcError as e:
                    out.append(e.code())
            return tuple(out)

    assert await asyncio.to_thread(calls, None) == (REFUSED, REFUSED)
    assert await asyncio.to_thread(calls, INTERNAL_KEY) == (kvstore_pb2.PutResponse(num_stored=1), [3])
