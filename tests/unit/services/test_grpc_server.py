"""The shared gRPC bootstrap, against a real grpc.aio server on an ephemeral loopback port."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.gen_protos import ensure_stubs

ensure_stubs()  # before the imports below: they load the generated llmesh.v1 modules

from llmesh.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
from services.grpc_server import GrpcServer, ServerConfig, Service, open_channel, serve  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[3]
SCHEDULER = "llmesh.v1.Scheduler"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class SleepyScheduler(generation_pb2_grpc.SchedulerServicer):
    """Tokenize("sleep:S") sleeps S seconds, then answers; records handler cancellations."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def Tokenize(self, request, context):  # noqa: N802
        if request.text.startswith("sleep:"):
            try:
                await asyncio.sleep(float(request.text.split(":", 1)[1]))
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return generation_pb2.TokenizeResponse(token_ids=[1, 2, 3], max_model_len=len(request.text))


def tokenize(channel: grpc.aio.Channel, text: str, timeout: float | None = 10.0):
    return generation_pb2_grpc.SchedulerStub(channel).Tokenize(
        generation_pb2.TokenizeRequest(text=text), timeout=timeout
    )


def make_server(servicer: SleepyScheduler, **config) -> GrpcServer:
    service = Service.of(SCHEDULER, generation_pb2_grpc.add_SchedulerServicer_to_server, servicer)
    return GrpcServer([service], ServerConfig(**config))


@pytest.fixture
async def running() -> AsyncIterator[tuple[GrpcServer, SleepyScheduler, grpc.aio.Channel]]:
    servicer = SleepyScheduler()
    server = make_server(servicer, shutdown_grace_s=5.0)
    await server.start()
    channel = open_channel(server.address)
    try:
        yield server, servicer, channel
    finally:
        await channel.close()
        await server.stop(0)


async def test_binds_loopback_ephemeral_port(running) -> None:
    server, _, channel = running
    assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"
    assert list((await tokenize(channel, "hi")).token_ids) == [1, 2, 3]


async def test_a_taken_port_fails_loudly(running) -> None:
    server, servicer, _ = running
    # No SO_REUSEPORT: a second server on the same port must not bind "successfully".
    other = make_server(servicer, port=server.port)
    with pytest.raises(OSError, match="cannot bind"):
        await other.start()
    await other.stop(0)


async def test_health_goes_from_not_serving_to_serving(running) -> None:
    server, _, channel = running
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", SCHEDULER):
        assert (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status == NOT_SERVING
    await server.set_serving()
    for name in ("", SCHEDULER):
        assert (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status == SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_health_watch_follows_changes_and_ends_on_drain(running) -> None:
    server, _, channel = running
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert (await watch.read()).status == NOT_SERVING
    await server.set_serving()
    assert (await watch.read()).status == SERVING
    started = time.monotonic()
    stop = asyncio.ensure_future(server.stop())  # grace 5 s: an open Watch must not hold it
    assert (await watch.read()).status == NOT_SERVING
    await stop
    assert time.monotonic() - started < 2.0


async def test_reflection_lists_and_describes_services(running) -> None:
    _, _, channel = running
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def ask(**kw) -> reflection_pb2.ServerReflectionResponse:
        call = stub.ServerReflectionInfo(timeout=5)
        await call.write(reflection_pb2.ServerReflectionRequest(**kw))
        await call.done_writing()
        return await call.read()

    listed = {s.name for s in (await ask(list_services="")).list_services_response.service}
    assert {SCHEDULER, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= listed
    files = (await ask(file_containing_symbol=SCHEDULER)).file_descriptor_response.file_descriptor_proto
    assert files  # grpcurl-style clients can decode llmesh.v1 messages without the .proto


async def test_deadline_exceeded_cancels_the_handler(running) -> None:
    _, servicer, channel = running
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await tokenize(channel, "sleep:10", timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 2.0
    # The server stops working for a caller that has gone.
    await asyncio.wait_for(servicer.cancelled.wait(), timeout=2.0)


async def test_message_size_limit_is_enforced() -> None:
    server = make_server(SleepyScheduler(), max_message_bytes=1024)
    await server.start()
    async with open_channel(server.address) as channel:
        assert (await tokenize(channel, "x" * 500)).max_model_len == 500
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await tokenize(channel, "x" * 4096)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await server.stop(0)


async def test_graceful_stop_finishes_in_flight_and_refuses_new(running) -> None:
    server, _, channel = running
    drained: list[str] = []
    server.on_drain(lambda: drained.append("sync"))

    async def async_cb() -> None:
        drained.append("async")

    server.on_drain(async_cb)
    await server.set_serving()
    in_flight = asyncio.ensure_future(tokenize(channel, "sleep:0.5"))
    await asyncio.sleep(0.1)  # let it reach the handler
    started = time.monotonic()
    await server.stop()  # grace 5 s
    assert (await in_flight).token_ids == [1, 2, 3]
    assert time.monotonic() - started < 3.0  # returned when the call ended, not after the grace
    assert drained == ["sync", "async"] and server.draining.is_set()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await tokenize(channel, "late", timeout=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    await server.set_serving()  # ignored once draining


async def test_stop_cancels_calls_past_the_grace(running) -> None:
    server, servicer, channel = running
    in_flight = asyncio.ensure_future(tokenize(channel, "sleep:30"))
    await asyncio.sleep(0.1)
    started = time.monotonic()
    await server.stop(grace=0.3)
    assert time.monotonic() - started < 2.0
    with pytest.raises(grpc.aio.AioRpcError):
        await in_flight
    assert servicer.cancelled.is_set()


async def test_a_second_stop_shortens_the_grace(running) -> None:
    server, _, channel = running
    in_flight = asyncio.ensure_future(tokenize(channel, "sleep:30"))
    await asyncio.sleep(0.1)
    started = time.monotonic()
    first = asyncio.ensure_future(server.stop(grace=20))  # as SIGTERM
    await asyncio.sleep(0.1)
    await server.stop(grace=0)  # as a second SIGTERM
    await asyncio.wait_for(first, timeout=2)
    assert time.monotonic() - started < 2.0
    with pytest.raises(grpc.aio.AioRpcError):
        await in_flight
    await server.stop()  # and once stopped, stop() is a no-op


async def test_a_hung_or_failing_drain_callback_cannot_hold_the_drain(running) -> None:
    server, _, _ = running

    def fails() -> None:
        raise RuntimeError("boom")

    server.on_drain(fails)
    server.on_drain(lambda: asyncio.sleep(60))
    started = time.monotonic()
    await server.stop(grace=0.3)
    assert time.monotonic() - started < 2.0


async def test_serve_runs_until_request_stop() -> None:
    servicer = SleepyScheduler()
    seen: dict[str, object] = {}

    async def on_started(server: GrpcServer) -> None:
        seen["server"] = server
        server.request_stop()  # as a signal would

    service = Service.of(SCHEDULER, generation_pb2_grpc.add_SchedulerServicer_to_server, servicer)
    await asyncio.wait_for(serve([service], ServerConfig(), on_started=on_started), timeout=5)
    assert seen["server"].draining.is_set()


SIGTERM_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from llmesh.v1 import generation_pb2_grpc
    from services.grpc_server import ServerConfig, Service, serve
    from services.logging_setup import setup_logging
    from tests.unit.services.test_grpc_server import SCHEDULER, SleepyScheduler

    async def main() -> None:
        async def announce(server) -> None:
            print(server.port, flush=True)

        add = generation_pb2_grpc.add_SchedulerServicer_to_server
        service = Service.of(SCHEDULER, add, SleepyScheduler())
        await serve([service], ServerConfig(shutdown_grace_s=10.0), on_started=announce)

    setup_logging("test", "INFO")
    asyncio.run(main())
    """
)


async def test_sigterm_drains_in_flight_and_exits_zero() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_SCRIPT],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Prepend, not replace: the packages may come from PYTHONPATH too.
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout=20)
        assert line.strip(), f"server did not start: {proc.wait(5)=} {proc.stderr.read()}"
        port = int(line)
        async with open_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == SERVING
            in_flight = asyncio.ensure_future(tokenize(channel, "sleep:0.7"))
            await asyncio.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            assert (await in_flight).token_ids == [1, 2, 3]  # finished, not cut off
        code = await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout=10)
        stderr = proc.stderr.read()
        assert code == 0, stderr
        msgs = [json.loads(line)["msg"] for line in stderr.splitlines() if line.startswith("{")]
        assert "signal received, draining" in msgs and "grpc server stopped" in msgs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
