"""The router's gRPC edge: the public `Scheduler` API in front of the shards, and `ShardRegistry`.

Generate picks a shard (router_svc/core.py) and relays that shard's stream untouched, so a client
cannot tell a router from a scheduler. Before the first response, a shard that is unreachable,
has no worker (UNAVAILABLE) or is full (RESOURCE_EXHAUSTED) costs nothing but a retry on the next
best shard; when every shard refused, the caller gets RESOURCE_EXHAUSTED with the shortest
retry-after, when none could be reached, UNAVAILABLE. After the first response a shard's failure
ends the call with its status (UNAVAILABLE when the shard died): tokens already streamed cannot
be taken back, and the caller must not hang.

Session affinity: gRPC metadata `x-session-id` (the gateway forwards the HTTP header of the same
name). Prompts must be token ids to use the prefix index (the gateway sends them); a text prompt
is routed by load and tokenized by its shard.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from llmesh.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from router_svc.core import Router, Shard
from router_svc.shards import ShardPool
from services.prefix_hash import check_salt

log = logging.getLogger(__name__)

SESSION_KEY = "x-session-id"
RETRY_AFTER_KEY = "retry-after"
MAX_SESSION_CHARS = 256
# Codes a shard answers before a request starts that another shard may not: try the next one.
# CANCELLED from a shard is the shard's doing (it stopped): the caller's own cancel never gets here.
RETRY_ELSEWHERE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode("utf-8", "replace")
    return ""


def _retry_after(error: grpc.aio.AioRpcError) -> int | None:
    for k, v in error.trailing_metadata() or ():
        if k == RETRY_AFTER_KEY:
            try:
                return int(v)
            except ValueError:
                return None
    return None


def add_router_to_server(servicer: RouterServicer, server) -> None:
    """The generated Scheduler registration, except that Generate's responses are the shard's own
    bytes, relayed as they came: the router never parses or rebuilds a token message."""

    class _Capture:
        def add_generic_rpc_handlers(self, handlers) -> None:
            pass

        def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
            self.service, self.handlers = service, handlers

    capture = _Capture()
    generation_pb2_grpc.add_SchedulerServicer_to_server(servicer, capture)
    handlers = dict(capture.handlers)
    handlers["Generate"] = handlers["Generate"]._replace(response_serializer=None)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.service, handlers),))
    server.add_registered_method_handlers(capture.service, handlers)


class RouterServicer(generation_pb2_grpc.SchedulerServicer):
    def __init__(self, router: Router, pool: ShardPool) -> None:
        self.router = router
        self.pool = pool
        self._live: dict[str, Shard] = {}  # caller's request id -> the shard running it (Abort)
        self.num_retries = 0
        self.num_failed_midstream = 0

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        kind = request.WhichOneof("prompt")
        if kind is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "prompt: give prompt_token_ids or prompt_text"
            )
        try:
            check_salt(request.cache_salt)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cache_salt: {e}")
        session = _metadata(context, SESSION_KEY)[:MAX_SESSION_CHARS]
        prompt = list(request.prompt_token_ids.ids) if kind == "prompt_token_ids" else []
        rid = request.request_id
        if rid and rid in self._live:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already running")
        tried: set[str] = set()
        refusals: list[int] = []
        last_error = "no scheduler shard is ready"
        while True:
            lora = (request.lora_name, request.lora_path)
            ranked = self.router.rank(prompt, request.cache_salt, session, tried, lora)
            if not ranked:
                break
            shard, cached = ranked[0]
            link = self.pool.link(shard)
            if link is None:
                tried.add(shard.shard_id)
                continue
            ticket = self.router.routed(shard, len(prompt), cached)
            call = link.generate(request, timeout=context.time_remaining(), wait_for_ready=False)
            if rid:
                self._live[rid] = shard
            try:
                async for raw in call:  # a GenerateResponse's bytes, relayed untouched
                    self.router.started(ticket)
                    yield raw
                return
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if not ticket.started and code in RETRY_ELSEWHERE:
                    tried.add(shard.shard_id)
                    self.num_retries += 1
                    last_error = f"shard {shard.shard_id}: {e.details()}"
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        refusals.append(_retry_after(e) or 1)
                    continue
                if ticket.started:
                    self.num_failed_midstream += 1
                    log.warning(
                        "shard failed mid-stream", extra={"shard_id": shard.shard_id, "error": e.details()}
                    )
                    if code == grpc.StatusCode.CANCELLED:  # the shard stopped under it: it is gone
                        code = grpc.StatusCode.UNAVAILABLE
                await context.abort(code, e.details() or f"shard {shard.shard_id} failed")
            finally:
                self.router.finished(ticket)
                if rid and self._live.get(rid) is shard:
                    del self._live[rid]
                call.cancel()  # the caller left (or a retry): the shard aborts the request
        if refusals:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"every scheduler shard is full: retry in {min(refusals)} s",
                trailing_metadata=((RETRY_AFTER_KEY, str(min(refusals))),),
            )
        await context.abort(grpc.StatusCode.UNAVAILABLE, last_error)

    async def Abort(self, request, context):
        by_shard: dict[str, list[str]] = {}
        for rid in request.request_ids:
            shard = self._live.get(rid)
            for s in [shard] if shard is not None else self.router.ready_shards:
                by_shard.setdefault(s.shard_id, []).append(rid)
        aborted: set[str] = set()
        for shard_id, ids in by_shard.items():
            link = self.pool.links.get(shard_id)
            if link is None:
                continue
            try:
                reply = await link.scheduler.Abort(
                    generation_pb2.AbortRequest(request_ids=ids), timeout=context.time_remaining()
                )
                aborted.update(reply.aborted_ids)
            except grpc.aio.AioRpcError:
                continue
        return generation_pb2.AbortResponse(aborted_ids=[r for r in request.request_ids if r in aborted])

    async def _unary(self, context, method: str, request):
        """A unary call answered by any ready shard (the first that answers)."""
        last: grpc.aio.AioRpcError | None = None
        for shard in self.router.by_load():
            link = self.pool.link(shard)
            if link is None:
                continue
            try:
                return await getattr(link.scheduler, method)(request, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRY_ELSEWHERE:
                    await context.abort(e.code(), e.details())
                last = e
        await context.abort(
            grpc.StatusCode.UNAVAILABLE, last.details() if last else "no scheduler shard is ready"
        )

    async def GetModelInfo(self, request, context):
        info = await self._unary(context, "GetModelInfo", request)
        return self._whole(info)

    async def ListModels(self, request, context):
        reply = await self._unary(context, "ListModels", request)
        return generation_pb2.ListModelsResponse(models=[self._whole(m) for m in reply.models])

    def _whole(self, info: generation_pb2.ModelInfo) -> generation_pb2.ModelInfo:
        """One shard's model info, with the workers of every shard."""
        out = generation_pb2.ModelInfo()
        out.CopyFrom(info)
        shards = self.router.shards.values()
        out.num_workers = sum(s.load.num_workers for s in shards if s.connected)
        out.num_ready_workers = sum(s.load.num_workers for s in shards if s.ready)
        return out

    async def Tokenize(self, request, context):
        return await self._unary(context, "Tokenize", request)

    async def Detokenize(self, request, context):
        return await self._unary(context, "Detokenize", request)


class ShardRegistryServicer(router_pb2_grpc.ShardRegistryServicer):
    def __init__(self, pool: ShardPool) -> None:
        self.pool = pool

    async def RegisterShard(self, request, context):
        if not request.address or ":" not in request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address: must be host:port")
        if len(request.shard_id) > 256:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "shard_id: at most 256 characters")
        shard = self.pool.add(request.address, request.shard_id, registered=True)
        return router_pb2.RegisterShardResponse(accepted=True, message=f"registered as {shard.shard_id}")

    async def DeregisterShard(self, request, context):
        shard_id = request.shard_id or request.address
        if not shard_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "shard_id: give the shard's id or address")
        return router_pb2.DeregisterShardResponse(removed=self.pool.drain(shard_id))


class RouterRegistryServicer(worker_pb2_grpc.RegistryServicer):
    """`Registry.GetStats` over every shard (the gateway's metrics); workers register with shards."""

    def __init__(self, pool: ShardPool) -> None:
        self.pool = pool

    async def RegisterWorker(self, request, context):
        return worker_pb2.RegisterWorkerResponse(
            accepted=False, message="this is a router: workers register with a scheduler shard"
        )

    async def GetStats(self, request, context):
        links = list(self.pool.links.values())
        replies = await asyncio.gather(
            *(link.registry.GetStats(request, timeout=context.time_remaining() or 5.0) for link in links),
            return_exceptions=True,
        )
        out = worker_pb2.SchedulerStats()
        for link, reply in zip(links, replies, strict=True):
            if isinstance(reply, BaseException):
                continue
            for w in reply.workers:
                w.worker_id = f"{link.shard.shard_id}/{w.worker_id}"
            out.workers.extend(reply.workers)
            out.failovers += reply.failovers
            out.active_requests += reply.active_requests
            out.refused += reply.refused
            out.backlog += reply.backlog
        return out
