"""What chat and completions share: running generations, usage, streaming and whole responses."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.cache_salt import API_KEY_SCOPE, effective_salt
from gateway.errors import APIError, bad_request
from gateway.generation import ChoiceDelta, Generation, TokenLogprob, merge
from gateway.protocol import SamplingRequest
from gateway.state import GatewayState
from gateway.streaming import (
    DONE,
    ClientDisconnected,
    FastJSONResponse,
    SSEResponse,
    sse,
    unless_disconnected,
)

log = logging.getLogger(__name__)


@dataclass
class ChoiceResult:
    """A whole choice, accumulated from its deltas (non-streaming responses)."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None  # TokenLogprobs | None per prompt position, when asked
    embedding: list[float] | None = None  # a pooling request's vector

    def add(self, d: ChoiceDelta) -> None:
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.embedding is not None:
            self.embedding = d.embedding
        self.text.append(d.text)
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


def raw_prompts(value: Any, name: str) -> list[str | list[int]]:
    """A prompt field as sent (`prompt`, `input`: a text, texts, token ids or token-id lists) as
    one list of texts or token-id lists, none tokenized yet."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request(name, "must not be empty")
    # The schema admits only homogeneous lists: the first item tells which (no walk over a million ids).
    if isinstance(value[0], int):
        return [value]
    return list(value)


def usage(gens: list[Generation]) -> dict[str, Any]:
    prompt = sum(len(g.prompt_ids) for g in gens)
    completion = sum(g.completion_tokens for g in gens)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    cached = sum(g.cached_tokens for g in gens)
    out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def cache_salt_of(state: GatewayState, body: SamplingRequest, request: Request) -> str:
    """The salt this request's generations carry: its own, salted by its API key when configured."""
    if not state.config.cache_salt_by_api_key:
        return body.cache_salt or ""
    key = request.scope.get(API_KEY_SCOPE)
    if key is None:  # the guard lets no keyless request through: fail closed if that ever changes
        log.error("cache_salt_by_api_key: a request without an authenticated key reached a route")
        raise APIError(500, "Internal server error.", code="internal_error")
    return effective_salt(body.cache_salt, key)


class Run:
    """Generations of one HTTP request, with metrics recorded exactly once when they end."""

    def __init__(self, state: GatewayState, model_name: str, gens: list[Generation]) -> None:
        self.state = state
        self.model_name = model_name
        self.gens = gens
        self.max_concurrent = state.config.max_concurrent_prompts
        self._closed = False
        state.metrics.requests_active.inc()

    def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Batches of deltas, at most one per choice: what arrived since the last batch was taken."""
        if len(self.gens) == 1:
            return self.gens[0].stream()
        return merge(self.gens, self.max_concurrent)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.state.metrics.requests_active.dec()
        for g in self.gens:
            self.state.metrics.observe(self.model_name, g)

    async def collect(self, request: Request, num_choices: int) -> list[ChoiceResult]:
        """Run to the end (cancelled if the client leaves first)."""
        results = [ChoiceResult(i) for i in range(num_choices)]

        async def run() -> None:
            async for batch in self.deltas():
                for d in batch:
                    results[d.index].add(d)

        try:
            await unless_disconnected(request, run())
        finally:
            self.close()
        return results

    async def respond(self, request: Request, build: Callable[[list[ChoiceResult]], dict[str, Any]], n: int):
        try:
            results = await self.collect(request, n)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; it marks the request in the metrics
        return FastJSONResponse(build(results))

    async def stream(
        self,
        request: Request,
        head: list[bytes],
        chunk: Callable[[ChoiceDelta], bytes | None],
        tail: Callable[[], list[bytes] | Awaitable[list[bytes]]],
        *,
        end: bytes = DONE,
        error_event: Callable[[APIError], bytes] | None = None,
    ) -> Response:
        """SSE: `head` events, one event per delta (None = skip), `tail` events, then `end` ([DONE];
        APIs without that marker pass b""). A failure after the 200 is an `error_event` (OpenAI's
        error body by default).

        Waits for the first delta before answering, so that a request the
        scheduler refuses (or a scheduler that is down) gets a real HTTP error
        status instead of a 200 with an error event. The events of one batch of
        deltas (everything that arrived while the client was being written to)
        go out in one write.
        """
        events = self.deltas()
        try:
            first = await unless_disconnected(request, anext(events, None))
        except (APIError, ClientDisconnected) as e:
            with contextlib.suppress(Exception):
                await events.aclose()
            self.close()
            if isinstance(e, ClientDisconnected):
                return Response(status_code=499)
            raise

        async def cleanup() -> None:
            with contextlib.suppress(Exception):
                await events.aclose()
            self.close()

        def frames(batch: list[ChoiceDelta]) -> list[bytes]:
            out = []
            for d in batch:
                event = chunk(d)
                if event is not None:
                    out.append(event)
            return out

        async def body() -> AsyncIterator[bytes]:
            try:
                pending = list(head)
                if first is not None:
                    pending += frames(first)
                    if pending:
                        yield b"".join(pending)
                    pending = []
                    async for batch in events:
                        out = frames(batch)
                        if out:
                            yield out[0] if len(out) == 1 else b"".join(out)
                last = tail()
                pending += (await last) if inspect.isawaitable(last) else last
                if pending:
                    yield b"".join(pending)
            except APIError as e:  # after the 200 went out: the error travels as an event
                yield error_event(e) if error_event is not None else sse(e.body())
            finally:
                await cleanup()  # before [DONE]: usage and metrics are final by then
            if end:
                yield end

        # on_close: a client gone before the body even started must still cancel the calls.
        return SSEResponse(body(), on_close=cleanup)
