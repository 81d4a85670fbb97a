"""The scheduler core's side of `llmesh.v1.SchedulerCore`: one Serve stream per API process.

Every request an API process submits on its stream shares one sink: the mesh
hands it each delta as a step produces it, and the stream's writer wakes once
the step's deltas are all in and sends them as one message. So the core writes
one message per API process per step, however many callers those processes
stream to (protos/llmesh/v1/core.proto says why).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

import grpc

from llmesh.v1 import core_pb2, core_pb2_grpc
from scheduler_svc.mesh import Mesh, NoWorkerAvailable, Overloaded
from scheduler_svc.planner import RequestRejected
from scheduler_svc.request import RequestDelta
from services.convert import (
    FINISH_REASON_TO_PROTO,
    logprobs_to_proto,
    prompt_logprobs_to_proto,
    sampling_params_from_proto,
    worker_info_to_proto,
)
from services.sampling_params import SamplingParamsError

log = logging.getLogger(__name__)

_CHANGED = object()  # on a sink: the workers changed (send the model state)
_CLOSED = object()  # on a sink: the API process sends no more (the stream ends once its requests do)


class _Tagged:
    """The queue the mesh writes one request's deltas to: the stream's sink, tagged with its id."""

    __slots__ = ("_sink", "_request_id")

    def __init__(self, sink: asyncio.Queue, request_id: str) -> None:
        self._sink, self._request_id = sink, request_id

    def put_nowait(self, item: RequestDelta | Exception) -> None:
        self._sink.put_nowait(item if isinstance(item, RequestDelta) else (self._request_id, item))


class SchedulerCoreServicer(core_pb2_grpc.SchedulerCoreServicer):
    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self._sinks: set[asyncio.Queue] = set()
        mesh.on_workers_changed.append(self._workers_changed)

    def _workers_changed(self, num_workers: int) -> None:
        for sink in self._sinks:
            sink.put_nowait(_CHANGED)

    def model_state(self) -> core_pb2.CoreModelState:
        mesh = self.mesh
        state = core_pb2.CoreModelState(num_workers=len(mesh.workers), num_connected=mesh.num_connected)
        if mesh.model_info is not None:  # a prefill worker's KV export stays between workers
            state.info.CopyFrom(worker_info_to_proto(dataclasses.replace(mesh.model_info, kv_export=None)))
        return state

    async def Serve(
        self, request_iterator: AsyncIterator[core_pb2.CoreRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[core_pb2.CoreEvents]:
        sink: asyncio.Queue = asyncio.Queue()
        live: set[str] = set()  # submitted on this stream and not finished
        self._sinks.add(sink)
        reader = asyncio.ensure_future(self._read(request_iterator, sink, live))
        peer = context.peer()  # not from a finished call's context: its call object may be gone
        log.info("api process attached", extra={"peer": peer})
        try:
            yield core_pb2.CoreEvents(model=self.model_state())
            closing = False
            while not (closing and not live):
                items = [await sink.get()]
                while not sink.empty():  # behind a step: every delta it made goes out as one message
                    items.append(sink.get_nowait())
                closing = closing or any(item is _CLOSED for item in items)
                events = self._events(items, live)
                if events.deltas or events.HasField("model"):
                    yield events
        finally:
            reader.cancel()
            self._sinks.discard(sink)
            for request_id in live:  # the API process is gone: nobody reads these any more
                self.mesh.abort(request_id)
            log.info("api process detached", extra={"peer": peer, "aborted": len(live)})

    async def _read(
        self, requests: AsyncIterator[core_pb2.CoreRequest], sink: asyncio.Queue, live: set[str]
    ) -> None:
        try:
            async for msg in requests:
                if msg.HasField("submit"):
                    self._submit(msg.submit, sink, live)
                else:
                    for request_id in msg.abort.request_ids:
                        if request_id in live:  # only this stream's own requests
                            self.mesh.abort(request_id)
        except Exception as e:  # the API process went away: Serve's caller ends too
            log.info("api process stream read ended", extra={"error": repr(e)})
        finally:
            sink.put_nowait(_CLOSED)

    def _submit(self, msg: core_pb2.CoreSubmit, sink: asyncio.Queue, live: set[str]) -> None:
        rid = msg.request_id
        try:
            if not rid or rid in live:
                raise RequestRejected(f"request_id {rid!r} is empty or already running")
            params = sampling_params_from_proto(msg.sampling_params)
            self.mesh.submit(
                rid, list(msg.prompt_token_ids), params, msg.priority, _Tagged(sink, rid),  # type: ignore[arg-type]
                group=msg.group, cache_salt=msg.cache_salt, lora_name=msg.lora_name, lora_path=msg.lora_path,
            )  # fmt: skip
            live.add(rid)
        except (RequestRejected, SamplingParamsError, ValueError) as e:
            sink.put_nowait((rid, RequestRejected(str(e))))
        except (NoWorkerAvailable, Overloaded) as e:
            sink.put_nowait((rid, e))

    def _events(self, items: list, live: set[str]) -> core_pb2.CoreEvents:
        events = core_pb2.CoreEvents()
        for item in items:
            if item is _CLOSED:
                continue
            if item is _CHANGED:
                events.model.CopyFrom(self.model_state())
            elif isinstance(item, RequestDelta):
                if item.finished:
                    live.discard(item.request_id)
                events.deltas.append(_delta_to_proto(item))
            else:
                request_id, error = item
                live.discard(request_id)
                events.deltas.append(_error_to_proto(request_id, error))
        return events


def _error_to_proto(request_id: str, error: Exception) -> core_pb2.CoreDelta:
    """The error that ended a request (CoreClient turns it back into the same exception)."""
    msg = core_pb2.CoreDelta(request_id=request_id, error=str(error))
    if isinstance(error, Overloaded):
        msg.error_code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        msg.retry_after_s = error.retry_after_s
    elif isinstance(error, RequestRejected):
        msg.error_code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    else:
        msg.error_code = grpc.StatusCode.UNAVAILABLE.value[0]
    return msg


def _delta_to_proto(delta: RequestDelta) -> core_pb2.CoreDelta:
    msg = core_pb2.CoreDelta(
        request_id=delta.request_id,
        token_ids=delta.new_token_ids,
        num_prompt_tokens=delta.num_prompt_tokens,
        num_output_tokens=delta.num_output_tokens,
        num_cached_tokens=delta.num_cached_tokens,
    )
    if any(lp is not None for lp in delta.new_logprobs):
        msg.logprobs.CopyFrom(logprobs_to_proto(delta.new_logprobs, delta.new_token_ids))
    if delta.prompt_logprobs is not None:
        msg.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(delta.prompt_logprobs))
    if delta.embedding is not None:
        msg.embedding.extend(delta.embedding)
    if delta.finish_reason is not None:
        msg.finish_reason = FINISH_REASON_TO_PROTO[delta.finish_reason]  # type: ignore[assignment]
    return msg
