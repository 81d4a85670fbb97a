"""llmesh.v1.KVStore over grpc.aio: a thin adapter from protobuf to `TieredKVStore`.

The store blocks (disk reads, Redis round trips, hashing megabytes), so every
call into it runs on a thread pool: one caller's 64 MiB Put must not hold up
another's Lookup on the event loop. Malformed input is INVALID_ARGUMENT with
a message naming what is wrong; a miss is never an error.

GetShared / PutShared move payloads through a client's shared memory segment
(`shm.SegmentMaps`, `shared_transfer`); a store made without segment maps
(`--no-shared-memory`) or one that cannot open the segment answers
FAILED_PRECONDITION, and the client streams instead. GetInPlace / ReleaseInPlace lease
entries of the store's own arena (`TieredKVStore.lease_in_place`); FAILED_PRECONDITION
without one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from kvstore_svc.bulk import BulkServer
from kvstore_svc.shared_transfer import SharedEntry, copy_out, ingest
from kvstore_svc.shm import Region, SegmentMaps, SegmentUnavailable
from kvstore_svc.store import MAX_KEYS_PER_REQUEST, StoreStats, TieredKVStore, check_key, check_keys
from kvstore_svc.wire import Assembled, EntryAssembler, get_responses
from llmesh.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.kv_entry import CorruptEntry, encode_entry, header_from_proto, header_to_proto

log = logging.getLogger(__name__)
T = TypeVar("T")
GET_RUN_BYTES = 16 << 20


def stats_to_proto(stats: StoreStats) -> kvstore_pb2.StatsResponse:
    out = kvstore_pb2.StatsResponse(
        **{k: v for k, v in vars(stats).items() if k != "tiers"},
    )
    for t in stats.tiers:
        out.tiers.append(kvstore_pb2.TierStats(**vars(t)))
    return out


def _ingest(store: TieredKVStore, fingerprint: bytes, entry: Assembled) -> bool:
    """Join the pieces into a blob and store it (store.put validates it): a thread's work, megabytes."""
    blob = encode_entry(entry.header, entry.pieces, verify=False)
    entry.pieces.clear()  # the blob holds the bytes now: do not pin them twice
    return store.put(fingerprint, entry.key, blob)


def _region(msg: kvstore_pb2.SharedRegion) -> Region:
    region = Region(msg.segment, msg.segment_bytes, msg.offset, msg.length)
    region.check()
    return region


def _get_shared(
    store: TieredKVStore, segments: SegmentMaps, fingerprint: bytes, keys: list[bytes], region: Region
) -> tuple[list[SharedEntry], bool]:
    with segments.open(region) as segment:
        return copy_out(store, fingerprint, keys, segment, region)


def _put_shared(
    store: TieredKVStore,
    segments: SegmentMaps,
    fingerprint: bytes,
    entries: list[SharedEntry],
    region: Region,
) -> tuple[int, int]:
    with segments.open(region) as segment:
        return ingest(store, fingerprint, entries, segment, region)


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(
        self,
        executor: ThreadPoolExecutor,
        store: TieredKVStore | None = None,
        segments: SegmentMaps | None = None,
    ) -> None:
        self.store = store  # None until the service has built it (the disk scan runs after bind)
        self.segments = segments  # None: shared memory refused (FAILED_PRECONDITION)
        self._executor = executor
        self.shared_bytes_in = 0
        self.shared_bytes_out = 0
        self.bulk: BulkServer | None = None  # the bulk path (kvstore_svc/bulk.py), advertised by Stats

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _ready_store(self, context: grpc.aio.ServicerContext) -> TieredKVStore:
        if self.store is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the KV store is starting")
        return self.store  # type: ignore[return-value]

    async def _check_keys(
        self, context: grpc.aio.ServicerContext, fingerprint: bytes, keys: Sequence[bytes]
    ) -> None:
        try:
            check_keys(fingerprint, keys)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def Lookup(
        self, request: kvstore_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LookupResponse:
        store = await self._ready_store(context)
        await self._check_keys(context, request.fingerprint, request.keys)
        n = await self._run(store.lookup, request.fingerprint, list(request.keys))
        return kvstore_pb2.LookupResponse(num_present=n)

    async def Put(
        self, request_iterator: AsyncIterator[kvstore_pb2.PutRequest], context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        store = await self._ready_store(context)
        assembler = EntryAssembler(store.max_entry_bytes)
        fingerprint = b""
        stored = rejected = 0
        try:
            async for msg in request_iterator:
                if not fingerprint:
                    if not msg.fingerprint:
                        raise CorruptEntry("the first message of a Put stream needs the fingerprint")
                    fingerprint = msg.fingerprint
                    check_keys(fingerprint, [])
                elif msg.fingerprint and msg.fingerprint != fingerprint:
                    raise CorruptEntry("a Put stream carries one fingerprint; a later message named another")
                if msg.key:
                    check_key(msg.key, f"entry {assembler.count}: key")
                done = assembler.feed(msg.key, msg.header if msg.HasField("header") else None, msg.data)
                if done is None:
                    continue
                try:
                    ok = await self._run(_ingest, store, fingerprint, done)
                except CorruptEntry as e:
                    raise CorruptEntry(f"entry {done.index} (key {done.key.hex()[:16]}): {e}") from None
                stored += ok
                rejected += not ok
            assembler.finish()
        except (CorruptEntry, ValueError) as e:
            log.info("put refused", extra={"reason": str(e), "stored_before": stored, "peer": context.peer()})
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{e} ({stored} earlier entries stored, this one not)"
            )
        return kvstore_pb2.PutResponse(num_stored=stored, num_rejected=rejected)

    async def Get(
        self, request: kvstore_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.GetResponse]:
        store = await self._ready_store(context)
        await self._check_keys(context, request.fingerprint, request.keys)
        keys = list(request.keys)
        while keys:
            # A run of entries per trip to the I/O threads (a chain of small blocks is one trip),
            # bounded in bytes (a chain of big ones is not held in full at once).
            run, missed = await self._run(store.get_run, request.fingerprint, keys, GET_RUN_BYTES)
            for key, header, payload in run:
                for msg in get_responses(key, header, payload):
                    yield msg
            if missed:
                return  # the chain ends at its first miss
            keys = keys[len(run) :]

    async def _segments(self, context: grpc.aio.ServicerContext) -> SegmentMaps:
        if self.segments is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this store serves no shared memory (--no-shared-memory): use Get / Put",
            )
        return self.segments  # type: ignore[return-value]

    async def _checked_region(
        self, context: grpc.aio.ServicerContext, msg: kvstore_pb2.SharedRegion
    ) -> Region:
        try:
            return _region(msg)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"region: {e}")
            raise  # unreachable: abort raises

    async def GetShared(
        self, request: kvstore_pb2.GetSharedRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.GetSharedResponse:
        store = await self._ready_store(context)
        segments = await self._segments(context)
        await self._check_keys(context, request.fingerprint, request.keys)
        region = await self._checked_region(context, request.region)
        try:
            entries, full = await self._run(
                _get_shared, store, segments, request.fingerprint, list(request.keys), region
            )
        except SegmentUnavailable as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        self.shared_bytes_out += sum(e.header.payload_length for e in entries)
        return kvstore_pb2.GetSharedResponse(
            entries=[
                kvstore_pb2.SharedEntry(key=e.key, header=header_to_proto(e.header), offset=e.offset)
                for e in entries
            ],
            region_full=full,
        )

    async def PutShared(
        self, request: kvstore_pb2.PutSharedRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        store = await self._ready_store(context)
        segments = await self._segments(context)
        region = await self._checked_region(context, request.region)
        try:
            check_keys(request.fingerprint, [])
            if len(request.entries) > MAX_KEYS_PER_REQUEST:
                raise ValueError(f"at most {MAX_KEYS_PER_REQUEST} entries per request")
            entries = []
            for i, e in enumerate(request.entries):
                try:
                    header = header_from_proto(e.header, store.max_entry_bytes)
                except CorruptEntry as err:
                    raise CorruptEntry(f"entry {i} (key {e.key.hex()[:16]}): {err}") from None
                entries.append(SharedEntry(e.key, header, e.offset))
            stored, rejected = await self._run(
                _put_shared, store, segments, request.fingerprint, entries, region
            )
        except SegmentUnavailable as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (CorruptEntry, ValueError) as e:
            log.info("put refused", extra={"reason": str(e), "peer": context.peer()})
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.shared_bytes_in += sum(e.header.payload_length for e in entries[: stored + rejected])
        return kvstore_pb2.PutResponse(num_stored=stored, num_rejected=rejected)

    async def _arena_store(self, context: grpc.aio.ServicerContext) -> TieredKVStore:
        store = await self._ready_store(context)
        if store.arena is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this store keeps no shared memory arena (--no-shared-memory, --no-memory-arena, "
                "/dev/shm too small or no memory tier): use GetShared / Get",
            )
        return store

    async def GetInPlace(
        self, request: kvstore_pb2.GetInPlaceRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.GetInPlaceResponse:
        store = await self._arena_store(context)
        await self._check_keys(context, request.fingerprint, request.keys)
        grant = await self._run(store.lease_in_place, request.fingerprint, list(request.keys))
        # A client that gave up before this answer never releases it: the lease expires.
        return kvstore_pb2.GetInPlaceResponse(
            arena=grant.arena,
            arena_bytes=grant.arena_bytes,
            entries=[
                kvstore_pb2.InPlaceEntry(key=e.key, header=header_to_proto(e.header), offset=e.offset)
                for e in grant.entries
            ],
            lease_id=grant.lease_id,
            lease_timeout_ms=int(grant.lease_timeout_s * 1000),
            more=grant.more,
        )

    async def ReleaseInPlace(
        self, request: kvstore_pb2.ReleaseInPlaceRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.ReleaseInPlaceResponse:
        store = await self._arena_store(context)
        released = await self._run(store.release_in_place, request.lease_id)
        return kvstore_pb2.ReleaseInPlaceResponse(released=released)

    async def Delete(
        self, request: kvstore_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.DeleteResponse:
        store = await self._ready_store(context)
        await self._check_keys(context, request.fingerprint, request.keys)
        n = await self._run(store.delete, request.fingerprint, list(request.keys))
        return kvstore_pb2.DeleteResponse(num_deleted=n)

    async def Stats(
        self, request: kvstore_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.StatsResponse:
        store = await self._ready_store(context)
        out = stats_to_proto(await self._run(store.stats))
        out.shared_bytes_in, out.shared_bytes_out = self.shared_bytes_in, self.shared_bytes_out
        out.shared_segments = len(self.segments) if self.segments is not None else 0
        if self.bulk is not None:
            out.bulk_port, out.bulk_bytes_out, out.bulk_refused = (
                self.bulk.port,
                self.bulk.bytes_out,
                self.bulk.refused,
            )
        return out
