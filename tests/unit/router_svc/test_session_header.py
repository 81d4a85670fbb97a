"""The gateway forwards the HTTP `x-session-id` header as gRPC metadata of the same name (the
router keeps a session on its shard); an unprintable one is dropped."""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from gateway.middleware import GuardMiddleware
from gateway.scheduler_client import SESSION_ID, SchedulerClient
from services.grpc_server import PLAINTEXT


def app() -> FastAPI:
    api = FastAPI()

    @api.post("/echo")
    async def echo() -> dict:
        return {"session": SESSION_ID.get()}

    api.add_middleware(GuardMiddleware, api_keys=[], max_body_bytes=1 << 20)
    return api


async def post(headers: dict) -> str:
    transport = httpx.ASGITransport(app=app())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        r = await client.post("/echo", json={}, headers=headers)
        return r.json()["session"]


async def test_the_header_reaches_the_request_s_context():
    assert await post({"x-session-id": "conv-42"}) == "conv-42"
    assert await post({}) == ""
    assert await post({"x-session-id": "a" * 1000}) == "a" * 256


async def test_generate_sends_it_as_metadata():
    sent = {}

    class Stub:
        def Generate(self, request, **kw):
            sent.update(kw)

    client = SchedulerClient("127.0.0.1:1", security=PLAINTEXT)  # no key: only the session's metadata
    client._scheduler = Stub()  # type: ignore[assignment]
    token = SESSION_ID.set("conv-7")
    try:
        client.generate(None, 1.0)  # type: ignore[arg-type]
    finally:
        SESSION_ID.reset(token)
    assert sent["metadata"] == (("x-session-id", "conv-7"),)
    client.generate(None, 1.0)  # type: ignore[arg-type]
    assert sent["metadata"] is None
