"""The scheduler's `KVEvents` service (router.proto): its pool's KV events and load, for routers.

A thin adapter over `KVEventLog` (kv_events.py): a snapshot first, then every batch with the next
sequence number, or a load-only batch when nothing changed for the subscriber's interval. A batch
the subscriber's queue lost shows as a skipped number, which sends the router back to a snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref

import grpc

from llmesh.v1 import router_pb2, router_pb2_grpc
from scheduler_svc.kv_events import CLOSED, KVEventLog
from scheduler_svc.mesh import Mesh
from services.shard_load import ShardLoad

DEFAULT_LOAD_INTERVAL_MS = 100


# A waiting request's cached prefix when it was first counted (its hash chain walked once, not at
# every report): its cached tokens are no work ahead of the next request.
_cached_at_wait: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _uncached(planner, req) -> int:
    if req.num_cached_tokens >= 0:  # scheduled once: what it had cached is known
        return max(req.num_tokens - max(req.num_computed_tokens, req.num_cached_tokens), 0)
    cached = _cached_at_wait.get(req)
    if cached is None:
        cached = _cached_at_wait[req] = planner.cached_prefix_tokens(req.all_token_ids, req.cache_root)
    return max(req.num_tokens - max(req.num_computed_tokens, cached), 0)


def pool_load(mesh: Mesh) -> ShardLoad:
    """Prefill tokens still to compute (cached ones are no work), requests running and waiting, over
    the pool's workers."""
    load = ShardLoad(max_backlog=mesh.config.max_waiting_requests)
    for slot in mesh.workers.values():
        planner = slot.planner
        for req in planner.waiting:
            load.queued_tokens += _uncached(planner, req)
        for req in planner.running:
            load.queued_tokens += max(req.num_tokens - req.num_computed_tokens - 1, 0)
        load.running += planner.num_running
        load.waiting += planner.num_waiting
        load.num_workers += slot.connected
        load.num_blocks += planner.blocks.num_blocks
    load.backlog = mesh.num_backlog
    return load


def _load_msg(load: ShardLoad) -> router_pb2.ShardLoad:
    return router_pb2.ShardLoad(
        queued_tokens=load.queued_tokens,
        running=load.running,
        waiting=load.waiting,
        num_workers=load.num_workers,
        num_blocks=load.num_blocks,
        backlog=load.backlog,
        max_backlog=load.max_backlog,
    )


class KVEventsServicer(router_pb2_grpc.KVEventsServicer):
    def __init__(self, log: KVEventLog) -> None:
        self.log = log

    async def Subscribe(self, request, context):
        interval_ms = request.load_interval_ms or DEFAULT_LOAD_INTERVAL_MS
        if interval_ms < 10:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "load_interval_ms: at least 10")
        log = self.log
        sub, keys = log.subscribe()
        try:
            sequence = 1
            yield router_pb2.KVEventBatch(
                epoch=log.epoch,
                sequence=sequence,
                snapshot=True,
                stored=keys,
                load=_load_msg(log.load()),
                block_size=log.block_size,
                fingerprint=log.fingerprint,
                shard_id=log.shard_id,
            )
            while True:
                batch = None
                with contextlib.suppress(TimeoutError):
                    batch = await asyncio.wait_for(sub.queue.get(), interval_ms / 1000)
                if batch is CLOSED:
                    return
                sequence += 1
                if sub.lost:  # batches were dropped for this subscriber: a gap makes it resync
                    sub.lost = False
                    sequence += 1
                msg = router_pb2.KVEventBatch(
                    epoch=log.epoch,
                    sequence=sequence,
                    load=_load_msg(log.load()),
                    block_size=log.block_size,  # known once a worker joined (maybe after the snapshot)
                    fingerprint=log.fingerprint,
                )
                if batch is not None:
                    msg.stored.extend(batch.stored)
                    msg.removed.extend(batch.removed)
                yield msg
        finally:
            log.unsubscribe(sub)
