"""The router with real gRPC servers on loopback: shards' KV events feed its index, a repeated
prefix goes where it is cached, shards join, leave, die and come back, and nothing hangs."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from llmesh.v1 import router_pb2, router_pb2_grpc
from tests.helpers.shards import start_router, start_shard

PREFIX = [(i * 7) % 90 + 3 for i in range(64)]  # 16 blocks of 4 tokens


def request(prompt: list[int], max_tokens: int = 4, rid: str = "") -> g.GenerateRequest:
    return g.GenerateRequest(
        request_id=rid,
        prompt_token_ids=g.TokenIds(ids=prompt),
        sampling_params=g.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


async def generate(stub, prompt, max_tokens=4, session="", timeout=10.0):
    metadata = (("x-session-id", session),) if session else None
    tokens, cached = [], 0
    async for resp in stub.Generate(request(prompt, max_tokens), timeout=timeout, metadata=metadata):
        tokens.extend(resp.token_ids)
        if resp.HasField("usage"):
            cached = resp.usage.cached_prompt_tokens
    return tokens, cached


async def until(check, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


async def test_a_repeated_prefix_goes_to_the_shard_that_cached_it():
    shards = [await start_shard(f"s{i}") for i in range(3)]
    router = await start_router([s.address for s in shards])
    try:
        await router.wait_ready(3)
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = gg.SchedulerStub(channel)
            await generate(stub, PREFIX + [1, 2])
            holder = max(shards, key=lambda s: len(s.mesh.kv_events.holders))
            await until(lambda: router.router.index.keys)  # its stored events reached the index
            for i in range(4):
                _, cached = await generate(stub, PREFIX + [10 + i, 11, 12])
                assert cached >= 60  # served from cache, on the shard that holds the prefix
            others = [s for s in shards if s is not holder]
            assert all(not s.mesh.kv_events.holders for s in others)
            assert router.router.num_prefix_tokens >= 4 * 60
    finally:
        await router.stop()
        for s in shards:
            await s.stop()


async def test_session_affinity_keeps_a_session_on_its_shard():
    shards = [await start_shard(f"s{i}") for i in range(2)]
    router = await start_router([s.address for s in shards], policy="load")
    try:
        await router.wait_ready(2)
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = gg.SchedulerStub(channel)
            for i in range(4):
                await generate(stub, [3 + i, 4, 5, 6, 7], session="alice")
            routed = {s.shard_id: s.routed for s in router.router.shards.values()}
            assert sorted(routed.values()) == [0, 4]
    finally:
        await router.stop()
        for s in shards:
            await s.stop()


async def test_a_dead_shard_s_waiting_requests_move_and_its_streaming_ones_end_cleanly():
    slow = await start_shard("slow", step_s=0.05)
    fast = await start_shard("fast")
    router = await start_router([slow.address, fast.address], policy="round-robin")
    try:
        await router.wait_ready(2)
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = gg.SchedulerStub(channel)
            # Fill the slow shard's 8 batch slots with long streams, then queue more behind them.
            calls = [stub.Generate(request([3, 4, 5, i + 3], max_tokens=400), timeout=30) for i in range(24)]
            streaming = lambda: any(s.started for s in slow.mesh.streams.values())  # noqa: E731
            await until(lambda: slow.mesh.num_backlog > 0 and streaming())
            await slow.stop()  # SIGKILL-like: its streams break, its port refuses
            results = await asyncio.gather(*(_drain(c) for c in calls), return_exceptions=True)
            codes = [r if isinstance(r, grpc.StatusCode) else "ok" for r in results]
            # Requests that had streamed end UNAVAILABLE; those that had not were moved and finished.
            assert set(codes) <= {"ok", grpc.StatusCode.UNAVAILABLE}
            assert codes.count("ok") >= 12 and codes.count(grpc.StatusCode.UNAVAILABLE) >= 1
            assert router.servicer.num_retries >= 1
            # New requests go to the live shard only.
            await until(lambda: len(router.router.ready_shards) == 1)
            for i in range(3):
                tokens, _ = await generate(stub, [9, 9, i + 3])
                assert len(tokens) == 4
    finally:
        await router.stop()
        await fast.stop()


async def _drain(call) -> str | grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return "ok"


async def test_a_shard_that_comes_back_rejoins():
    a = await start_shard("a")
    b = await start_shard("b")
    router = await start_router([a.address, b.address])
    try:
        await router.wait_ready(2)
        port = a.port
        await a.stop()
        await until(lambda: len(router.router.ready_shards) == 1)
        a = await start_shard("a", port=port)
        await router.wait_ready(2)
    finally:
        await router.stop()
        await a.stop()
        await b.stop()


async def test_no_shard_answers_unavailable_at_once():
    router = await start_router([])
    try:
        async with grpc.aio.insecure_channel(router.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(gg.SchedulerStub(channel), [3, 4, 5])
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await router.stop()


async def test_shards_register_and_deregister_at_runtime():
    shard = await start_shard("late")
    router = await start_router([])
    try:
        async with grpc.aio.insecure_channel(router.address) as channel:
            registry = router_pb2_grpc.ShardRegistryStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await registry.RegisterShard(router_pb2.RegisterShardRequest(address="nowhere"))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            reply = await registry.RegisterShard(
                router_pb2.RegisterShardRequest(address=shard.address, shard_id="late")
            )
            assert reply.accepted
            await router.wait_ready(1)
            tokens, _ = await generate(gg.SchedulerStub(channel), [3, 4, 5])
            assert len(tokens) == 4
            left = await registry.DeregisterShard(router_pb2.DeregisterShardRequest(shard_id="late"))
            assert left.removed and not router.router.shards
    finally:
        await router.stop()
        await shard.stop()


async def test_a_pool_whose_workers_join_after_the_router_subscribed_is_indexed():
    from llmesh.local_link import LocalWorkerLink
    from tests.helpers.shards import INFO
    from tests.unit.scheduler_svc.test_planner import CountingWorker

    shards = [await start_shard(f"e{i}", num_workers=0) for i in range(2)]
    router = await start_router([s.address for s in shards])
    try:
        await until(lambda: all(s.connected for s in router.router.shards.values()))
        for s in shards:  # the snapshot said nothing of the cache layout: the batches after it do
            worker = CountingWorker()
            s.mesh.add_worker(f"{s.name}-w", INFO, LocalWorkerLink(worker.execute, INFO, worker.seqs.clear))
        await router.wait_ready(2)
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = gg.SchedulerStub(channel)
            await generate(stub, PREFIX + [1])
            await until(lambda: router.router.index.keys)
            for i in range(3):
                _, cached = await generate(stub, PREFIX + [2 + i])
                assert cached >= 60
    finally:
        await router.stop()
        for s in shards:
            await s.stop()


async def test_shards_found_by_dns_join():
    shard = await start_shard("dns")
    router = await start_router([], shards_dns=f"localhost:{shard.port}", dns_refresh_s=0.1)
    try:
        await router.wait_ready(1)  # localhost may also resolve to ::1, where nothing listens
        assert any(s.registered for s in router.router.ready_shards)
    finally:
        await router.stop()
        await shard.stop()


async def test_abort_through_the_router_ends_the_stream():
    shard = await start_shard("slowish", step_s=0.02)
    router = await start_router([shard.address])
    try:
        await router.wait_ready(1)
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = gg.SchedulerStub(channel)
            call = stub.Generate(request([3, 4, 5], max_tokens=500, rid="mine"), timeout=30)
            first = await call.read()
            assert first.request_id == "mine"
            reply = await stub.Abort(g.AbortRequest(request_ids=["mine", "unknown"]))
            assert list(reply.aborted_ids) == ["mine"]
            last = first
            while (resp := await call.read()) is not grpc.aio.EOF:
                last = resp
            assert last.finish_reason == g.FINISH_REASON_ABORT
    finally:
        await router.stop()
        await shard.stop()


async def test_when_every_shard_is_full_the_caller_gets_resource_exhausted_with_retry_after():
    shards = [await start_shard(f"full{i}", step_s=0.5, max_waiting_requests=1) for i in range(2)]
    router = await start_router([s.address for s in shards], policy="round-robin")
    try:
        await router.wait_ready(2)
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = gg.SchedulerStub(channel)
            held = [stub.Generate(request([3, 4, i + 3], max_tokens=100), timeout=30) for i in range(18)]
            await until(lambda: all(s.mesh.num_backlog == 1 for s in shards))  # 8 slots + 1 each
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await generate(stub, [7, 7, 7])
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert int(dict(refused.value.trailing_metadata())["retry-after"]) >= 1
            assert router.servicer.num_retries >= 2  # both shards were asked
            for c in held:
                c.cancel()
    finally:
        await router.stop()
        for s in shards:
            await s.stop()
