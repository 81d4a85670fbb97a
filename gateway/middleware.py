"""ASGI middleware in front of every route: HTTP metrics, API-key auth, body type and size limits.

Errors take the shape of the API the path belongs to (OpenAI's, or Anthropic's on /v1/messages).

Pure ASGI (not BaseHTTPMiddleware) so that streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from gateway.cache_salt import API_KEY_SCOPE
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.scheduler_client import SESSION_HEADER, SESSION_ID

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key (load balancers, kubelets)


async def _send_error(send: Send, err: APIError, scope: Scope) -> None:
    body = json.dumps(err.body_for(scope.get("path", ""))).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _is_json(content_type: str | None) -> bool:
    if content_type is None:
        return False
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


class GuardMiddleware:
    """Auth on every route but /health; POST bodies must be JSON and at most `max_body_bytes`.

    With API keys (one or several: one per tenant), the key a request authenticated with is
    left in its scope (`API_KEY_SCOPE`) for what depends on the tenant (cache salts).
    """

    def __init__(self, app: ASGIApp, api_keys: Sequence[str], max_body_bytes: int) -> None:
        self.app = app
        self.api_keys = [(k, k.encode()) for k in api_keys if k]
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authenticate(scope):
            await _send_error(
                send,
                APIError(
                    401,
                    "Incorrect or missing API key: send `Authorization: Bearer <key>` "
                    "(or `x-api-key: <key>`).",
                    code="invalid_api_key",
                ),
                scope,
            )
            return
        # Every request sets it (keep-alive requests share a task's context): printable, bounded,
        # it travels on as gRPC metadata (gateway/scheduler_client.py).
        session = _header(scope, SESSION_HEADER.encode()) or ""
        SESSION_ID.set(session[:256] if session.isascii() and session.isprintable() else "")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _send_error(send, self._too_large(), scope)
            return
        body, more = await self._read_body(receive)
        if more is None:
            return  # the client went away while sending
        if more:
            await _send_error(send, self._too_large(), scope)
            return
        if body and not _is_json(_header(scope, b"content-type")):
            await _send_error(
                send,
                APIError(
                    415,
                    "The request body must be JSON (Content-Type: application/json).",
                    code="unsupported_media_type",
                ),
                scope,
            )
            return
        await self.app(scope, _replay(body, receive), send)

    def _authenticate(self, scope: Scope) -> bool:
        """Whether the request may pass; records the key it presented in its scope."""
        if not self.api_keys or scope["path"] in OPEN_PATHS:
            return True
        key = self._presented_key(scope)
        if key is None:
            return False
        scope[API_KEY_SCOPE] = key
        return True

    def _presented_key(self, scope: Scope) -> str | None:
        """The configured key the request presents, or None: its bearer token, or (no Authorization
        header) its `x-api-key` header, as Anthropic's clients send it."""
        header = _header(scope, b"authorization") or ""
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer":
            presented = token.strip().encode("latin-1")
        elif not header and (x_api_key := _header(scope, b"x-api-key")) is not None:
            presented = x_api_key.strip().encode("latin-1")
        else:
            return None
        found = None
        # Constant-time comparisons, every key compared: neither a key nor which one matched
        # leaks through response timing.
        for key, raw in self.api_keys:
            if hmac.compare_digest(presented, raw) and found is None:
                found = key
        return found

    def _too_large(self) -> APIError:
        return APIError(
            413, f"The request body is larger than {self.max_body_bytes} bytes.", code="request_too_large"
        )

    async def _read_body(self, receive: Receive) -> tuple[bytes, bool | None]:
        """The body, and whether it went past the limit (None: the client disconnected)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", True
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False


def _replay(body: bytes, receive: Receive) -> Receive:
    """Hand the buffered body to the app, then pass through (so disconnects still arrive)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class MetricsMiddleware:
    """Counts HTTP requests by method, route template and status."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            # Route templates, never raw paths: unknown paths must not explode the label set.
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.http_requests.labels(scope["method"], path, str(status["code"])).inc()
