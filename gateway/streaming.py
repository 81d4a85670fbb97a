"""Server-sent events and client-disconnect handling.

A client that goes away must cancel its generation at once (so that the
scheduler aborts it and frees its KV blocks), whether it was streaming or
waiting for a whole response, and whether or not a token is due soon.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
RAW_SEND = "llmesh.raw_send"  # scope key: the server's own `send`, set by the app (gateway/app.py)

try:  # orjson: a response serialized in C, several times faster than json.dumps
    import orjson

    def dumps(obj: Any) -> bytes:
        """Compact UTF-8 JSON (non-finite floats become null, as JSON has no other spelling)."""
        try:
            return orjson.dumps(obj)
        except TypeError:  # e.g. an int beyond 64 bits: the standard library takes anything JSON
            return json.dumps(obj, separators=(",", ":")).encode()

except ImportError:  # pragma: no cover - orjson is a dependency; this keeps a bare install working

    def dumps(obj: Any) -> bytes:
        try:
            return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
        except UnicodeEncodeError:
            return json.dumps(obj, separators=(",", ":")).encode()


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


class FastJSONResponse(JSONResponse):
    """application/json through `dumps` (orjson) instead of json.dumps."""

    def render(self, content: Any) -> bytes:
        return dumps(content)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    pass


class SSEResponse(Response):
    """Streams `events` as text/event-stream; a disconnect cancels and closes the iterator.

    Starlette's StreamingResponse notices a disconnect only when a write fails
    (ASGI 2.4) and leaves the iterator to the garbage collector; we watch
    `receive` all along and close the iterator ourselves, which cancels the
    gRPC calls behind it.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        status_code: int = 200,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.events = events
        self.on_close = on_close  # runs whatever happens, even if `events` never started
        self.status_code = status_code
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The start goes through every middleware (metrics count the status); the body, event by
        # event, straight to the server (RAW_SEND): no layer above transforms a body, and each
        # wrapper would cost a coroutine per event.
        body_send = scope.get(RAW_SEND, send)

        async def write() -> None:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async for chunk in self.events:
                await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
            await body_send({"type": "http.response.body", "body": b"", "more_body": False})

        writer = asyncio.ensure_future(write())
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, watcher):
                task.cancel()
            for task in (writer, watcher):
                with contextlib.suppress(asyncio.CancelledError, OSError, Exception):
                    await task
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]
            if self.on_close is not None:
                await self.on_close()
        if writer.done() and not writer.cancelled() and writer.exception() is not None:
            exc = writer.exception()
            if not isinstance(exc, OSError):  # a write to a closed socket is a disconnect, not a bug
                raise exc


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientDisconnected()
    return task.result()
