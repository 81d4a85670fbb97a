"""The gateway's FastAPI app: OpenAI routes (chat, completions, Responses), Anthropic's Messages,
vLLM's tokenizer routes, health, version, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from gateway.config import GatewayConfig
from gateway.errors import APIError, install_error_handlers
from gateway.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, adapter_card
from gateway.metrics import CONTENT_TYPE
from gateway.middleware import GuardMiddleware, MetricsMiddleware
from gateway.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from gateway.protocol_anthropic import CountTokensRequest, MessagesRequest
from gateway.protocol_embeddings import EmbeddingRequest
from gateway.protocol_responses import ResponsesRequest
from gateway.response_store import open_store
from gateway.serving_chat import create_chat_completion
from gateway.serving_completion import create_completion
from gateway.serving_embeddings import create_embeddings
from gateway.serving_messages import count_tokens, create_message
from gateway.serving_responses import Responses
from gateway.serving_tokenization import detokenize, tokenize
from gateway.state import GatewayState
from gateway.streaming import RAW_SEND

READY_WAIT_S = 120.0  # how long a process of a multi-process gateway waits to be ready before listening


def _version() -> str:
    try:
        return importlib.metadata.version("llmesh")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0+unknown"


class _App(FastAPI):
    async def __call__(self, scope, receive, send) -> None:
        scope[RAW_SEND] = send  # before any middleware wraps it: SSE bodies go straight to the server
        await super().__call__(scope, receive, send)


def create_app(config: GatewayConfig, state: GatewayState | None = None) -> FastAPI:
    state = state or GatewayState(config)
    responses = Responses(
        state, open_store(config.responses_redis_url, config.responses_store_size, config.responses_ttl_s)
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.client.start()
        connecting = asyncio.ensure_future(state.connect())
        if config.reuse_port:
            # One of several processes on the port: uvicorn listens once this returns, so wait
            # (a while) until ready; the kernel then never hands a client to a process that
            # would answer 503 while the others serve. Past the wait, listen and answer 503.
            # A SIGTERM meanwhile (uvicorn's should_exit; gateway/service.py) ends the wait.
            server = getattr(app.state, "uvicorn", None)
            deadline = asyncio.get_running_loop().time() + READY_WAIT_S
            while not connecting.done() and asyncio.get_running_loop().time() < deadline:
                if server is not None and server.should_exit:
                    break
                await asyncio.wait({connecting}, timeout=0.25)
        try:
            yield
        finally:
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await connecting
            await state.client.close()
            with contextlib.suppress(Exception):
                await responses.store.close()
            state.close()

    app = _App(
        title="llmesh gateway",
        description="OpenAI-compatible API over an llmesh mesh",
        version=_version(),
        lifespan=lifespan,
    )
    app.state.gateway = state
    install_error_handlers(app)
    # Added last = outermost: metrics see every response, including the guard's 401/413/415.
    app.add_middleware(GuardMiddleware, api_keys=config.api_keys, max_body_bytes=config.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)

    @app.get("/health", summary="200 when a generation would be served now, else 503")
    async def health() -> JSONResponse:
        # Readiness is what a request needs, each part in turn: this gateway's tokenizer, the
        # scheduler's own readiness (its gRPC health: tokenizer loaded and a worker connected,
        # which ModelInfo's worker count does not tell while a restarted scheduler loads), a worker.
        state.served()
        if not await state.client.serving(timeout=config.health_timeout_s):
            raise APIError(
                503,
                "The scheduler is not serving yet (loading, or no worker connected).",
                code="service_unavailable",
            )
        info = await state.client.model_info(timeout=config.health_timeout_s)
        if info.num_ready_workers == 0:
            raise APIError(503, "The scheduler has no ready worker.", code="service_unavailable")
        return JSONResponse({"status": "ok", "ready_workers": info.num_ready_workers})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        try:
            state.metrics.scheduler.snapshot = await state.client.stats(timeout=config.health_timeout_s)
        except APIError:
            state.metrics.scheduler.snapshot = None  # llmesh:scheduler_up 0, no stale worker gauges
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def model_card(name: str) -> dict[str, Any]:
        info = state.served().info
        return {
            "id": name,
            "object": "model",
            "created": info.created,
            "owned_by": "llmesh",
            "root": info.root,
            "parent": None,
            "max_model_len": info.max_model_len,
        }

    def any_card(name: str) -> dict[str, Any]:
        model = state.resolve(name)
        if model.lora is None:
            return model_card(name)
        return adapter_card(model.lora, model.names[0], model.info.created)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        names = state.served().names + [a.name for a in state.loras.adapters]
        return {"object": "list", "data": [any_card(n) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        return any_card(model_id)

    if config.allow_runtime_lora_updating:

        @app.post("/v1/load_lora_adapter", summary="serve a LoRA adapter as a model (vLLM's)")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
            await state.loras.load(body.lora_name, body.lora_path, state.served().names)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter", summary="stop serving a LoRA adapter (vLLM's)")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
            state.loras.unload(body.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(state, body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await create_embeddings(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(state, body, request)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await responses.create(body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
        return await responses.retrieve(response_id, request)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        return await responses.delete(response_id, request)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_message(state, body, request)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest) -> dict[str, Any]:
        return await count_tokens(state, body)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        return await tokenize(state, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        return await detokenize(state, body)

    return app
