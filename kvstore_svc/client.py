"""Clients of the KV store: `KVStoreClient` (blocking, for worker threads) and `AsyncKVStoreClient`.

    with KVStoreClient("127.0.0.1:50070") as kv:
        n = kv.lookup(fingerprint, keys)                     # leading keys present
        kv.put(fingerprint, [(key, make_header(...), payload)])
        for key, header, payload in kv.get(fingerprint, keys[:n]):
            ...

On the store's own host (`shared_memory="auto"` and a loopback address, or "on") gets read
entries where they lie in the store's shared memory arena (GetInPlace, a read-only mapping,
kvstore_svc/inplace_client.py) and puts move payloads through shared memory segments this
client owns (PutShared; GetShared for gets when the store keeps no arena,
kvstore_svc/shared_client.py); whatever the store or host refuses, the client stops asking
for and streams (Get / Put) instead. `get_each` hands each payload over as a view (of the
arena or segment, no copy) valid while the callback runs; `get` returns copies.

From a store on another host (`bulk="auto"` and an address that is not loopback) gets go
over the store's bulk path (kvstore_svc/bulk.py): the store advertises its port in Stats,
and entries arrive over several plain TCP connections at link speed instead of the Get
stream's protobuf pieces. `bulk="on"` takes it first on any address, even where shared
memory would serve (for comparisons: a store on loopback standing in for another host),
"off" never; on this host "auto" keeps the shared memory paths and the stream. A store
without one, or a bulk path that cannot be reached, leaves gRPC streaming (the port is
asked for again after `BULK_RETRY_S`).

A store that is down, slow or shutting down raises `KVStoreUnavailable`:
treat it as a miss and recompute. Other failures (the store refused the call
as malformed) raise `KVStoreError`, its base class, so `except KVStoreError`
covers both. Entries from `get` are checked (header, key order, checksum)
before they are returned; the list stops before the first one that fails.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from kvstore_svc import shm
from kvstore_svc.bulk import DEFAULT_CONNECTIONS, Alloc, BulkClient, BulkError, Found, Received
from kvstore_svc.config import PIECE_BYTES
from kvstore_svc.inplace_client import ArenaMap, InPlacePath
from kvstore_svc.shared_client import Consume, Fence, SharedPath, SharedRefused, is_loopback, wants_shared
from kvstore_svc.shm import Segment
from kvstore_svc.wire import Assembled, EntryAssembler, EntryIn, check_entry_keys, entries_of, put_requests
from llmesh.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.grpc_server import (
    DEFAULT_KEEPALIVE_S,
    MAX_MESSAGE_BYTES,
    ChannelSecurity,
    open_channel,
    open_sync_channel,
)
from services.kv_entry import CorruptEntry, EntryHeader, check_payload
from services.mesh_secret import client_key

log = logging.getLogger(__name__)

EntryOut = tuple[bytes, EntryHeader, bytes]
DEFAULT_TIMEOUT_S = 5.0
# Codes that say "not now" rather than "never": the caller should treat them as a miss.
_TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }
)
# After the bulk path failed or the store had none, ask the store for its port again after this long.
BULK_RETRY_S = 30.0
# A worker's kv_store_transfer: which path its store client takes (the others stay fallbacks).
TRANSFERS = ("auto", "bulk", "grpc", "shm")
# Payloads above this are checksummed off the event loop by the async client.
_INLINE_CHECK_BYTES = 1 << 20


class KVStoreError(Exception):
    """A KV store call failed; `code` is the gRPC status (None for a reply that failed validation)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class KVStoreUnavailable(KVStoreError):
    """The store is unreachable, too slow (deadline) or shutting down: treat the call as a miss."""


def _error(e: grpc.RpcError, what: str) -> KVStoreError:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    cls = KVStoreUnavailable if code in _TRANSIENT or code is None else KVStoreError
    return cls(f"kvstore {what}: {code.name if code else 'error'}: {details}", code)


class _Collector:
    """Checks the entries of a Get reply in order; `accept` says False at the first bad one."""

    def __init__(self, fingerprint: bytes, keys: Sequence[bytes]) -> None:
        self.fingerprint = fingerprint
        self.keys = keys
        self.entries: list[EntryOut] = []
        self.count = 0  # entries that passed

    def check(self, entry: Assembled) -> EntryOut | None:
        i = self.count
        try:
            if i >= len(self.keys) or entry.key != self.keys[i]:
                raise CorruptEntry(f"entry {i} is not key {i} of the request")
            if entry.header.fingerprint != self.fingerprint:
                raise CorruptEntry(f"entry {i} has another fingerprint")
            payload = entry.payload()
            check_payload(entry.header, payload)
        except CorruptEntry as e:
            log.warning("kvstore sent an entry that fails validation", extra={"reason": str(e)})
            return None
        self.count += 1
        return entry.key, entry.header, payload


def _bulk_key(security: ChannelSecurity | None) -> str | None:
    """The mesh key the bulk path authenticates with; None (no bulk path) under TLS or mTLS only."""
    if security is None:
        try:
            return client_key()
        except ValueError:
            return None
    return None if security.credentials is not None else security.key


def transfer_options(transfer: str, shared_memory: str = "auto") -> dict[str, str]:
    """`KVStoreClient` keywords for a worker's `kv_store_transfer`: "auto" (the bulk path to a
    store on another host, shared memory on this one), "bulk" (the bulk path even on loopback, no
    shared memory: a store on this host measured as if it were on another), "grpc" (streams
    only), "shm" (shared memory: the store's arena in place, or segments)."""
    if transfer not in TRANSFERS:
        raise ValueError(f"kv_store_transfer must be one of {', '.join(TRANSFERS)}, got {transfer!r}")
    return {
        "auto": {"shared_memory": shared_memory, "bulk": "auto"},
        "bulk": {"shared_memory": "off", "bulk": "on"},
        "grpc": {"shared_memory": "off", "bulk": "off"},
        "shm": {"shared_memory": "on", "bulk": "off"},
    }[transfer]


def _host_of(address: str) -> str | None:
    """The host of a `host:port` / `[v6]:port` address; None for other targets (dns:///, unix:)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in address or not host:
        return None
    return host.strip("[]")


class KVStoreClient:
    """Blocking client; thread-safe (one gRPC channel, any number of threads).

    shared_memory: "auto" (segments when the address is this host's), "on" (whenever
    /dev/shm exists; still streams if the store refuses them) or "off";
    segment_bytes: the size of each of its (two) segments, made when first used;
    in_place: read from the store's arena when it offers one (off: GetShared, for comparisons);
    bulk: "auto" (the store's bulk path when its address is not this host's), "on" (first, on
    any address, even where shared memory would serve) or "off"; bulk_connections: its TCP
    connections; transfer: a worker's kv_store_transfer, which sets shared_memory and bulk
    (`transfer_options`).
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        piece_bytes: int = PIECE_BYTES,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        security: ChannelSecurity | None = None,
        shared_memory: str = "auto",
        segment_bytes: int = shm.DEFAULT_SEGMENT_BYTES,
        shm_root: str = shm.SHM_DIR,
        in_place: bool = True,
        bulk: str = "auto",
        bulk_connections: int = DEFAULT_CONNECTIONS,
        transfer: str | None = None,
    ) -> None:
        if transfer is not None:  # a worker's kv_store_transfer decides both
            options = transfer_options(transfer, shared_memory)
            shared_memory, bulk = options["shared_memory"], options["bulk"]
        if bulk not in ("auto", "on", "off"):
            raise ValueError(f"bulk must be auto, on or off, got {bulk!r}")
        self.address = address
        self.timeout_s = timeout_s
        self.piece_bytes = piece_bytes
        self.bulk_mode = "off" if bulk == "auto" and is_loopback(address) else bulk
        self.bulk_connections = bulk_connections
        self._bulk_key = _bulk_key(security) if self.bulk_mode != "off" else None
        self._bulk: BulkClient | None = None
        self._bulk_asked_at: float | None = None  # when the store was last asked for its bulk port
        self._bulk_lock = threading.Lock()
        self._channel = open_sync_channel(address, security, max_message_bytes, keepalive_s)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self.shared: SharedPath | None = (
            SharedPath(segment_bytes, root=shm_root)
            if wants_shared(shared_memory, address, shm_root)
            else None
        )
        self.in_place: InPlacePath | None = (
            InPlacePath(shm_root) if self.shared is not None and in_place else None
        )

    def on_segments(self, made: Callable[[Segment], None], closing: Callable[[Segment], None]) -> None:
        """Call `made(segment)` for each shared memory segment once it exists, `closing(segment)`
        before it is unmapped (the worker page-locks them for its device). Set before first use."""
        if self.shared is not None:
            self.shared.pool.on_create, self.shared.pool.on_close = made, closing

    def on_arena(self, mapped: Callable[[ArenaMap], None], unmapping: Callable[[ArenaMap], None]) -> None:
        """Call `mapped(arena)` for each store arena once it is mapped (read-only), `unmapping(arena)`
        before it is unmapped (the worker page-locks it for its device). Set before first use."""
        if self.in_place is not None:
            self.in_place.on_map, self.in_place.on_unmap = mapped, unmapping

    def prepare(self, fingerprint: bytes, *, timeout_s: float | None = None) -> None:
        """Set up the same-host paths now (map the store's arena, or make the segments, with the
        hooks of on_arena / on_segments), so the first load does not pay for it. Never raises:
        what cannot be set up now is set up, or refused, at first use as before."""
        timeout = timeout_s or self.timeout_s
        in_place = self.in_place
        if in_place is not None:
            try:
                in_place.prepare(self._stub, fingerprint, timeout)
                return
            except SharedRefused as e:
                self._stop_in_place(in_place, e)
            except grpc.RpcError as e:
                log.info("kvstore not reachable to prepare the in-place path", extra={"error": str(e)})
                return
        shared = self.shared
        if shared is not None:
            try:
                shared.pool.prepare()
            except (OSError, RuntimeError) as e:
                log.info("could not make the shared memory segments ahead", extra={"error": str(e)})

    def _stop_in_place(self, path: InPlacePath, why: object) -> None:
        """The store keeps no arena, or we cannot map it: GetShared / Get from now on."""
        if self.in_place is path:
            self.in_place = None
            log.info("kvstore entries cannot be read in place here", extra={"reason": str(why)})
        path.close()

    def _stop_sharing(self, shared: SharedPath, why: object) -> None:
        """The store refused our segments: stream from now on (for this store, i.e. this client)."""
        if self.shared is shared:
            self.shared = None
            log.info("kvstore cannot share memory with this client: streaming", extra={"reason": str(why)})
        shared.close()

    def lookup(self, fingerprint: bytes, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """How many leading keys the store holds (0 for no keys)."""
        if not keys:
            return 0
        req = kvstore_pb2.LookupRequest(fingerprint=fingerprint, keys=keys)
        try:
            return self._stub.Lookup(req, timeout=timeout_s or self.timeout_s).num_present
        except grpc.RpcError as e:
            raise _error(e, "lookup") from None

    def put(self, fingerprint: bytes, entries: Sequence[EntryIn], *, timeout_s: float | None = None) -> int:
        """Store (key, header, payload) entries; returns how many the store now holds.

        ValueError for a header of another fingerprint (nothing is sent);
        KVStoreError (INVALID_ARGUMENT) when the store refuses an entry.
        """
        if not entries:
            return 0
        check_entry_keys(entries, fingerprint)
        timeout = timeout_s or self.timeout_s
        stored = 0
        shared = self.shared
        if shared is not None:
            try:
                stored, entries = shared.put(self._stub, fingerprint, entries, timeout)
            except SharedRefused as e:
                self._stop_sharing(shared, e)  # entries stored before the refusal are stored again: a no-op
            except grpc.RpcError as e:
                raise _error(e, "put") from None
            if not entries:
                return stored
        try:
            resp = self._stub.Put(put_requests(fingerprint, entries, self.piece_bytes), timeout=timeout)
        except grpc.RpcError as e:
            raise _error(e, "put") from None
        return stored + resp.num_stored

    def get(
        self, fingerprint: bytes, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> list[EntryOut]:
        """The entries of the leading present keys, validated, in order (stops at a miss or a bad entry)."""
        out: list[EntryOut] = []
        self.get_each(fingerprint, keys, lambda k, h, p: out.append((k, h, bytes(p))), timeout_s=timeout_s)
        return out

    def get_each(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        consume: Consume,
        *,
        timeout_s: float | None = None,
        fence: Fence | None = None,
    ) -> int:
        """Give each entry of the leading present keys, validated, in order, to `consume(key, header,
        payload)`; how many it took. Stops at a miss, a bad entry, or when `consume` returns False.

        `payload` may be a read-only view of the store's arena or of a shared segment: without a
        `fence` it is valid only until `consume` returns (copy what must outlive it). A consumer
        whose copies run on asynchronously (a GPU's DMA) passes `fence`: called after it took
        payloads, it returns a function that waits for those copies, and each payload stays valid
        until that wait returns. Reading in place, the wait runs on a background thread, so the
        copies may still be running when this returns.
        """
        if not keys:
            return 0
        timeout = timeout_s or self.timeout_s
        if self.bulk_mode != "off":
            got = self._bulk_each(fingerprint, keys, consume, timeout, fence)
            if got is not None:
                return got
        done = 0
        in_place = self.in_place
        if in_place is not None:
            try:
                done, finished = in_place.get_each(self._stub, fingerprint, keys, consume, timeout, fence)
                if finished:
                    return done
            except SharedRefused as e:
                done = getattr(e, "done", 0)
                self._stop_in_place(in_place, e)
            except grpc.RpcError as e:
                raise _error(e, "get") from None
        shared = self.shared
        if shared is not None and done < len(keys):
            try:
                n, finished = shared.get_each(self._stub, fingerprint, keys[done:], consume, timeout, fence)
                done += n
                if finished:
                    return done
            except SharedRefused as e:
                self._stop_sharing(shared, e)
            except grpc.RpcError as e:
                raise _error(e, "get") from None
        return done + self._stream_each(fingerprint, keys[done:], consume, timeout, fence)

    @property
    def uses_bulk(self) -> bool:
        """Whether gets try the bulk path first (a store on another host, or bulk forced on)."""
        return self.bulk_mode != "off" and self._bulk_key is not None

    def get_into(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        alloc: Alloc,
        *,
        received: Received | None = None,
        timeout_s: float | None = None,
    ) -> list[Found | None] | None:
        """Entries of `keys` over the bulk path, each payload received straight into the buffer
        `alloc(index, header)` returns (a slice of the caller's pinned staging): (header, view of
        that buffer) per key, None for a miss or an entry not received whole. None when there is no
        bulk path (then call `get_each`). Headers are framed and checked against the request;
        payload checksums are NOT checked here: the caller verifies each entry's keyed MAC, which
        covers the bytes, where they land (the worker: on its device, kv_tiers.py).
        `received(index, header, payload)`: called on a transfer thread as each entry is whole
        (the worker queues its DMA then, overlapping the entries still arriving)."""
        if not keys or not self.uses_bulk:
            return None
        client = self._bulk_client(timeout_s or self.timeout_s)
        if client is None:
            return None
        try:
            return client.get_many(fingerprint, keys, alloc=alloc, received=received)
        except BulkError as e:
            self._drop_bulk(client, e)
            return None

    def _bulk_client(self, timeout: float) -> BulkClient | None:
        """The bulk path's client, made once the store advertised a port; None: stream over gRPC."""
        if self._bulk is not None or self._bulk_key is None:
            return self._bulk
        with self._bulk_lock:
            asked = self._bulk_asked_at
            if self._bulk is not None or (asked is not None and time.monotonic() - asked < BULK_RETRY_S):
                return self._bulk
            self._bulk_asked_at = time.monotonic()
            host = _host_of(self.address)
            try:
                port = self.stats(timeout_s=timeout).bulk_port if host is not None else 0
            except KVStoreError as e:
                log.info("kvstore bulk port unknown: streaming", extra={"error": str(e)})
                return None
            if port:
                self._bulk = BulkClient(
                    (host, port),
                    self._bulk_key,
                    self.bulk_connections,
                    timeout_s=self.timeout_s,  # type: ignore[arg-type]
                )
            return self._bulk

    def _drop_bulk(self, client: BulkClient, why: object) -> None:
        with self._bulk_lock:
            if self._bulk is client:
                self._bulk = None
                self._bulk_asked_at = time.monotonic()
        log.warning("kvstore bulk path unreachable: streaming for now", extra={"error": str(why)})
        client.close()

    def _bulk_each(
        self, fingerprint: bytes, keys: Sequence[bytes], consume: Consume, timeout: float, fence: Fence | None
    ) -> int | None:
        """get_each over the bulk path; None when there is none (the caller streams instead)."""
        client = self._bulk_client(timeout)
        if client is None or not keys:
            return None
        try:
            got = client.get_many(fingerprint, keys, verify=True)
        except BulkError as e:
            self._drop_bulk(client, e)
            return None
        n = 0
        try:
            for key, item in zip(keys, got, strict=True):
                if item is None:  # a miss, a bad entry or a broken connection: the chain ends
                    break
                n += 1
                if consume(key, *item) is False:
                    break
        finally:
            if fence is not None and n:
                fence()()  # the payloads are this call's buffers: done with before they go
        return n

    def _stream_each(
        self, fingerprint: bytes, keys: Sequence[bytes], consume: Consume, timeout: float, fence: Fence | None
    ) -> int:
        collector = _Collector(fingerprint, keys)
        call = self._stub.Get(kvstore_pb2.GetRequest(fingerprint=fingerprint, keys=keys), timeout=timeout)
        n = 0
        try:
            for entry in entries_of(call):
                checked = collector.check(entry)
                if checked is None:
                    call.cancel()
                    break
                n += 1
                go_on = consume(*checked)
                if fence is not None:  # the payload is this loop's bytes: done with before the next
                    fence()()
                if go_on is False:
                    call.cancel()
                    break
        except CorruptEntry as e:  # broken framing: keep what was whole before it
            log.warning("kvstore Get stream broke its framing", extra={"reason": str(e)})
            call.cancel()
        except grpc.RpcError as e:
            raise _error(e, "get") from None
        return n

    def delete(self, fingerprint: bytes, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        if not keys:
            return 0
        req = kvstore_pb2.DeleteRequest(fingerprint=fingerprint, keys=keys)
        try:
            return self._stub.Delete(req, timeout=timeout_s or self.timeout_s).num_deleted
        except grpc.RpcError as e:
            raise _error(e, "delete") from None

    def stats(self, *, timeout_s: float | None = None) -> kvstore_pb2.StatsResponse:
        try:
            return self._stub.Stats(kvstore_pb2.StatsRequest(), timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            raise _error(e, "stats") from None

    def close(self) -> None:
        bulk, self._bulk = self._bulk, None
        if bulk is not None:
            bulk.close()
        in_place, self.in_place = self.in_place, None
        if in_place is not None:
            in_place.close()
        shared, self.shared = self.shared, None
        if shared is not None:
            shared.close()  # unlinks the segments
        self._channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncKVStoreClient:
    """The same calls for an asyncio loop (the scheduler's); create and use it inside that loop."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        piece_bytes: int = PIECE_BYTES,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        security: ChannelSecurity | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.piece_bytes = piece_bytes
        self._channel = open_channel(address, security, max_message_bytes, keepalive_s)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)

    async def lookup(
        self, fingerprint: bytes, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> int:
        if not keys:
            return 0
        req = kvstore_pb2.LookupRequest(fingerprint=fingerprint, keys=keys)
        try:
            return (await self._stub.Lookup(req, timeout=timeout_s or self.timeout_s)).num_present
        except grpc.RpcError as e:
            raise _error(e, "lookup") from None

    async def put(
        self, fingerprint: bytes, entries: Sequence[EntryIn], *, timeout_s: float | None = None
    ) -> int:
        if not entries:
            return 0
        check_entry_keys(entries, fingerprint)
        try:
            resp = await self._stub.Put(
                put_requests(fingerprint, entries, self.piece_bytes), timeout=timeout_s or self.timeout_s
            )
        except grpc.RpcError as e:
            raise _error(e, "put") from None
        return resp.num_stored

    async def get(
        self, fingerprint: bytes, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> list[EntryOut]:
        if not keys:
            return []
        collector = _Collector(fingerprint, keys)
        assembler = EntryAssembler()
        call = self._stub.Get(
            kvstore_pb2.GetRequest(fingerprint=fingerprint, keys=keys), timeout=timeout_s or self.timeout_s
        )
        try:
            async for msg in call:
                entry = assembler.feed(msg.key, msg.header if msg.HasField("header") else None, msg.data)
                if entry is None:
                    continue
                if entry.header.payload_length > _INLINE_CHECK_BYTES:
                    checked = await asyncio.to_thread(collector.check, entry)
                else:
                    checked = collector.check(entry)
                if checked is None:
                    call.cancel()
                    break
                collector.entries.append(checked)
            else:
                assembler.finish()
        except CorruptEntry as e:
            log.warning("kvstore Get stream broke its framing", extra={"reason": str(e)})
            call.cancel()
        except grpc.RpcError as e:
            raise _error(e, "get") from None
        return collector.entries

    async def delete(
        self, fingerprint: bytes, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> int:
        if not keys:
            return 0
        req = kvstore_pb2.DeleteRequest(fingerprint=fingerprint, keys=keys)
        try:
            return (await self._stub.Delete(req, timeout=timeout_s or self.timeout_s)).num_deleted
        except grpc.RpcError as e:
            raise _error(e, "delete") from None

    async def stats(self, *, timeout_s: float | None = None) -> kvstore_pb2.StatsResponse:
        try:
            return await self._stub.Stats(kvstore_pb2.StatsRequest(), timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            raise _error(e, "stats") from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
