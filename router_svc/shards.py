"""The router's links to its scheduler shards: one channel each, its KV event stream, join and leave.

A shard joins from `--shards` (kept for the router's life), by registering (`ShardRegistry`), or
from DNS (`--shards-dns`, re-resolved). For each, one task holds the shard's KV event stream:
it subscribes, applies the snapshot and the batches to the index (router_svc/core.py), and on a
gap, a new epoch or a broken stream subscribes again (a snapshot first). The stream is also the
liveness check: while it is down the shard gets no new request; a registered shard down for
`shard_dead_after_s` is forgotten (it registers again when it comes back).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import socket
import time
from dataclasses import dataclass

import grpc

from llmesh.v1 import generation_pb2, generation_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2_grpc
from router_svc.config import RouterConfig
from router_svc.core import Router, Shard, ShardLoad
from router_svc.index import Batch
from services.auth import bearer_metadata
from services.grpc_server import ChannelSecurity, default_security, open_channel

log = logging.getLogger(__name__)

RESUBSCRIBE_MIN_S, RESUBSCRIBE_MAX_S = 0.1, 2.0
# Connections the relay keeps per shard. A shard's API processes share its port and the kernel
# hands each connection (not each stream) to one of them: one connection per router process would
# load one API process of the shard (docs/benchmarks.md: 95 % / 0 % busy with one connection per
# caller). gRPC shares a connection among a process's channels to one target unless each has a
# subchannel pool of its own (as gateway/shard_routing.py's OWN_CONNECTION).
RELAY_CONNECTIONS = 8  # as gateway/shard_routing.py: 4 put all on one of 2 API processes 1 time in 8
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)


@dataclass
class ShardLink:
    shard: Shard
    channel: grpc.aio.Channel
    scheduler: generation_pb2_grpc.SchedulerStub
    registry: worker_pb2_grpc.RegistryStub
    events: router_pb2_grpc.KVEventsStub
    # Scheduler.Generate, responses as raw bytes, on connections of its own (see `relay_generate`).
    generate: RelayLanes
    relay: RelayLanes
    task: asyncio.Task | None = None


def load_of(msg: router_pb2.ShardLoad) -> ShardLoad:
    return ShardLoad(
        msg.queued_tokens,
        msg.running,
        msg.waiting,
        msg.num_workers,
        msg.num_blocks,
        msg.backlog,
        msg.max_backlog,
    )


class RelayLanes:
    """Generate on `connections` connections to one shard, each call on the next (round robin);
    `close()` closes them all."""

    def __init__(self, address: str, security: ChannelSecurity, keepalive_s: float, connections: int) -> None:
        own = dataclasses.replace(security, key=None, options=(*security.options, OWN_CONNECTION))
        metadata = bearer_metadata(security.key) if security.key else None
        self.channels = [
            open_channel(address, own, keepalive_s=keepalive_s) for _ in range(max(1, connections))
        ]
        self._calls = [
            functools.partial(
                channel.unary_stream(
                    "/llmesh.v1.Scheduler/Generate",
                    request_serializer=generation_pb2.GenerateRequest.SerializeToString,
                    response_deserializer=None,
                ),
                metadata=metadata,
            )
            for channel in self.channels
        ]
        self._next = 0

    def __call__(self, request: generation_pb2.GenerateRequest, **kwargs) -> grpc.aio.UnaryStreamCall:
        call = self._calls[self._next % len(self._calls)]
        self._next += 1
        return call(request, **kwargs)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


def relay_generate(
    address: str, security: ChannelSecurity | None, keepalive_s: float, connections: int = RELAY_CONNECTIONS
) -> tuple[RelayLanes, RelayLanes]:
    """Channels without client interceptors, and Generate on them with the key as plain metadata:
    (what to close, what to call), one object.

    A grpc.aio client interceptor (the key, services/auth.py) wraps each streamed response in one
    more async iterator: one more event-loop hop per token relayed, the router's hot path (at
    stream interval 1 it relays every token of its shards). The key goes with the call instead."""
    lanes = RelayLanes(
        address, default_security() if security is None else security, keepalive_s, connections
    )
    return lanes, lanes


class ShardPool:
    def __init__(self, router: Router, config: RouterConfig, security: ChannelSecurity | None) -> None:
        self.router = router
        self.config = config
        self.security = security
        self.links: dict[str, ShardLink] = {}
        self.on_change: list = []  # called with no argument when a shard's readiness may have changed
        self._dns_task: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()  # departed shards' channels, closed once idle

    # ----- join / leave -----
    def add(self, address: str, shard_id: str = "", registered: bool = False) -> Shard:
        shard_id = shard_id or address
        link = self.links.get(shard_id)
        if link is not None and link.shard.address != address:  # the shard moved: dial the new place
            self._close_link(link)
            link = None
        shard = self.router.add_shard(shard_id, address, registered)
        if link is None:
            channel = open_channel(address, self.security, keepalive_s=self.config.keepalive_s)
            relay, generate = relay_generate(address, self.security, self.config.keepalive_s)
            link = ShardLink(
                shard,
                channel,
                generation_pb2_grpc.SchedulerStub(channel),
                worker_pb2_grpc.RegistryStub(channel),
                router_pb2_grpc.KVEventsStub(channel),
                generate,
                relay,
            )
            self.links[shard_id] = link
            link.task = asyncio.get_running_loop().create_task(self._follow(link), name=f"shard-{shard_id}")
            log.info("shard joined", extra={"shard_id": shard_id, "address": address})
        return shard

    def drain(self, shard_id: str) -> bool:
        """A shard leaves: no new request goes there; forgotten once its stream ends."""
        link = self.links.get(shard_id)
        if link is None:
            return False
        link.shard.draining = True
        self._changed()
        log.info("shard leaving", extra={"shard_id": shard_id})
        self.remove(shard_id)
        return True

    def remove(self, shard_id: str) -> None:
        link = self.links.pop(shard_id, None)
        self.router.remove_shard(shard_id)
        if link is not None:
            self._close_link(link)
        self._changed()

    def _close_link(self, link: ShardLink) -> None:
        if link.task is not None and link.task is not asyncio.current_task():
            link.task.cancel()
        self._closing.add(asyncio.ensure_future(self._close_when_idle(link)))

    async def _close_when_idle(self, link: ShardLink) -> None:
        """Close a departed shard's channel once the requests streaming over it have ended."""
        try:
            while link.shard.inflight > 0:
                await asyncio.sleep(1.0)
            await link.channel.close()
            await link.relay.close()
        finally:
            self._closing.discard(asyncio.current_task())  # type: ignore[arg-type]

    def link(self, shard: Shard) -> ShardLink | None:
        return self.links.get(shard.shard_id)

    async def close(self) -> None:
        if self._dns_task is not None:
            self._dns_task.cancel()
        for task in list(self._closing):
            task.cancel()
        for link in list(self.links.values()):
            if link.task is not None:
                link.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await link.task
            await link.channel.close()
            await link.relay.close()
        self.links.clear()

    def _changed(self) -> None:
        for callback in self.on_change:
            callback()

    # ----- the event stream -----
    async def _follow(self, link: ShardLink) -> None:
        shard, router = link.shard, self.router
        delay = RESUBSCRIBE_MIN_S
        while True:
            try:
                async for msg in self._subscribe(link):
                    delay = RESUBSCRIBE_MIN_S
                    if msg.block_size:  # the pool's cache layout (its first worker's)
                        shard.block_size, shard.fingerprint = msg.block_size, msg.fingerprint
                    if msg.snapshot:
                        router.set_connected(shard, True)
                    batch = Batch(msg.epoch, msg.sequence, msg.snapshot, list(msg.stored), list(msg.removed))
                    was_ready = shard.ready
                    if not router.on_batch(shard, batch, load_of(msg.load)):
                        log.info(
                            "shard events out of sync: resubscribing", extra={"shard_id": shard.shard_id}
                        )
                        break
                    if shard.ready != was_ready:
                        self._changed()
            except asyncio.CancelledError:
                raise
            except grpc.RpcError as e:
                log.info(
                    "shard event stream broke",
                    extra={"shard_id": shard.shard_id, "code": str(e.code()), "error": e.details()},
                )
            except Exception:
                log.exception("shard event stream failed", extra={"shard_id": shard.shard_id})
            router.set_connected(shard, False)
            self._changed()
            dead_after = self.config.shard_dead_after_s
            if shard.registered and shard.down_since and time.monotonic() - shard.down_since > dead_after:
                log.warning("shard gone", extra={"shard_id": shard.shard_id})
                self.remove(shard.shard_id)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESUBSCRIBE_MAX_S)

    def _subscribe(self, link: ShardLink):
        request = router_pb2.SubscribeKVEventsRequest(
            subscriber=socket.gethostname(), load_interval_ms=self.config.load_interval_ms
        )
        # wait_for_ready: a shard that is starting (or restarting) is waited for, not hammered.
        return link.events.Subscribe(request, wait_for_ready=False)

    # ----- DNS discovery -----
    def start_dns(self) -> None:
        if self.config.shards_dns:
            self._dns_task = asyncio.get_running_loop().create_task(self._resolve_loop())

    async def _resolve_loop(self) -> None:
        host, _, port = self.config.shards_dns.rpartition(":")
        while True:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
                found = {f"[{i[4][0]}]:{port}" if ":" in i[4][0] else f"{i[4][0]}:{port}" for i in infos}
                for address in found - self.links.keys():  # new, or forgotten after it died
                    self.add(address, registered=True)
            except OSError as e:
                log.info("shard DNS lookup failed", extra={"name": self.config.shards_dns, "error": str(e)})
            await asyncio.sleep(self.config.dns_refresh_s)
