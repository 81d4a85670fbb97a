"""ShardChannels keeps several connections per shard: a shard's API processes share its port and
the kernel hands each connection, not each stream, to one of them, so one connection would load
one API process; so does the router's relay. Real gRPC server on loopback; the server answers
each call with its caller's port."""

from __future__ import annotations

import asyncio

import grpc

from gateway.shard_routing import ShardChannels
from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from router_svc.shards import relay_generate
from services.grpc_server import PLAINTEXT


class PeerPort(gg.SchedulerServicer):
    """Generate answers one response whose token is the caller's port (its connection)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def Generate(self, request, context):
        await self.release.wait()  # every stream stays open until all were placed
        yield g.GenerateResponse(token_ids=[int(context.peer().rsplit(":", 1)[1])])


async def test_streams_spread_over_a_shards_connections():
    server = grpc.aio.server()
    servicer = PeerPort()
    gg.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    channels = ShardChannels(PLAINTEXT, connections=4)
    try:
        lanes = [channels.acquire(address) for _ in range(8)]
        assert len({id(lane) for lane in lanes}) == 4  # the least busy first: 2 streams on each
        assert all(lane.inflight == 2 for lane in lanes) and channels.channels[address].inflight == 8

        async def one(lane) -> int:
            call = lane.generate(g.GenerateRequest(), timeout=10)
            return [t async for resp in call for t in resp.token_ids][0]

        calls = [asyncio.ensure_future(one(lane)) for lane in lanes]
        await asyncio.sleep(0.2)
        servicer.release.set()
        ports = await asyncio.gather(*calls)
        assert len(set(ports)) == 4  # four TCP connections, not one shared by the process
        for lane in lanes:
            channels.release(address, lane)
        assert channels.channels[address].inflight == 0
        # An unreachable shard's connections are all dropped once none is in use.
        lane = channels.acquire(address)
        channels.release(address, lane, broken=True)
        assert address not in channels.channels
    finally:
        await channels.close()
        await server.stop(None)


async def test_the_relay_spreads_its_calls_over_connections_of_its_own():
    server = grpc.aio.server()
    servicer = PeerPort()
    servicer.release.set()
    gg.add_SchedulerServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    lanes, generate = relay_generate(address, PLAINTEXT, 30.0, connections=3)
    try:
        ports = set()
        for _ in range(6):  # round robin: each connection twice
            raws = [raw async for raw in generate(g.GenerateRequest(), timeout=10)]
            ports.add(g.GenerateResponse.FromString(raws[0]).token_ids[0])
        assert len(ports) == 3
    finally:
        await lanes.close()
        await server.stop(None)


class NamedProcess(gg.SchedulerServicer):
    """An API process of a shard: GetModelInfo names it (as scheduler_svc/api_server.py does)."""

    def __init__(self, name: str, count: int) -> None:
        self.name, self.count = name, count

    async def GetModelInfo(self, request, context):
        await context.send_initial_metadata(
            (("x-llmesh-api-process", self.name), ("x-llmesh-api-processes", str(self.count)))
        )
        return g.ModelInfo()


async def test_streams_are_even_over_a_shards_processes_not_its_connections():
    # Two "API processes" on one port (SO_REUSEPORT): the kernel hands each connection to one.
    servers, port = [], 0
    for name in ("p0", "p1"):
        server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
        gg.add_SchedulerServicer_to_server(NamedProcess(name, 2), server)
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        servers.append(server)
    address = f"127.0.0.1:{port}"
    channels = ShardChannels(PLAINTEXT, connections=4)
    try:
        channels.release(address, channels.acquire(address))  # opens and identifies the lanes
        entry = channels.channels[address]
        for _ in range(100):
            await asyncio.sleep(0.02)
            if all(lane.process for lane in entry.lanes) and {lane.process for lane in entry.lanes} == {
                "p0",
                "p1",
            }:
                break
        assert entry.processes == 2 and {lane.process for lane in entry.lanes} == {"p0", "p1"}
        lanes = [channels.acquire(address) for _ in range(10)]
        per_process = {name: sum(lane.process == name for lane in lanes) for name in ("p0", "p1")}
        assert per_process == {"p0": 5, "p1": 5}, [lane.process for lane in entry.lanes]
        for lane in lanes:
            channels.release(address, lane)
    finally:
        await channels.close()
        for server in servers:
            await server.stop(None)


async def test_connections_are_added_until_every_process_is_reached_and_no_further():
    server = grpc.aio.server()
    gg.add_SchedulerServicer_to_server(NamedProcess("p0", 3), server)  # says 3: 2 never reached
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    channels = ShardChannels(PLAINTEXT, connections=2)
    try:
        channels.release(address, channels.acquire(address))
        entry = channels.channels[address]
        for _ in range(100):
            await asyncio.sleep(0.02)
            if len(entry.lanes) == 12 and all(lane.process for lane in entry.lanes):
                break
        await asyncio.sleep(0.1)
        assert len(entry.lanes) == 12 and {lane.process for lane in entry.lanes} == {"p0"}  # 4 per process
    finally:
        await channels.close()
        await server.stop(None)
