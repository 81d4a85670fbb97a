"""`ShardPicker.Route`: the router as an endpoint picker, off the data path (router.proto).

The relay (router_svc/servicer.py) carries every response message of its shards: at stream
interval 1 one more hop per token, the router tier's CPU growing with the cluster's tokens. Route
answers one small call per request instead — the shard to stream from, booked in this router's
load view (`Router.book`: a guess until the shard's next load report) — and the caller opens
Generate on that shard itself (gateway/shard_routing.py), as llm-d's endpoint picker lets the
proxy stream straight from the pod.
"""

from __future__ import annotations

import grpc

from llmesh.v1 import router_pb2, router_pb2_grpc
from router_svc.core import Router, Shard
from services.prefix_hash import check_salt

MAX_SESSION_CHARS = 256  # as the relay keeps of x-session-id
MAX_EXCLUDE = 256
MAX_FALLBACKS = 2


def _choice(shard: Shard, cached: int) -> router_pb2.ShardChoice:
    return router_pb2.ShardChoice(shard_id=shard.shard_id, address=shard.address, cached_tokens=cached)


class ShardPickerServicer(router_pb2_grpc.ShardPickerServicer):
    def __init__(self, router: Router) -> None:
        self.router = router
        self.num_routes = 0

    async def Route(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext):
        try:
            check_salt(request.cache_salt)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cache_salt: {e}")
        if len(request.exclude) > MAX_EXCLUDE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"exclude: at most {MAX_EXCLUDE} shard ids")
        prompt = list(request.prompt_token_ids.ids)
        ranked = self.router.rank(
            prompt,
            request.cache_salt,
            request.session_id[:MAX_SESSION_CHARS],
            frozenset(request.exclude),
            (request.lora_name, request.lora_path),
        )
        if not ranked:
            why = "no other scheduler shard is ready" if request.exclude else "no scheduler shard is ready"
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)
        shard, cached = ranked[0]
        self.router.book(shard, len(prompt) or request.prompt_tokens, cached)
        self.num_routes += 1
        return router_pb2.RouteResponse(
            shard=_choice(shard, cached),
            fallbacks=[_choice(s, c) for s, c in ranked[1 : 1 + MAX_FALLBACKS]],
        )
