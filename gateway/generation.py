"""One request's generation on the scheduler: n choices, detokenized, stop strings matched.

Each choice is its own `Generate` call (n = 1, the seed `services/choices.py` gives choice i,
as the scheduler's own fan-out would), so that a stop string ends just its choice: cancelling
the call aborts that request upstream and frees its KV blocks, while the other choices go on.
The per-choice work (incremental detokenization, stop strings, held-back text, finish and stop
reasons) is the shared `ChoiceState`; this module adapts it to the scheduler's responses.

Responses pile up in one queue while the client reads slower than tokens arrive; each turn
takes everything pending and hands out one merged delta per choice (one SSE event, not a
backlog of one-token events that would only slow the reader further).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from gateway.errors import APIError, bad_request, from_grpc
from gateway.lora import LoRAModule
from gateway.scheduler_client import SchedulerClient
from gateway.tokenizer import Tokenizer
from llmesh.v1 import generation_pb2
from services.choices import ABORT, ChoiceState, FanOut
from services.convert import (
    FINISH_REASON_FROM_PROTO,
    logprobs_from_proto,
    prompt_logprobs_from_proto,
    sampling_params_to_proto,
)
from services.sampling_params import SamplingParams, SamplingParamsError
from services.step import TokenLogprobs

_UNSPECIFIED = generation_pb2.FINISH_REASON_UNSPECIFIED
_END = object()  # a call's stream ended


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # most likely first


@dataclass
class ChoiceDelta:
    """What upstream responses added to a choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # With prompt logprobs, on the choice's first delta: one entry per prompt position (None at 0).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None  # a pooling request's vector (SamplingParams.pooling)

    def extend(self, later: ChoiceDelta) -> None:
        """Append a later delta of the same choice (coalescing)."""
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.embedding is not None:
            self.embedding = later.embedding
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        self.logprobs.extend(later.logprobs)
        if later.finish_reason is not None:
            self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


class ChoiceStream:
    """One choice: the scheduler's responses in, ChoiceDeltas out (via the shared ChoiceState)."""

    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        stops: list[str],
        skip_special: bool,
        include_stop: bool,
        stop_token_ids: list[int] | None = None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.index = index
        self.prompt_ids = prompt_ids or []
        self.state = ChoiceState(
            tokenizer.hf,
            stop=stops,
            stop_token_ids=stop_token_ids or (),
            skip_special_tokens=skip_special,
            include_stop_str_in_output=include_stop,
        )
        self.cached_tokens = 0
        # With prompt logprobs: one entry per prompt position (None at 0), from its first response.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_tokens(self) -> int:
        return self.state.num_tokens

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def finish_reason(self) -> str | None:
        return self.state.finish_reason

    def absorb(self, resp: generation_pb2.GenerateResponse) -> tuple[ChoiceDelta, bool]:
        """Take one response; return its delta and whether the upstream call must be cancelled."""
        ids = list(resp.token_ids)
        finish = None
        if resp.finish_reason != _UNSPECIFIED:
            finish = FINISH_REASON_FROM_PROTO.get(resp.finish_reason, ABORT)
        stop_id = resp.stop_token_id if resp.WhichOneof("stop_reason") == "stop_token_id" else None
        up = self.state.absorb(ids, finish, stop_id)
        delta = ChoiceDelta(self.index, up.text, ids if up.num_tokens == len(ids) else ids[: up.num_tokens])
        if resp.HasField("logprobs"):
            lps = logprobs_from_proto(resp.logprobs, ids)
            for tok, e in zip(delta.token_ids, lps, strict=False):
                if e is not None:
                    top = list(zip(e.top_token_ids, e.top_logprobs, strict=True))
                    delta.logprobs.append(TokenLogprob(tok, e.logprob, top))
        if resp.HasField("prompt_logprobs"):
            self.prompt_logprobs = prompt_logprobs_from_proto(resp.prompt_logprobs, self.prompt_ids)
            delta.prompt_logprobs = self.prompt_logprobs
        if resp.embedding:
            delta.embedding = list(resp.embedding)
        if resp.HasField("usage"):
            self.cached_tokens = resp.usage.cached_prompt_tokens
        if self.state.finished:
            delta.finish_reason = self.state.finish_reason
            delta.stop_reason = self.state.stop_reason
        return delta, up.cancel


@dataclass
class Timings:
    """Latencies of one request, for the metrics."""

    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    finished: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # between a choice's successive outputs


class Generation:
    """The n choices of one prompt, merged into one stream of ChoiceDelta batches."""

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
        cache_salt: str = "",
        lora: LoRAModule | None = None,
    ) -> None:
        self.client = client
        self.lora = lora  # the LoRA adapter to run with (None: the base model)
        self.prompt_ids = prompt_ids
        self.params = params
        self.model = model
        self.timeout = timeout
        self.priority = priority
        self.cache_salt = cache_salt  # already combined with the tenant's (gateway/cache_salt.py)
        self.request_id = uuid.uuid4().hex
        self.timings = Timings()
        self.refused = False  # the scheduler was full and refused it before it started (HTTP 429)
        try:
            # Stop strings stay here: the gateway matches them on its own detokenized text.
            # Every choice carries its prompt logprobs (each streams its own echo with them).
            self.fanout = FanOut.plan(self.request_id, params, keep_stop=False, prompt_logprobs_once=False)
        except SamplingParamsError as e:
            raise bad_request(e.param, str(e).split(": ", 1)[-1]) from e
        self.states = [
            ChoiceStream(
                first_index + i,
                tokenizer,
                params.stop,
                skip_special_tokens,
                include_stop_str_in_output,
                params.stop_token_ids,
                prompt_ids,
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

    def _request(self, child_id: str, params: SamplingParams) -> generation_pb2.GenerateRequest:
        return generation_pb2.GenerateRequest(
            request_id=child_id,
            model=self.model,
            prompt_token_ids=generation_pb2.TokenIds(ids=self.prompt_ids),
            sampling_params=sampling_params_to_proto(params),
            priority=self.priority,
            cache_salt=self.cache_salt,
            lora_name=self.lora.name if self.lora else "",
            lora_path=self.lora.path if self.lora else "",
        )

    async def _pump(self, i: int, call: grpc.aio.UnaryStreamCall, queue: asyncio.Queue) -> None:
        put = queue.put_nowait
        try:
            async for resp in call:
                put((i, resp))
            put((i, _END))
        except grpc.RpcError as e:
            put((i, e))

    def _open(self, queue: asyncio.Queue) -> None:
        """One Generate call per choice; a failure to open one cancels those already open."""

        def submit(child_id: str, params: SamplingParams) -> None:
            i = len(self._calls)
            call = self.client.generate(self._request(child_id, params), self.timeout)
            self._calls.append(call)
            self._tasks.append(asyncio.ensure_future(self._pump(i, call, queue)))

        def abort(child_id: str) -> None:
            self._calls[self.fanout.ids.index(child_id)].cancel()

        self.fanout.submit(submit, abort)

    async def stream(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Yield batches of deltas (at most one per choice) as responses arrive; raise APIError on
        a scheduler failure. Cancels every call on exit."""
        queue: asyncio.Queue = asyncio.Queue()
        try:
            self._open(queue)
            open_choices = len(self.states)
            last_output: list[float | None] = [None] * len(self.states)
            while open_choices:
                items = [await queue.get()]
                while not queue.empty():  # the reader fell behind: everything pending, one batch
                    items.append(queue.get_nowait())
                merged: dict[int, ChoiceDelta] = {}
                for i, item in items:
                    state = self.states[i]
                    if state.finished:
                        continue  # e.g. the CANCELLED error of a call a stop string ended
                    if isinstance(item, grpc.RpcError):
                        self.refused = item.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        raise from_grpc(item, self.client.address)
                    if item is _END:
                        raise APIError(502, "The scheduler ended a stream before its choice finished.")
                    delta, cancel = state.absorb(item)
                    if cancel:
                        self._calls[i].cancel()  # aborts the request upstream, freeing its blocks
                    if state.finished:
                        open_choices -= 1
                    prev = merged.get(i)
                    if prev is None:
                        merged[i] = delta
                    else:
                        prev.extend(delta)
                now = time.monotonic()
                for i, delta in merged.items():
                    if delta.token_ids:
                        if self.timings.first_token is None:
                            self.timings.first_token = now
                        prev_t = last_output[i]
                        if prev_t is not None:  # a choice's first output is its TTFT, not a gap
                            self.timings.token_gaps.append(now - prev_t)
                        last_output[i] = now
                if merged:
                    yield list(merged.values())
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
) -> AsyncIterator[list[ChoiceDelta]]:
    """Interleave several generations (a batch of prompts) in arrival order, as delta batches.

    At most `max_concurrent` of them are in flight to the scheduler at once; the
    next starts as one ends. One request of 64 prompts x n = 16 would otherwise
    put 1,024 sequences in the scheduler's queue at once, ahead of every other
    client's. Choices keep their indices, so the order of the results is unchanged.
    """
    if len(generations) == 1:
        async for batch in generations[0].stream():
            yield batch
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(gen: Generation) -> None:
        try:
            async for batch in gen.stream():
                queue.put_nowait(batch)
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
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            out: dict[int, ChoiceDelta] = {}
            for item in items:
                if item is _END:
                    remaining -= 1
                    start_next()
                elif isinstance(item, Exception):
                    raise item
                else:
                    for delta in item:
                        prev = out.get(delta.index)
                        if prev is None:
                            out[delta.index] = delta
                        else:
                            prev.extend(delta)
            if out:
                yield list(out.values())
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for g in generations:
            await g.aclose()
