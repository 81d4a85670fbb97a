"""The client's half of GetInPlace / ReleaseInPlace: entries read where they lie in the store's arena.

`KVStoreClient` holds one `InPlacePath` while the store offers it. A get asks the store to
lease the leading keys' slots, maps the named arena READ-ONLY (once; again when the store
restarts and names a new arena), hands each payload to the caller as a read-only view of that
mapping, then releases the lease. No checksum pass: the store checked each entry when it came
in, and the bytes never left the host (kvstore.proto, GetInPlace).

A store without an arena (FAILED_PRECONDITION), an older store (UNIMPLEMENTED) or an arena this
process cannot open (another host, container or user) raises `SharedRefused`: the client
uses GetShared / Get from then on.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from kvstore_svc import shm
from kvstore_svc.arena import check_arena_name
from kvstore_svc.shared_client import Consume, Fence, SharedRefused, refused
from llmesh.v1 import kvstore_pb2
from services.kv_entry import CorruptEntry, EntryHeader, header_from_proto

log = logging.getLogger(__name__)

# A payload is read only while its lease has at least this share of its time left.
_LEASE_MARGIN = 0.2


class ArenaMap:
    """One store arena mapped read-only: `view` (a read-only memoryview), `address`, `size`."""

    def __init__(self, name: str, size: int, root: str) -> None:
        check_arena_name(name)
        path = os.path.join(root, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise SharedRefused(f"cannot open the store's arena {name}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise SharedRefused(f"arena {name} is not a regular file of {size} bytes")
            if st.st_uid != os.getuid():
                raise SharedRefused(f"arena {name} belongs to another user")
            self._mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.name, self.size, self.ident = name, size, (st.st_dev, st.st_ino)
        self.view = memoryview(self._mm)  # read-only: the mapping is PROT_READ
        import numpy as np  # the address of a read-only buffer (ctypes wants a writable one)

        self.address = int(np.frombuffer(self._mm, dtype=np.uint8).ctypes.data) if size else 0
        self.users = 0
        self.dropped = False
        self.page_locked = False  # set by an on_map hook that page-locked it

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a caller kept a view: the mapping goes with it
            self._mm.close()


class InPlacePath:
    """GetInPlace over the store's arena, mapped once (thread-safe)."""

    def __init__(self, root: str = shm.SHM_DIR) -> None:
        self.root = root
        self.bytes_in = 0  # payload bytes read in place
        self.on_map: Callable[[ArenaMap], None] | None = None  # e.g. page-lock it for a device
        self.on_unmap: Callable[[ArenaMap], None] | None = None
        self._map: ArenaMap | None = None
        self._lock = threading.Lock()
        self._mapping = threading.Lock()  # held while an arena is mapped and page-locked
        # Leases to end once their copies are done (get_each with a fence), and the thread doing it.
        self._releases: queue.Queue = queue.Queue()
        self._releaser: threading.Thread | None = None

    @property
    def arena(self) -> str | None:
        """The name of the arena mapped now."""
        m = self._map
        return m.name if m is not None else None

    def _acquire(self, name: str, size: int) -> ArenaMap:
        with self._mapping:  # one mapping at a time: a second caller uses the first's
            with self._lock:
                m = self._map
                if m is not None and m.name == name and m.size == size:
                    m.users += 1
                    return m
            fresh = ArenaMap(name, size, self.root)  # SharedRefused if it cannot be opened here
            if self.on_map is not None:
                self.on_map(fresh)
            return self._install(fresh)

    def _install(self, fresh: ArenaMap) -> ArenaMap:
        with self._lock:
            old, self._map = self._map, fresh
            fresh.users += 1
            stale = self._retire(old)
        if stale is not None:
            self._close(stale)
        return fresh

    def _retire(self, m: ArenaMap | None) -> ArenaMap | None:
        """Under the lock: mark `m` dropped; returned when no call reads it now (close it)."""
        if m is None:
            return None
        m.dropped = True
        return m if m.users == 0 else None

    def _release(self, m: ArenaMap) -> None:
        with self._lock:
            m.users -= 1
            close = m.dropped and m.users == 0
        if close:
            self._close(m)

    def _close(self, m: ArenaMap) -> None:
        if self.on_unmap is not None:
            try:
                self.on_unmap(m)
            except Exception as e:  # noqa: BLE001  # unmapping matters more
                log.warning("unmapping the store's arena", extra={"error": repr(e)})
        m.close()

    def drop(self) -> None:
        """Forget the mapping (the store is gone: its memory is freed once nothing maps it)."""
        with self._lock:
            old, self._map = self._map, None
            stale = self._retire(old)
        if stale is not None:
            self._close(stale)

    def prepare(self, stub, fingerprint: bytes, timeout_s: float) -> str:
        """Map the store's arena now (and run `on_map`: page-locking GiBs takes a second or more),
        so that the first load does not wait for it. The arena's name; SharedRefused when this
        store or host offers no in-place reads."""
        try:
            resp = stub.GetInPlace(kvstore_pb2.GetInPlaceRequest(fingerprint=fingerprint), timeout=timeout_s)
        except grpc.RpcError as e:
            if refused(e):
                raise SharedRefused(e.details()) from None
            raise
        self._release(self._acquire(resp.arena, resp.arena_bytes))  # no keys: no lease to end
        return resp.arena

    def get_each(
        self,
        stub,
        fingerprint: bytes,
        keys: Sequence[bytes],
        consume: Consume,
        timeout_s: float,
        fence: Fence | None = None,
    ) -> tuple[int, bool]:
        """Entries consumed, and whether the call is finished (False: read the keys after them
        another way). SharedRefused (its `done`: entries consumed before) when this store or host
        offers no in-place reads.

        With a `fence`, the lease (and the mapping) is ended by a background thread once the
        consumer's copies are done, so that they run on after this returns: a GPU's DMA from the
        arena then overlaps the caller's next work (the forward's launches) instead of preceding it.
        """
        done = 0
        while done < len(keys):
            try:
                req = kvstore_pb2.GetInPlaceRequest(fingerprint=fingerprint, keys=keys[done:])
                resp = stub.GetInPlace(req, timeout=timeout_s)
            except grpc.RpcError as e:
                if refused(e):
                    refusal = SharedRefused(e.details())
                    refusal.done = done  # type: ignore[attr-defined]
                    raise refusal from None
                self.drop()  # a dead store: let its arena go
                raise
            granted_at = time.monotonic()
            if not resp.entries:
                return done, not resp.more
            try:
                m = self._acquire(resp.arena, resp.arena_bytes)
            except BaseException as e:
                self._release_lease(stub, resp.lease_id, timeout_s)
                if isinstance(e, SharedRefused):
                    e.done = done  # type: ignore[attr-defined]
                raise
            expires = granted_at + resp.lease_timeout_ms / 1000 * (1 - _LEASE_MARGIN)
            try:
                status = self._read(m, fingerprint, keys[done:], resp.entries, consume, expires)
            finally:
                if fence is None:
                    self._release(m)
                    self._release_lease(stub, resp.lease_id, timeout_s)
                else:
                    self._release_later(fence(), m, stub, resp.lease_id, timeout_s, expires)
            done += status[0]
            if not status[1]:  # a bad entry, a consumer that stopped, or a lease near its end
                return done, status[2]
            if not resp.more:
                return done, True
        return done, True

    def _read(
        self,
        m: ArenaMap,
        fingerprint: bytes,
        keys: Sequence[bytes],
        entries,
        consume: Consume,
        expires: float,
    ) -> tuple[int, bool, bool]:
        """(entries consumed, whether to go on, whether the call is finished if not)."""
        n = 0
        for msg in entries:
            if time.monotonic() > expires:
                log.warning("an in-place lease ran out unread: reading the rest another way")
                return n, False, False
            try:
                header = _checked(msg, keys[n] if n < len(keys) else None, fingerprint, m.size)
            except CorruptEntry as e:
                log.warning("kvstore sent an in-place entry that fails validation", extra={"reason": str(e)})
                return n, False, True
            view = m.view[msg.offset : msg.offset + header.payload_length]
            try:
                self.bytes_in += header.payload_length
                go_on = consume(msg.key, header, view)
            finally:
                with contextlib.suppress(BufferError):
                    view.release()
            n += 1
            if go_on is False:
                return n, False, True
        return n, True, True

    def _release_later(
        self, wait: Callable[[], None], m: ArenaMap, stub, lease_id: int, timeout_s: float, expires: float
    ) -> None:
        """End a lease (and this call's use of the mapping) once `wait` returns, off the caller's thread."""
        with self._lock:
            if self._releaser is None:
                self._releaser = threading.Thread(
                    target=self._release_each, name="llmesh-kv-lease", daemon=True
                )
                self._releaser.start()
        self._releases.put((wait, m, stub, lease_id, timeout_s, expires))

    def _release_each(self) -> None:
        while True:
            wait, m, stub, lease_id, timeout_s, expires = self._releases.get()
            try:
                wait()
            except Exception as e:  # noqa: BLE001  # a failed wait still ends the lease
                log.warning("waiting for copies from the store's arena", extra={"error": repr(e)})
            if time.monotonic() > expires:
                # The store may have reused the slots while they were still being read.
                log.warning("copies from the store's arena outlasted their lease")
            self._release(m)
            self._release_lease(stub, lease_id, timeout_s)
            self._releases.task_done()

    def flush(self) -> None:
        """Wait until every deferred lease has been ended (tests)."""
        self._releases.join()

    def _release_lease(self, stub, lease_id: int, timeout_s: float) -> None:
        if not lease_id:
            return
        try:
            stub.ReleaseInPlace(kvstore_pb2.ReleaseInPlaceRequest(lease_id=lease_id), timeout=timeout_s)
        except grpc.RpcError as e:  # the lease expires on its own
            log.info("could not release an in-place lease", extra={"error": repr(e)})

    def close(self) -> None:
        self.drop()


def _checked(msg, want: bytes | None, fingerprint: bytes, arena_bytes: int) -> EntryHeader:
    if msg.key != want:
        raise CorruptEntry("the reply's entries are not the request's keys in order")
    header = header_from_proto(msg.header)
    if header.fingerprint != fingerprint:
        raise CorruptEntry("entry of another fingerprint")
    end = msg.offset + header.payload_length
    if msg.offset % shm.ALIGN or end > arena_bytes:
        raise CorruptEntry(f"payload at [{msg.offset}, {end}) lies outside the arena of {arena_bytes} bytes")
    return header
