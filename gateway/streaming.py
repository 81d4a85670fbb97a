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
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


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
        async def write() -> None:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

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
