"""The client's half of GetShared / PutShared: payloads through its own shared memory segments.

`KVStoreClient` holds one `SharedPath` while the store takes it; the first call the store
answers FAILED_PRECONDITION (it cannot open the segment: another host or container, or
`--no-shared-memory`) or UNIMPLEMENTED (an older store) raises `SharedRefused`, and the
client streams from then on. A get hands each payload to the caller as a read-only view
of the segment, checked there (xxhash over the view, no copy); the segment stays leased to
that call until the caller's `consume` returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc

from kvstore_svc import shm
from kvstore_svc.shm import Region, Segment, SegmentPool, align, copy_into
from kvstore_svc.wire import EntryIn
from llmesh.v1 import kvstore_pb2
from services.kv_entry import CorruptEntry, EntryHeader, check_payload, header_from_proto, header_to_proto
from services.mesh_secret import is_loopback as host_is_loopback

log = logging.getLogger(__name__)

# consume(key, header, payload) -> False to stop; the payload may be a view valid only during the call.
Consume = Callable[[bytes, EntryHeader, memoryview | bytes], bool | None]
# For a consumer whose copies from a payload run on after it returns (a GPU's DMA): called after
# the consumer took payloads, it returns the function that waits until those copies are done.
# A payload stays valid until that wait returns (see KVStoreClient.get_each).
Fence = Callable[[], Callable[[], None]]
MODES = ("auto", "on", "off")
_REFUSALS = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED})


class SharedRefused(Exception):
    """The store cannot use this client's segments (or they cannot be made): stream instead."""


def is_loopback(address: str) -> bool:
    """Whether a gRPC target names this host: a loopback IP, localhost, or a unix socket."""
    if address.startswith("unix:"):
        return True
    return host_is_loopback(address.rsplit(":", 1)[0] if ":" in address else address)


def wants_shared(mode: str, address: str, root: str = shm.SHM_DIR) -> bool:
    """auto: when the store's address is this host's; on: whenever /dev/shm exists; off: never."""
    if mode not in MODES:
        raise ValueError(f"shared memory mode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "off" or not shm.available(root):
        return False
    return mode == "on" or is_loopback(address)


def refused(e: grpc.RpcError) -> bool:
    """The store cannot take this path (not a failure: use another way); GetInPlace too."""
    return hasattr(e, "code") and e.code() in _REFUSALS


def _release(view: memoryview) -> None:
    try:
        view.release()
    except BufferError:  # the consumer kept a view of it (its own risk: the segment is reused)
        pass


class SharedPath:
    """GetShared / PutShared over a pool of this client's segments (thread-safe)."""

    def __init__(
        self, segment_bytes: int = shm.DEFAULT_SEGMENT_BYTES, segments: int = 2, root: str = shm.SHM_DIR
    ) -> None:
        # Two segments: a worker's step thread loads while its sender thread puts.
        self.pool = SegmentPool(segment_bytes, segments, root)
        self.bytes_in = 0  # payload bytes loaded through shared memory
        self.bytes_out = 0

    def get_each(
        self,
        stub,
        fingerprint: bytes,
        keys: Sequence[bytes],
        consume: Consume,
        timeout_s: float,
        fence: Fence | None = None,
    ) -> tuple[int, bool]:
        """Entries consumed, and whether the call is finished (False: stream the keys after them).
        With a `fence`, the consumer's copies from a reply's payloads are waited for before the
        segment is written again (the next reply) or handed back (a put may take it)."""
        done = 0
        try:
            with self.pool.lease() as segment:
                region = segment.region()
                while done < len(keys):
                    req = kvstore_pb2.GetSharedRequest(
                        fingerprint=fingerprint, keys=keys[done:], region=_region_proto(region)
                    )
                    try:
                        resp = stub.GetShared(req, timeout=timeout_s)
                    except grpc.RpcError as e:
                        if refused(e):
                            raise SharedRefused(e.details()) from None
                        raise
                    if not resp.entries:
                        return done, not resp.region_full  # a miss; or an entry larger than a segment
                    try:
                        for msg in resp.entries:
                            status = self._hand_over(segment, region, fingerprint, keys[done], msg, consume)
                            if status is not True:
                                return done + (status is None), True
                            done += 1
                    finally:
                        if fence is not None:
                            fence()()
                    if not resp.region_full:
                        return done, True  # the chain ended at a miss, or every key was read
        except OSError as e:
            raise SharedRefused(f"cannot make a shared memory segment: {e}") from None
        return done, True

    def _hand_over(
        self, segment: Segment, region: Region, fingerprint: bytes, want: bytes, msg, consume: Consume
    ) -> bool | None:
        """Check one entry in the segment and give it to `consume`: True to go on, False for a bad
        entry (not consumed), None when the consumer asked to stop (consumed)."""
        try:
            if msg.key != want:
                raise CorruptEntry("the reply's entries are not the request's keys in order")
            header = header_from_proto(msg.header)
            if header.fingerprint != fingerprint:
                raise CorruptEntry("entry of another fingerprint")
            n = header.payload_length
            if msg.offset % shm.ALIGN or not region.holds(msg.offset, n):
                raise CorruptEntry(f"payload at [{msg.offset}, {msg.offset + n}) is outside the region")
            view = segment.view[msg.offset : msg.offset + n].toreadonly()
            try:
                check_payload(header, view)
            except CorruptEntry:
                _release(view)
                raise
        except CorruptEntry as e:
            log.warning("kvstore sent an entry that fails validation", extra={"reason": str(e)})
            return False
        try:
            self.bytes_in += n
            go_on = consume(msg.key, header, view)
        finally:
            _release(view)
        return None if go_on is False else True

    def put(
        self, stub, fingerprint: bytes, entries: Sequence[EntryIn], timeout_s: float
    ) -> tuple[int, list[EntryIn]]:
        """Entries stored, and the entries too large for a segment (for the caller to stream)."""
        stored = 0
        too_big = [e for e in entries if e[1].payload_length > self.pool.size]
        fitting = [e for e in entries if e[1].payload_length <= self.pool.size]
        try:
            with self.pool.lease() as segment:
                start = 0
                while start < len(fitting):
                    pos, batch = 0, []
                    for key, header, payload in fitting[start:]:
                        n = header.payload_length
                        if pos + n > segment.size:
                            break
                        copy_into(segment.view[pos : pos + n], memoryview(payload).cast("B"))
                        batch.append(
                            kvstore_pb2.SharedEntry(key=key, header=header_to_proto(header), offset=pos)
                        )
                        pos = align(pos + n)
                    req = kvstore_pb2.PutSharedRequest(
                        fingerprint=fingerprint, region=_region_proto(segment.region()), entries=batch
                    )
                    try:
                        stored += stub.PutShared(req, timeout=timeout_s).num_stored
                    except grpc.RpcError as e:
                        if refused(e):
                            raise SharedRefused(e.details()) from None
                        raise
                    self.bytes_out += sum(m.header.payload_length for m in batch)
                    start += len(batch)
        except OSError as e:
            raise SharedRefused(f"cannot make a shared memory segment: {e}") from None
        return stored, too_big

    def close(self) -> None:
        self.pool.close()


def _region_proto(region: Region) -> kvstore_pb2.SharedRegion:
    return kvstore_pb2.SharedRegion(
        segment=region.segment, segment_bytes=region.segment_bytes, offset=region.offset, length=region.length
    )
