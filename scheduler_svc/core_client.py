"""The mesh as an API process sees it: requests go to the scheduler core over one Serve stream.

`CoreClient` has the face of `Mesh` that `SchedulerServicer` uses (`model_info`,
`num_workers`, `num_connected`, `submit`, `abort`, `on_workers_changed`), so the
public API runs unchanged in an API process. Submits and aborts go out on the
stream; the core's per-step messages come back and are handed out to each
request's queue. If the stream breaks, every request in flight ends with
UNAVAILABLE (the core aborted them: they cannot resume here) and the client
dials again with backoff. A full core refuses a submit with an error event
(RESOURCE_EXHAUSTED and its retry-after): the request's queue gets `Overloaded`,
as `Mesh.submit` would have raised, and the caller the same answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from llmesh.v1 import core_pb2, core_pb2_grpc
from scheduler_svc.mesh import NoWorkerAvailable, Overloaded
from scheduler_svc.planner import RequestRejected
from scheduler_svc.request import FinishReason, RequestDelta
from services.convert import (
    FINISH_REASON_FROM_PROTO,
    logprobs_from_proto,
    prompt_logprobs_from_proto,
    sampling_params_to_proto,
    worker_info_from_proto,
)
from services.grpc_server import ChannelSecurity, open_channel
from services.sampling_params import SamplingParams
from services.step import WorkerInfo

log = logging.getLogger(__name__)

RECONNECT_MAX_S = 2.0


class CoreClient:
    def __init__(self, address: str, security: ChannelSecurity | None = None) -> None:
        self.address = address
        self.security = security
        self.model_info: WorkerInfo | None = None
        self.num_workers = 0
        self.num_connected = 0
        self.on_workers_changed: list[Callable[[int], None]] = []
        self.attached = asyncio.Event()  # set while the stream is up and the model state known
        self._queues: dict[str, asyncio.Queue] = {}  # live requests: where their deltas go
        self._prompts: dict[str, list[int]] = {}  # prompts of live requests with prompt logprobs
        self._outbox: asyncio.Queue[core_pb2.CoreRequest] = asyncio.Queue()

    # ----- Mesh's face -----
    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        queue: asyncio.Queue | None = None,
        group: str = "",
        cache_salt: str = "",
        lora_name: str = "",
        lora_path: str = "",
    ) -> asyncio.Queue:
        """Send a request to the core; its deltas go to `queue` (shared by a request's choices)."""
        info = self.model_info
        if info is None or not self.attached.is_set():
            raise NoWorkerAvailable("the scheduler core is not reachable yet")
        if request_id in self._queues:
            raise RequestRejected(f"duplicate request id {request_id!r}")
        bad = [t for t in prompt_token_ids if not 0 <= t < info.vocab_size]
        if bad:
            vocab = info.vocab_size
            raise RequestRejected(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        queue = queue if queue is not None else asyncio.Queue()
        self._queues[request_id] = queue
        if params.prompt_logprobs is not None:  # their wire form names positions, not tokens
            self._prompts[request_id] = list(prompt_token_ids)
        submit = core_pb2.CoreSubmit(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=sampling_params_to_proto(params),
            priority=priority,
            group=group,
            cache_salt=cache_salt,
            lora_name=lora_name,
            lora_path=lora_path,
        )
        self._outbox.put_nowait(core_pb2.CoreRequest(submit=submit))
        return queue

    def abort(self, request_id: str) -> bool:
        """Stop a request; its queue gets a last delta (ABORT) at once, as `Mesh.abort` does."""
        queue = self._queues.pop(request_id, None)
        self._prompts.pop(request_id, None)
        if queue is None:
            return False
        self._outbox.put_nowait(core_pb2.CoreRequest(abort=core_pb2.CoreAbort(request_ids=[request_id])))
        queue.put_nowait(RequestDelta(request_id, [], [], FinishReason.ABORT))
        return True

    # ----- the stream -----
    async def run(self) -> None:
        """Keep the stream to the core up for as long as this runs (cancel it to stop)."""
        delay = 0.05
        while True:
            try:
                async with open_channel(self.address, self.security) as channel:
                    call = core_pb2_grpc.SchedulerCoreStub(channel).Serve(self._requests())
                    async for events in call:
                        self._absorb(events)
                        delay = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the core restarted or is unreachable: dial again
                log.warning("scheduler core stream broke", extra={"core": self.address, "error": repr(e)})
            self._detached("the scheduler core's stream broke")
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_S)

    async def _requests(self) -> AsyncIterator[core_pb2.CoreRequest]:
        while True:
            yield await self._outbox.get()

    def _absorb(self, events: core_pb2.CoreEvents) -> None:
        if events.HasField("model"):
            state = events.model
            self.model_info = worker_info_from_proto(state.info) if state.HasField("info") else None
            self.num_workers, self.num_connected = state.num_workers, state.num_connected
            self.attached.set()
            for callback in self.on_workers_changed:
                callback(self.num_workers)
        for d in events.deltas:
            queue = self._queues.get(d.request_id)
            if queue is None:
                continue  # aborted here already
            if d.error_code:
                del self._queues[d.request_id]
                self._prompts.pop(d.request_id, None)
                queue.put_nowait(_error_from_proto(d))
                continue
            token_ids = list(d.token_ids)
            wire = FINISH_REASON_FROM_PROTO.get(d.finish_reason)
            finish = FinishReason(wire) if wire is not None else None
            logprobs = logprobs_from_proto(d.logprobs, token_ids) if d.HasField("logprobs") else []
            prompt_logprobs = None
            if d.HasField("prompt_logprobs"):
                prompt = self._prompts.pop(d.request_id, [])
                prompt_logprobs = prompt_logprobs_from_proto(d.prompt_logprobs, prompt)
            if finish is not None:
                del self._queues[d.request_id]
                self._prompts.pop(d.request_id, None)
            queue.put_nowait(
                RequestDelta(
                    d.request_id, token_ids, logprobs, finish,
                    d.num_prompt_tokens, d.num_output_tokens, d.num_cached_tokens, prompt_logprobs,
                    list(d.embedding) if d.embedding else None,
                )  # fmt: skip
            )

    def _detached(self, reason: str) -> None:
        """The stream is gone and the core aborted its requests: end each one here."""
        was_attached = self.attached.is_set()
        self.attached.clear()
        self.num_connected = 0
        queues, self._queues = self._queues, {}
        self._prompts.clear()
        for queue in queues.values():
            queue.put_nowait(NoWorkerAvailable(reason))
        with contextlib.suppress(asyncio.QueueEmpty):
            while True:  # what was meant for the old stream is void
                self._outbox.get_nowait()
        if was_attached:
            for callback in self.on_workers_changed:
                callback(0)


def _error_from_proto(d: core_pb2.CoreDelta) -> Exception:
    """The core's error event as the exception `Mesh` would have raised (SchedulerServicer maps it)."""
    if d.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
        return Overloaded(d.error, d.retry_after_s)
    if d.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]:
        return RequestRejected(d.error)
    return NoWorkerAvailable(d.error)
