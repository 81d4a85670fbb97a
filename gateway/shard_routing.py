"""Route, then stream: ask a router which scheduler shard runs a request, stream from that shard.

A router (router_svc) can relay Generate itself, but then every token crosses it once more. With
`ShardPicker.Route` (router.proto) it only picks: `ShardRouter.generate` asks it for a shard,
opens Generate on that shard over connections kept per shard address (`ShardChannels`), and yields
the shard's responses as they come. A refusal before the first response (the shard is full, has
no worker, or cannot be reached) asks Route again with that shard excluded; after the first
response a shard's failure ends the call with its status, as the relay does. When every shard
refused, the caller gets the refusal with the shortest retry-after; when none is left, the last
error (UNAVAILABLE). The router itself unreachable mid-way: the fallbacks of its last answer.

The gateway uses it (--direct-to-shards); benchmarks import it too: it needs only the stubs and
services.grpc_server, nothing of the gateway's HTTP side or of the router's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from llmesh.v1 import generation_pb2, router_pb2, router_pb2_grpc
from services.api_processes import PROCESS_KEY, PROCESSES_KEY
from services.auth import bearer_metadata
from services.grpc_server import DEFAULT_KEEPALIVE_S, ChannelSecurity, default_security, open_channel

GENERATE = "/llmesh.v1.Scheduler/Generate"
RETRY_AFTER_KEY = "retry-after"
# Answers of a shard before a request starts that another shard may not give: try the next one.
RETRY_ELSEWHERE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
log = logging.getLogger(__name__)

IDLE_CLOSE_S = 60.0  # a shard channel unused this long is closed (the shard may have left)
MAX_ATTEMPTS = 8  # shards tried for one request before giving up
# Connections kept per shard. A shard's API processes share its port (SO_REUSEPORT): the kernel
# hands each *connection* to one of them, and gRPC puts every stream of a channel on one
# connection, so a caller with one connection per shard loads one API process of it while the
# others idle (2-core machine: 2 connections from one process landed on the same one of 2 API
# processes 5 times of 5; 8 split 4/4 to 6/2, 32 split 16/16 to 20/12). Several connections,
# each stream on the least busy, spread the caller's streams over the shard's API processes.
# Since the connections learn their process (below), a caller needs only one per process: it
# starts with 2 and opens more while one of the shard's processes is unreached. Fewer connections
# carry more streams each, so more messages per read: 2-core machine, 2 shards behind the picker,
# 64 streams each, the clients' CPU per token 103 / 102 us with 8 connections, 84 / 92 with 2.
CONNECTIONS_PER_SHARD = 2
# gRPC shares one connection among a process's channels with the same target and arguments (its
# global subchannel pool): each of ours gets a pool of its own, so a connection of its own.
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)
# Even over connections is not even over API processes: the kernel's hash split 8 connections 4/4
# to 7/1 over 2 processes (2-core machine), and the 16-core host's API processes ran 61-51 % to
# 67-45 % busy. So each connection asks, once, which API process it reached (GetModelInfo's initial
# metadata, scheduler_svc/api_server.py) and a stream goes to the least busy *process*, then its
# least busy connection; a shard without API processes says nothing and each connection counts as
# a process of its own (as before). Where the connections miss one of the shard's processes, more
# are opened, up to this many per process the shard says it has (a hash's coupon collector: 6
# processes take ~15 connections on average to reach all).
GET_MODEL_INFO = "/llmesh.v1.Scheduler/GetModelInfo"
MAX_CONNECTIONS_PER_PROCESS = 4
IDENTIFY_TIMEOUT_S = 5.0


@dataclasses.dataclass
class _Lane:
    """One connection to a shard and Generate on it."""

    channel: grpc.aio.Channel
    generate: Any  # Scheduler.Generate on it (unary-stream multicallable)
    inflight: int = 0
    process: str = ""  # the shard's API process it reached ("" unknown: counts as one of its own)


@dataclasses.dataclass
class _ShardChannel:
    """A shard's connections (`lanes`); a request streams on the one with the fewest streams."""

    lanes: list[_Lane]
    inflight: int = 0
    last_used: float = 0.0
    processes: int = 0  # how many API processes the shard says it has (0: unknown, or none)


class ShardChannels:
    """Channels to shards, `connections` per address (more while one of a shard's API processes is
    unreached), opened on first use and closed once idle.

    The channels carry no client interceptor: a grpc.aio interceptor wraps each streamed response
    in one more async iterator (an event-loop hop per token). The key rides as call metadata."""

    def __init__(
        self,
        security: ChannelSecurity | None = None,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        idle_close_s: float = IDLE_CLOSE_S,
        connections: int = CONNECTIONS_PER_SHARD,
    ) -> None:
        security = default_security() if security is None else security
        self._security = dataclasses.replace(security, key=None, options=(*security.options, OWN_CONNECTION))
        self.metadata: tuple[tuple[str, str], ...] = bearer_metadata(security.key) if security.key else ()
        self.keepalive_s = keepalive_s
        self.idle_close_s = idle_close_s
        self.connections = max(1, connections)
        self.channels: dict[str, _ShardChannel] = {}
        self._swept = time.monotonic()

    def _lane(self, address: str) -> _Lane:
        channel = open_channel(address, self._security, keepalive_s=self.keepalive_s)
        call = channel.unary_stream(
            GENERATE,
            request_serializer=generation_pb2.GenerateRequest.SerializeToString,
            response_deserializer=generation_pb2.GenerateResponse.FromString,
        )
        return _Lane(channel, call)

    def acquire(self, address: str) -> _Lane:
        """The least busy connection to `address` (counted busy until `release`)."""
        now = time.monotonic()
        if now - self._swept > self.idle_close_s / 4:
            self._sweep(now)
        entry = self.channels.get(address)
        if entry is None:
            lanes = [self._lane(address) for _ in range(self.connections)]
            entry = self.channels[address] = _ShardChannel(lanes)
            for lane in lanes:
                self._identify_soon(address, entry, lane)
        lane = _least_busy(entry.lanes)
        lane.inflight += 1
        entry.inflight += 1
        entry.last_used = now
        return lane

    def release(self, address: str, lane: _Lane, broken: bool = False) -> None:
        lane.inflight -= 1
        entry = self.channels.get(address)
        if entry is None or lane not in entry.lanes:
            return  # its shard's connections were dropped meanwhile
        entry.inflight -= 1
        entry.last_used = time.monotonic()
        if broken and entry.inflight == 0:
            # The shard could not be reached: dial afresh next time (it may be another pod there).
            del self.channels[address]
            for each in entry.lanes:
                _close_soon(each.channel)

    def _identify_soon(self, address: str, entry: _ShardChannel, lane: _Lane) -> None:
        try:
            task = asyncio.get_running_loop().create_task(self._identify(address, entry, lane))
        except RuntimeError:  # no event loop (a synchronous caller): balance by connection
            return
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)

    async def _identify(self, address: str, entry: _ShardChannel, lane: _Lane) -> None:
        """Which API process `lane` reached; another connection if the shard's are not all reached."""
        ask = lane.channel.unary_unary(
            GET_MODEL_INFO,
            request_serializer=generation_pb2.GetModelInfoRequest.SerializeToString,
            response_deserializer=generation_pb2.ModelInfo.FromString,
        )
        call = ask(generation_pb2.GetModelInfoRequest(), timeout=IDENTIFY_TIMEOUT_S, metadata=self.metadata)
        try:
            metadata = await call.initial_metadata()
            with contextlib.suppress(grpc.aio.AioRpcError):
                await call  # a shard with no worker yet refuses, after naming the process
        except grpc.aio.AioRpcError:
            return  # unreachable for now: balanced by connection until redialled
        said = dict(metadata or ())
        lane.process = str(said.get(PROCESS_KEY, ""))
        try:
            entry.processes = max(entry.processes, int(said.get(PROCESSES_KEY, 0)))
        except ValueError:
            pass
        if self.channels.get(address) is not entry or not lane.process:
            return
        known = {each.process for each in entry.lanes}
        if all(known) and len(known) < entry.processes:
            if len(entry.lanes) < max(self.connections, MAX_CONNECTIONS_PER_PROCESS * entry.processes):
                extra = self._lane(address)
                entry.lanes.append(extra)
                self._identify_soon(address, entry, extra)

    def _sweep(self, now: float) -> None:
        self._swept = now
        for address, entry in list(self.channels.items()):
            if entry.inflight == 0 and now - entry.last_used > self.idle_close_s:
                del self.channels[address]
                for lane in entry.lanes:
                    _close_soon(lane.channel)

    async def close(self) -> None:
        for entry in self.channels.values():
            for lane in entry.lanes:
                await lane.channel.close()
        self.channels.clear()


def _least_busy(lanes: list[_Lane]) -> _Lane:
    """The least busy connection of the least busy API process (per request: a few lanes)."""
    load: dict[Any, int] = {}
    for lane in lanes:
        key = lane.process or id(lane)
        load[key] = load.get(key, 0) + lane.inflight
    return min(lanes, key=lambda lane: (load[lane.process or id(lane)], lane.inflight))


def _close_soon(channel: grpc.aio.Channel) -> None:
    task = asyncio.ensure_future(channel.close())
    _CLOSING.add(task)
    task.add_done_callback(_CLOSING.discard)


_CLOSING: set = set()  # channel closes in flight (a task needs a reference until it ends)


def _retry_after(error: grpc.aio.AioRpcError) -> int:
    for k, v in error.trailing_metadata() or ():
        if k == RETRY_AFTER_KEY:
            try:
                return int(v)
            except ValueError:
                break
    return 1


Relay = Callable[[generation_pb2.GenerateRequest, float, str], grpc.aio.UnaryStreamCall]


class ShardRouter:
    """The client half of the picker pattern: `generate` answers a call-like object.

    `relay(request, timeout, session)`: Generate on the router itself, used from the first Route
    answered UNIMPLEMENTED on (the address is a scheduler, or a router without ShardPicker)."""

    def __init__(
        self, picker: router_pb2_grpc.ShardPickerStub, channels: ShardChannels, relay: Relay | None = None
    ) -> None:
        self.picker = picker
        self.channels = channels
        self.relay = relay
        self.direct = True  # False once the far end turned out not to pick
        self.num_retries = 0

    def generate(
        self, request: generation_pb2.GenerateRequest, timeout: float, session: str = ""
    ) -> RoutedCall:
        return RoutedCall(self, request, timeout, session)

    async def route(
        self, request: generation_pb2.GenerateRequest, session: str, exclude: list[str], timeout: float
    ) -> router_pb2.RouteResponse:
        ask = router_pb2.RouteRequest(
            cache_salt=request.cache_salt,
            lora_name=request.lora_name,
            lora_path=request.lora_path,
            session_id=session,
            exclude=exclude,
        )
        if request.HasField("prompt_token_ids"):
            ask.prompt_token_ids.CopyFrom(request.prompt_token_ids)
        return await self.picker.Route(ask, timeout=timeout, wait_for_ready=False)


class RoutedCall:
    """One request: route, stream from the shard, re-route on a refusal before the first response.

    Iterate it once (as a grpc.aio call); `cancel()` cancels the shard's call (the shard aborts the
    request and frees its blocks). Failures raise grpc.aio.AioRpcError, as a call would."""

    def __init__(
        self, owner: ShardRouter, request: generation_pb2.GenerateRequest, timeout: float, session: str
    ) -> None:
        self._owner = owner
        self._request = request
        self._deadline = time.monotonic() + timeout
        self._session = session
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._cancelled = False
        self.shard_id = ""  # where it streams from, once routed

    def cancel(self) -> bool:
        self._cancelled = True
        if self._call is not None:
            return self._call.cancel()
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def __aiter__(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        return self._stream()

    def _left(self) -> float:
        return max(self._deadline - time.monotonic(), 0.001)

    async def _pick(self, exclude: list[str], fallbacks: list) -> router_pb2.ShardChoice | None:
        """Route's answer; when the router cannot be asked, the next fallback of its last answer."""
        try:
            reply = await self._owner.route(self._request, self._session, exclude, self._left())
        except grpc.aio.AioRpcError as e:
            # No picker there (a scheduler), or this caller may not ask it (no internal key): the
            # far end's public Generate relays instead, for this and every later request.
            no_pick = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED)
            if e.code() in no_pick and self._owner.relay is not None:
                if self._owner.direct:
                    log.warning("no shard picker: relaying through it", extra={"error": e.details()})
                self._owner.direct = False
                return None
            if e.code() != grpc.StatusCode.UNAVAILABLE or not exclude:
                raise
            # The router is gone or has no other ready shard: its earlier runners-up, if any.
            while fallbacks:
                choice = fallbacks.pop(0)
                if choice.shard_id not in exclude:
                    return choice
            return None
        fallbacks[:] = list(reply.fallbacks)
        return reply.shard

    async def _relayed(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        assert self._owner.relay is not None
        call = self._call = self._owner.relay(self._request, self._left(), self._session)
        if self._cancelled:
            call.cancel()
        async for resp in call:
            yield resp

    async def _stream(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        owner, channels = self._owner, self._owner.channels
        if not owner.direct:
            async for resp in self._relayed():
                yield resp
            return
        exclude: list[str] = []
        fallbacks: list = []
        refusals: list[grpc.aio.AioRpcError] = []
        last: grpc.aio.AioRpcError | None = None
        while len(exclude) < MAX_ATTEMPTS:
            if self._cancelled:
                raise asyncio.CancelledError()
            choice = await self._pick(exclude, fallbacks)
            if choice is None and not owner.direct:
                async for resp in self._relayed():
                    yield resp
                return
            if choice is None:
                break
            self.shard_id = choice.shard_id
            entry = channels.acquire(choice.address)
            call = entry.generate(
                self._request, timeout=self._left(), metadata=channels.metadata, wait_for_ready=False
            )
            self._call = call
            if self._cancelled:
                call.cancel()
            started = broken = done = False
            try:
                async for resp in call:
                    started = True
                    yield resp
                done = True
                return
            except grpc.aio.AioRpcError as e:
                if started or e.code() not in RETRY_ELSEWHERE or self._cancelled:
                    raise
                # Refused before it started: nothing was streamed, another shard may take it.
                exclude.append(choice.shard_id)
                owner.num_retries += 1
                last = e
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refusals.append(e)
                else:
                    broken = True
            finally:
                channels.release(choice.address, entry, broken)
                if not done:  # refused, failed, or the consumer left: the shard drops the request
                    call.cancel()
        if refusals:  # every shard tried was full: the soonest retry-after
            raise min(refusals, key=_retry_after)
        if last is not None:
            raise last
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            "no scheduler shard is ready",
        )
