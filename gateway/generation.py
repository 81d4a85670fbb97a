"""One request's generation on the scheduler: n choices, detokenized, stop strings matched.

Each choice is its own `Generate` call (n = 1, seed + i as the scheduler would
use), so that a stop string ends just its choice: cancelling the call aborts
that request upstream and frees its KV blocks, while the other choices go on.
The gateway detokenizes incrementally (multi-byte characters and merges come
out whole) and holds back text that may still become a stop string.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from gateway.errors import APIError, from_grpc
from gateway.scheduler_client import SchedulerClient
from gateway.tokenizer import Tokenizer
from llmesh.v1 import generation_pb2
from services.convert import logprobs_from_proto, sampling_params_to_proto
from services.detokenizer import IncrementalDetokenizer, find_stop, held_back
from services.sampling_params import SamplingParams

_FINISH = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}
_END = object()  # a call's stream ended
_SEED_SPAN = 2**64


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # most likely first


@dataclass
class ChoiceDelta:
    """What one upstream response added to a choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


class ChoiceState:
    """Detokenizes one choice and matches its stop strings."""

    def __init__(
        self, index: int, tokenizer: Tokenizer, stops: list[str], skip_special: bool, include_stop: bool
    ) -> None:
        self.index = index
        self.stops = stops
        self.include_stop = include_stop
        self.detok = IncrementalDetokenizer(tokenizer.hf, skip_special)
        self.sent = 0  # characters of detok.text already handed out
        self.num_tokens = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cached_tokens = 0

    def absorb(self, resp: generation_pb2.GenerateResponse) -> tuple[ChoiceDelta, bool]:
        """Take one response; return its delta and whether the upstream call must be cancelled."""
        delta = ChoiceDelta(self.index)
        ids = list(resp.token_ids)
        lps = logprobs_from_proto(resp.logprobs, ids) if resp.HasField("logprobs") else []
        upstream_done = resp.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
        cancel = False
        for j, tok in enumerate(ids):
            self.num_tokens += 1
            delta.token_ids.append(tok)
            if lps and lps[j] is not None:
                e = lps[j]
                delta.logprobs.append(
                    TokenLogprob(tok, e.logprob, list(zip(e.top_token_ids, e.top_logprobs, strict=True)))
                )
            new = self.detok.push([tok])
            if new and self._match_stop(len(new)):
                cancel = not upstream_done or j < len(ids) - 1
                break
        if upstream_done and not self.finished:
            rest = self.detok.flush()
            if not (rest and self._match_stop(len(rest))):
                self.finished = True
                self.finish_reason = _FINISH.get(resp.finish_reason, "abort")
                if resp.WhichOneof("stop_reason") == "stop_token_id":
                    self.stop_reason = resp.stop_token_id
        if resp.HasField("usage"):
            self.cached_tokens = resp.usage.cached_prompt_tokens
        end = len(self.detok.text)
        if not self.finished and self.stops:
            end -= held_back(self.detok.text, self.stops)
        if end > self.sent:
            delta.text = self.detok.text[self.sent : end]
            self.sent = end
        delta.finish_reason = self.finish_reason
        delta.stop_reason = self.stop_reason
        return delta, cancel

    def _match_stop(self, new_len: int) -> bool:
        text = self.detok.text
        idx = find_stop(text, new_len, self.stops)
        if idx == -1:
            return False
        stop = next(s for s in self.stops if text.startswith(s, idx))
        self.detok.text = text[: idx + len(stop)] if self.include_stop else text[:idx]
        self.finished = True
        self.finish_reason = "stop"
        self.stop_reason = stop
        return True


@dataclass
class Timings:
    """Latencies of one request, for the metrics."""

    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    finished: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # between a choice's successive outputs


def _child_seed(seed: int | None, i: int) -> int | None:
    if seed is None:
        return None
    # Wrap inside int64 like the scheduler's seed + i would have to.
    return (seed + i + 2**63) % _SEED_SPAN - 2**63


class Generation:
    """The n choices of one prompt, merged into one stream of ChoiceDeltas."""

    def __init__(
        self,
        client: SchedulerClient,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        model: str,
        timeout: float,
        first_index: int = 0,
        priority: int = 0,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.client = client
        self.prompt_ids = prompt_ids
        self.params = params
        self.model = model
        self.timeout = timeout
        self.priority = priority
        self.request_id = uuid.uuid4().hex
        self.timings = Timings()
        self.states = [
            ChoiceState(
                first_index + i, tokenizer, params.stop, skip_special_tokens, include_stop_str_in_output
            )
            for i in range(params.n)
        ]
        self._calls: list[grpc.aio.UnaryStreamCall] = []
        self._tasks: list[asyncio.Task] = []

    @property
    def completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.states)

    @property
    def cached_tokens(self) -> int:
        return max((s.cached_tokens for s in self.states), default=0)

    def _request(self, i: int) -> generation_pb2.GenerateRequest:
        # Stop strings stay here: the gateway matches them on its own detokenized text.
        child = dataclasses.replace(self.params, n=1, seed=_child_seed(self.params.seed, i), stop=[])
        return generation_pb2.GenerateRequest(
            request_id=f"{self.request_id}-{i}",
            model=self.model,
            prompt_token_ids=generation_pb2.TokenIds(ids=self.prompt_ids),
            sampling_params=sampling_params_to_proto(child),
            priority=self.priority,
        )

    async def _pump(self, i: int, call: grpc.aio.UnaryStreamCall, queue: asyncio.Queue) -> None:
        try:
            async for resp in call:
                queue.put_nowait((i, resp))
            queue.put_nowait((i, _END))
        except grpc.RpcError as e:
            queue.put_nowait((i, e))

    async def stream(self) -> AsyncIterator[ChoiceDelta]:
        """Yield deltas as they arrive; raise APIError on a scheduler failure. Cancels on exit."""
        queue: asyncio.Queue = asyncio.Queue()
        try:
            for i in range(len(self.states)):
                call = self.client.generate(self._request(i), self.timeout)
                self._calls.append(call)
                self._tasks.append(asyncio.ensure_future(self._pump(i, call, queue)))
            open_choices = len(self.states)
            last_output: list[float | None] = [None] * len(self.states)
            while open_choices:
                i, item = await queue.get()
                state = self.states[i]
                if state.finished:
                    continue  # e.g. the CANCELLED error of a call a stop string ended
                if isinstance(item, grpc.RpcError):
                    raise from_grpc(item, self.client.address)
                if item is _END:
                    raise APIError(502, "The scheduler ended a stream before its choice finished.")
                delta, cancel = state.absorb(item)
                now = time.monotonic()
                if delta.token_ids:
                    if self.timings.first_token is None:
                        self.timings.first_token = now
                    prev = last_output[i]
                    if prev is not None:  # a choice's first output is its TTFT, not a gap
                        self.timings.token_gaps.append(now - prev)
                    last_output[i] = now
                if cancel:
                    self._calls[i].cancel()  # aborts the request upstream, freeing its blocks
                if state.finished:
                    open_choices -= 1
                yield delta
            self.timings.finished = time.monotonic()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        for call in self._calls:
            call.cancel()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()


async def merge(
    generations: list[Generation], max_concurrent: int | None = None
) -> AsyncIterator[ChoiceDelta]:
    """Interleave several generations (a batch of prompts) in arrival order.

    At most `max_concurrent` of them are in flight to the scheduler at once; the
    next starts as one ends. One request of 64 prompts x n = 16 would otherwise
    put 1,024 sequences in the scheduler's queue at once, ahead of every other
    client's. Choices keep their indices, so the order of the results is unchanged.
    """
    if len(generations) == 1:
        async for delta in generations[0].stream():
            yield delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(gen: Generation) -> None:
        try:
            async for delta in gen.stream():
                queue.put_nowait(delta)
            queue.put_nowait(_END)
        except Exception as e:
            queue.put_nowait(e)

    tasks: list[asyncio.Task] = []

    def start_next() -> None:
        if len(tasks) < len(generations):
            tasks.append(asyncio.ensure_future(pump(generations[len(tasks)])))

    try:
        for _ in range(max_concurrent or len(generations)):
            start_next()
        remaining = len(generations)
        while remaining:
            item = await queue.get()
            if item is _END:
                remaining -= 1
                start_next()
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for g in generations:
            await g.aclose()
