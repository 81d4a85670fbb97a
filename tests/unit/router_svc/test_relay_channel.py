"""The router relays Generate on a channel without client interceptors (one event-loop hop less
per token) and still sends the mesh's key with every call."""

from __future__ import annotations

import grpc
import pytest

from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from router_svc.shards import relay_generate
from services.auth import server_auth
from services.grpc_server import PLAINTEXT, ChannelSecurity

KEY = "relay-key-0123456789"


class _Echo(gg.SchedulerServicer):
    def __init__(self) -> None:
        self.keys: list[str | None] = []

    async def Generate(self, request, context):
        self.keys.append(dict(context.invocation_metadata()).get("authorization"))
        yield g.GenerateResponse(token_ids=[7, 8])
        yield g.GenerateResponse(token_ids=[9])


async def test_generate_relay_carries_the_key_and_the_raw_bytes():
    echo = _Echo()
    server = grpc.aio.server(interceptors=[server_auth(KEY)])
    gg.add_SchedulerServicer_to_server(echo, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    channels = []
    try:
        channel, generate = relay_generate(address, ChannelSecurity(key=KEY), 30.0)
        channels.append(channel)
        call = generate(g.GenerateRequest(prompt_token_ids=g.TokenIds(ids=[1, 2])), timeout=10)
        assert type(call).__name__ == "UnaryStreamCall"  # not InterceptedUnaryStreamCall
        raws = [raw async for raw in call]
        assert all(isinstance(raw, bytes) for raw in raws)
        assert [list(g.GenerateResponse.FromString(raw).token_ids) for raw in raws] == [[7, 8], [9]]
        assert echo.keys == [f"Bearer {KEY}"]

        channel, generate = relay_generate(address, PLAINTEXT, 30.0)  # no key: refused
        channels.append(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [raw async for raw in generate(g.GenerateRequest(), timeout=10)]
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        for channel in channels:
            await channel.close()
        await server.stop(0)
