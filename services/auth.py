"""Bearer keys on gRPC: a server interceptor that checks them, client interceptors that send them.

Two keys, both optional:

- the API key (`--api-key` on the scheduler, the same key as the gateway's): the public
  `llmesh.v1.Scheduler` API, the any-language contract, takes it;
- the internal key (the mesh secret, services/mesh_secret.py: always resolved, from the
  environment, a file or this user's local key, unless mutual TLS authenticates instead): every
  RPC a server hosts needs it, the public API excepted (open without an API key, like the
  gateway; with one, it takes either key). Every channel a service opens sends it. That keeps
  strangers and holders of the public key from registering a worker, opening a worker's Step
  stream, or reading, probing and writing the KV store.

Keys travel as `authorization: Bearer KEY` metadata; a call without the right one ends
UNAUTHENTICATED before its handler runs. Health and reflection stay open (probes, grpcurl).
Keys protect nothing on a network that can be read: set TLS (services/tls.py) beyond loopback;
mutual TLS is the stronger mesh-internal option (no certificate, no connection).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc

AUTHORIZATION = "authorization"  # gRPC metadata keys are lower-case
OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)


def bearer_metadata(key: str) -> tuple[tuple[str, str], ...]:
    return ((AUTHORIZATION, f"Bearer {key}"),)


def _service_of(method: str) -> str:
    """`/llmesh.v1.Scheduler/Generate` -> `llmesh.v1.Scheduler`."""
    return method.lstrip("/").split("/", 1)[0]


def _presented_key(metadata: Iterable[tuple[str, Any]] | None) -> bytes | None:
    for name, value in metadata or ():
        if name == AUTHORIZATION:
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, key = text.partition(" ")
            return key.strip().encode() if scheme.lower() == "bearer" else None
    return None


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour replaced by an UNAUTHENTICATED abort (same streaming shape)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    field = ("stream_" if handler.request_streaming else "unary_") + (
        "stream" if handler.response_streaming else "unary"
    )
    return handler._replace(**{field: refuse})


class BearerAuth(grpc.aio.ServerInterceptor):
    """Requires a bearer key per service: `keys[service]`, else `default`; an empty set = open."""

    def __init__(self, default: Iterable[str] = (), keys: Mapping[str, Iterable[str]] | None = None) -> None:
        self._default = tuple(k.encode() for k in default if k)
        self._keys = {svc: tuple(k.encode() for k in ks if k) for svc, ks in (keys or {}).items()}

    def accepted(self, service: str) -> tuple[bytes, ...]:
        if service in OPEN_SERVICES:
            return ()
        return self._keys.get(service, self._default)

    def allows(self, method: str, metadata: Iterable[tuple[str, Any]] | None) -> bool:
        accepted = self.accepted(_service_of(method))
        if not accepted:
            return True
        presented = _presented_key(metadata)
        # compare_digest against every key (no early exit): timing tells nothing about which matched.
        matches = [hmac.compare_digest(presented or b"", key) for key in accepted]
        return presented is not None and any(matches)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or self.allows(details.method, details.invocation_metadata):
            return handler
        return _refusal(handler, "missing or wrong key: send `authorization: Bearer KEY` metadata")


def server_auth(
    internal_key: str | None, public: Mapping[str, str | None] | None = None
) -> BearerAuth | None:
    """The interceptor for one server: `public` maps its public services to their API key (a
    public service without one is open, as the gateway is without --api-key).

    None when no key is set (no interceptor, no per-call cost: mutual TLS authenticates).
    """
    public = public or {}
    if not internal_key and not any(public.values()):
        return None
    internal = (internal_key,) if internal_key else ()
    keys = {svc: (key, *internal) if key else () for svc, key in public.items()}
    return BearerAuth(default=internal, keys=keys)


# -- the client side: every call on a channel carries the key ---------------------------------


def _with_key(details: Any, metadata: tuple[tuple[str, str], ...]) -> Any:
    return details._replace(metadata=tuple(details.metadata or ()) + metadata)


class _AioKeyBase:
    def __init__(self, key: str) -> None:
        self._metadata = bearer_metadata(key)


# grpc.aio files an interceptor under the first of the four kinds it is an instance of, so each
# kind needs its own object (a class of all four would only ever see unary-unary calls).
class _AioUnaryUnaryKey(_AioKeyBase, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_key(details, self._metadata), request)


class _AioUnaryStreamKey(_AioKeyBase, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_key(details, self._metadata), request)


class _AioStreamUnaryKey(_AioKeyBase, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_key(details, self._metadata), request_iterator)


class _AioStreamStreamKey(_AioKeyBase, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_key(details, self._metadata), request_iterator)


class _SyncKey(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, key: str) -> None:
        self._metadata = bearer_metadata(key)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_key(details, self._metadata), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_key(details, self._metadata), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_with_key(details, self._metadata), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(_with_key(details, self._metadata), request_iterator)


def aio_key_interceptors(key: str | None) -> list[grpc.aio.ClientInterceptor]:
    if not key:
        return []
    kinds = (_AioUnaryUnaryKey, _AioUnaryStreamKey, _AioStreamUnaryKey, _AioStreamStreamKey)
    return [kind(key) for kind in kinds]


def sync_key_interceptor(key: str | None) -> grpc.UnaryUnaryClientInterceptor | None:
    return _SyncKey(key) if key else None
