"""The router as a picker (ShardPicker.Route) and the route-then-stream client
(gateway/shard_routing.py), with real gRPC servers on loopback: the client streams from the shard
itself, a repeated prefix lands where it is cached, a refusal before the first response moves the
request, a failure after it ends the call, and a far end without a picker is relayed through."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gateway.shard_routing import ShardChannels, ShardRouter
from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from llmesh.v1 import router_pb2, router_pb2_grpc
from router_svc.core import Router, RouterConfigView
from router_svc.index import Batch
from services.grpc_server import PLAINTEXT
from services.shard_load import ShardLoad
from tests.helpers.shards import start_router, start_shard
from tests.unit.router_svc.test_router_grpc import PREFIX, request, until


async def drain(call) -> tuple[list[int], int]:
    tokens, cached = [], 0
    async for resp in call:
        tokens.extend(resp.token_ids)
        if resp.HasField("usage"):
            cached = resp.usage.cached_prompt_tokens
    return tokens, cached


def client(channel: grpc.aio.Channel, relay=None) -> ShardRouter:
    return ShardRouter(router_pb2_grpc.ShardPickerStub(channel), ShardChannels(PLAINTEXT), relay)


async def test_route_picks_the_prefix_holder_and_books_it():
    shards = [await start_shard(f"s{i}") for i in range(2)]
    router = await start_router([s.address for s in shards])
    try:
        await router.wait_ready(2)
        async with grpc.aio.insecure_channel(router.address) as channel:
            direct = client(channel)
            tokens, _ = await drain(direct.generate(request(PREFIX + [1, 2]), 10.0))
            assert len(tokens) == 4
            holder = max(shards, key=lambda s: len(s.mesh.kv_events.holders))
            await until(lambda: router.router.index.keys)
            for i in range(3):
                call = direct.generate(request(PREFIX + [10 + i, 11]), 10.0)
                tokens, cached = await drain(call)
                assert cached >= 60 and call.shard_id == holder.address  # ids: addresses here
            # Straight from the shard: the relay never saw a request.
            assert all(s.routed == 4 and s.inflight == 0 for s in router.router.shards.values() if s.routed)
            assert router.servicer.num_retries == 0
            picker = router_pb2_grpc.ShardPickerStub(channel)
            ask = router_pb2.RouteRequest(prompt_token_ids=g.TokenIds(ids=PREFIX), exclude=[holder.address])
            reply = await picker.Route(ask)
            assert reply.shard.shard_id != holder.address and not reply.fallbacks
            assert reply.shard.address in {s.address for s in shards}
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await picker.Route(router_pb2.RouteRequest(exclude=[s.address for s in shards]))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await picker.Route(router_pb2.RouteRequest(cache_salt="\x00" * 300))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await router.stop()
        for s in shards:
            await s.stop()


def test_a_booking_counts_until_the_shard_reports():
    router = Router(RouterConfigView(booking_grace_s=0.05))
    a, b = router.add_shard("a", "a:1"), router.add_shard("b", "b:1")
    for s in (a, b):
        router.on_batch(s, Batch("e", 1, snapshot=True), ShardLoad(num_workers=1))
        router.set_connected(s, True)
    first = router.rank([1] * 64)[0][0]
    router.book(first, 64, 0)
    second = router.rank([1] * 64)[0][0]
    assert second is not first  # the booked load moved the next request over
    # A report right away may have been sent before the request reached the shard: it stays.
    router.on_batch(first, _empty_batch(first), ShardLoad(num_workers=1))
    assert (first.booked_tokens, first.booked_requests) == (64, 1)
    time.sleep(0.06)  # a report sent after its trip counts it: the booking goes
    router.on_batch(first, _empty_batch(first), ShardLoad(num_workers=1))
    assert first.booked_tokens == first.booked_requests == 0 and not first.bookings


def _empty_batch(shard):
    return Batch(shard.feed.epoch, shard.feed.expected, False, [], [])


class _StalePicker:
    """A picker whose first answer is a shard that is gone (the router has not noticed yet)."""

    def __init__(self, dead: str, live: str) -> None:
        self.answers = [("dead", dead), ("live", live)]
        self.asked: list[list[str]] = []

    async def Route(self, req, **kw):  # noqa: N802
        self.asked.append(list(req.exclude))
        shard_id, address = next((i, a) for i, a in self.answers if i not in req.exclude)
        return router_pb2.RouteResponse(shard=router_pb2.ShardChoice(shard_id=shard_id, address=address))


async def test_a_refusal_before_the_first_response_asks_again_without_that_shard():
    live = await start_shard("live")
    gone = await start_shard("gone")
    await gone.stop()  # its port refuses now
    try:
        picker = _StalePicker(gone.address, live.address)
        direct = ShardRouter(picker, ShardChannels(PLAINTEXT))  # type: ignore[arg-type]
        tokens, _ = await drain(direct.generate(request([3, 4, 5]), 10.0))
        assert len(tokens) == 4
        assert picker.asked == [[], ["dead"]] and direct.num_retries == 1
    finally:
        await live.stop()


async def test_a_failure_after_the_first_response_ends_the_call():
    slow = await start_shard("slow", step_s=0.05)
    other = await start_shard("other")
    router = await start_router([slow.address, other.address], policy="round-robin")
    try:
        await router.wait_ready(2)
        async with grpc.aio.insecure_channel(router.address) as channel:
            direct = client(channel)
            calls = [direct.generate(request([3, 4, i + 3], max_tokens=400), 30.0) for i in range(2)]
            iters = [c.__aiter__() for c in calls]
            firsts = await asyncio.gather(*(it.__anext__() for it in iters))
            assert all(f.token_ids for f in firsts)
            on_slow = next(c for c in calls if c.shard_id == slow.address)
            await slow.stop()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in iters[calls.index(on_slow)]:
                    pass
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            assert direct.num_retries == 0  # tokens were streamed: never retried elsewhere
    finally:
        await router.stop()
        await other.stop()


async def test_cancel_reaches_the_shard():
    shard = await start_shard("s", step_s=0.02)
    router = await start_router([shard.address])
    try:
        await router.wait_ready(1)
        async with grpc.aio.insecure_channel(router.address) as channel:
            call = client(channel).generate(request([3, 4, 5], max_tokens=1000), 30.0)
            it = call.__aiter__()
            await it.__anext__()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                async for _ in it:
                    pass
            await until(lambda: not shard.mesh.streams)
    finally:
        await router.stop()
        await shard.stop()


async def test_a_far_end_without_a_picker_is_relayed_through():
    shard = await start_shard("s")
    try:
        async with grpc.aio.insecure_channel(shard.address) as channel:
            stub = gg.SchedulerStub(channel)
            direct = client(channel, relay=lambda req, timeout, session: stub.Generate(req, timeout=timeout))
            for _ in range(2):
                tokens, _ = await drain(direct.generate(request([3, 4, 5]), 10.0))
                assert len(tokens) == 4
            assert direct.direct is False
    finally:
        await shard.stop()


async def test_a_session_stays_on_its_shard_through_route():
    shards = [await start_shard(f"s{i}") for i in range(2)]
    router = await start_router([s.address for s in shards], policy="load")
    try:
        await router.wait_ready(2)
        async with grpc.aio.insecure_channel(router.address) as channel:
            direct = client(channel)
            picked = set()
            for i in range(4):
                call = direct.generate(request([3 + i, 4, 5, 6]), 10.0, session="alice")
                await drain(call)
                picked.add(call.shard_id)
            assert len(picked) == 1
    finally:
        await router.stop()
        for s in shards:
            await s.stop()


async def test_idle_shard_channels_are_closed():
    channels = ShardChannels(PLAINTEXT, idle_close_s=0.05)
    entry = channels.acquire("127.0.0.1:1")
    channels.acquire("127.0.0.1:2")
    channels.release("127.0.0.1:1", entry)
    await asyncio.sleep(0.1)
    channels.acquire("127.0.0.1:3")  # sweeps: the idle one goes, the busy one stays
    assert set(channels.channels) == {"127.0.0.1:2", "127.0.0.1:3"}
    await channels.close()


async def test_when_every_shard_is_full_the_direct_caller_gets_resource_exhausted():
    shards = [await start_shard(f"full{i}", step_s=0.5, max_waiting_requests=1) for i in range(2)]
    router = await start_router([s.address for s in shards], policy="round-robin")
    try:
        await router.wait_ready(2)
        async with grpc.aio.insecure_channel(router.address) as channel:
            direct = client(channel)
            held = [direct.generate(request([3, 4, i + 3], max_tokens=100), 30.0) for i in range(18)]
            pumps = [asyncio.ensure_future(drain(c)) for c in held]
            await until(lambda: all(s.mesh.num_backlog == 1 for s in shards))  # 8 slots + 1 each
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await drain(direct.generate(request([7, 7, 7]), 10.0))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert int(dict(refused.value.trailing_metadata())["retry-after"]) >= 1
            assert direct.num_retries >= 2  # both shards were asked
            for c in held:
                c.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
    finally:
        await router.stop()
        for s in shards:
            await s.stop()
