"""The KV store's bulk path: entries between hosts over plain TCP, at the speed of the link.

Why a path beside gRPC: a Get stream moves an entry as 1 MiB protobuf messages, each built,
framed, copied into HTTP/2 frames, parsed and joined again in Python on the other side; a
worker on another host loaded a prefix at ~0.4 GB/s that way (issue 32), slower than
computing it again. Here a store thread hands each entry to the kernel with one
`socket.sendmsg([prefix, header, payload])` straight from where the store keeps it (the
arena slot, leased while it is sent, or the heap blob; no join, no copy in Python), and the
client `recv_into`s the payload straight into one buffer per entry (its own, or one the
caller gives: a pinned staging buffer), over several connections served by as many threads
(socket calls release the GIL). gRPC stays the control plane: Lookup, Put, Stats (which
advertises this path's port, `StatsResponse.bulk_port`) and the fallback when this path
is off or unreachable.

Wire format (all integers little-endian):

* on connect the server sends `MAGIC` (b"LMKB"), a u32 version (1) and a random 32-byte nonce;
  the client answers HMAC-SHA256(mesh key, b"llmesh-kv-bulk-v1" + nonce), 32 bytes; the
  server answers one byte (1) or, for a wrong answer, logs it and closes. Zero trust: the
  path is authenticated with no flag set, by the same mesh secret as every internal RPC
  (services/mesh_secret.py), and the key itself never crosses the wire. A store with no
  mesh key (mutual TLS only) or serving gRPC over TLS runs no bulk path: it has no TLS of
  its own, and KV payloads would cross the network in clear.
* request: u32 length + a serialized `llmesh.v1.GetRequest` (fingerprint, keys), at most
  `MAX_REQUEST_BYTES`, keys checked as every store call checks them.
* response, per key in request order: `<IQ` (header length, payload length; 0/0 = a miss),
  the `llmesh.v1.EntryHeader` bytes, the payload. Unlike Get, a miss does not end the
  answer: every key gets its slot, so a client may split one chain over connections.

Everything a peer sends is bounded before anything is allocated for it (request length,
key count and sizes; header length <= services/kv_entry.MAX_HEADER_BYTES, payload length
<= the client's bound and equal to the validated header's); nothing is unpickled. Payload
integrity is not this path's job: `KVStoreClient` checks each entry's checksum, and the
worker verifies each entry's keyed MAC (services/kv_mac.py) before a payload reaches a
forward, as for every other path; a connection that breaks mid-entry leaves that entry and
the ones after it misses (the caller recomputes), never a partial payload.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import mmap
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from google.protobuf.message import DecodeError

from kvstore_svc.store import MAX_KEYS_PER_REQUEST, TieredKVStore, check_keys
from llmesh.v1 import kvstore_pb2
from services.kv_entry import (
    MAX_HEADER_BYTES,
    CorruptEntry,
    EntryHeader,
    check_payload,
    header_from_proto,
    header_to_proto,
)

log = logging.getLogger(__name__)

MAGIC = b"LMKB"
VERSION = 1
NONCE_BYTES = 32
MAC_BYTES = 32
AUTH_CONTEXT = b"llmesh-kv-bulk-v1"
_HELLO = struct.Struct("<4sI")
_LEN = struct.Struct("<I")
_ENTRY = struct.Struct("<IQ")  # header length, payload length; 0/0 = miss
_MISS = _ENTRY.pack(0, 0)
# A request of MAX_KEYS_PER_REQUEST 64-byte keys and a 64-byte fingerprint is ~1.1 MB.
MAX_REQUEST_BYTES = 2 << 20
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30  # a client's bound on one entry's payload
# 8: 1 GiB into a staging buffer at 16.9 GB/s on the 16-core H200 host, 9.9 with 4 (kv_bulk.py).
DEFAULT_CONNECTIONS = 8
HANDSHAKE_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 30.0  # a peer that neither reads nor writes for this long is dropped
MAX_CONNECTIONS = 256
# Entries leased (arena) or held (heap) per sendmsg: bounds what one slow client pins.
SEND_KEYS = 16
SEND_BYTES = 64 << 20
SOCKET_BUFFER_BYTES = 4 << 20
# Payloads from this size get an anonymous mapping, not a bytearray: a bytearray is zeroed under the
# GIL (one core for every connection: ~2 GB/s on the H100 host); a mapping's pages are made by the
# kernel at once (MAP_POPULATE, one call instead of a fault per page), the GIL released, on each
# connection's thread.
MMAP_BYTES = 1 << 20
_MMAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)

Alloc = Callable[[int, EntryHeader], Any]  # (index, header) -> writable buffer of payload_length bytes
Found = tuple[EntryHeader, memoryview]
# (index, header, payload) once an entry is whole, on its transfer thread: the caller may start
# moving it on (a worker queues its DMA to the GPU) while the other entries still arrive.
Received = Callable[[int, EntryHeader, memoryview], None]


class BulkError(Exception):
    """The bulk path could not be used at all (connect, handshake): fall back to gRPC."""


def auth_mac(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, AUTH_CONTEXT + nonce, hashlib.sha256).digest()


def _key_bytes(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """`n` bytes (small: prefixes, headers); ConnectionError at EOF."""
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return buf


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket with as few, as large, reads as the kernel gives."""
    pos, n = 0, len(view)
    while pos < n:
        got = sock.recv_into(view[pos:], n - pos)
        if got == 0:
            raise ConnectionError(f"peer closed after {pos} of {n} bytes")
        pos += got


def send_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    """Send the buffers in order with sendmsg (scatter/gather, no join), resuming partial sends."""
    bufs = [b for b in bufs if b.nbytes]
    while bufs:
        sent = sock.sendmsg(bufs[:1024])  # IOV_MAX
        while sent:
            first = bufs[0]
            if sent >= first.nbytes:
                sent -= first.nbytes
                bufs.pop(0)
            else:
                bufs[0] = first[sent:]
                sent = 0


def new_buffer(nbytes: int) -> bytearray | mmap.mmap:
    """A writable buffer for a payload, not zeroed by Python (see MMAP_BYTES)."""
    return mmap.mmap(-1, nbytes, flags=_MMAP_FLAGS) if nbytes >= MMAP_BYTES else bytearray(nbytes)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


# -- server ------------------------------------------------------------------------------


class BulkServer:
    """Serves the store's entries over TCP: one thread accepts, one thread per connection."""

    def __init__(
        self,
        store: TieredKVStore,
        key: str | bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_connections: int = MAX_CONNECTIONS,
        io_timeout_s: float = IO_TIMEOUT_S,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.store = store
        self._key = _key_bytes(key)
        if len(self._key) < 16:
            raise ValueError("the bulk path needs the mesh key (>= 16 bytes)")
        self.max_connections = max_connections
        self.io_timeout_s = io_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host.strip("[]"), port))
        self._listener.listen(64)
        self._listener.settimeout(0.25)  # the accept loop notices close() within this
        self.port: int = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._thread: threading.Thread | None = None
        # Counters (StatsResponse.bulk_*).
        self.bytes_out = 0
        self.refused = 0  # connections closed for a wrong key or a malformed request

    def start(self) -> BulkServer:
        self._thread = threading.Thread(target=self._accept_loop, name="kv-bulk-accept", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                log.warning("kv bulk: too many connections, refusing one", extra={"peer": str(peer)})
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="kv-bulk-conn", daemon=True).start()

    def _refuse(self, peer: object, why: str) -> None:
        with self._lock:
            self.refused += 1
        log.warning("kv bulk: closing a connection", extra={"peer": str(peer), "reason": why})

    def _serve(self, conn: socket.socket, peer: object) -> None:
        try:
            _tune(conn)
            conn.settimeout(self.handshake_timeout_s)
            nonce = os.urandom(NONCE_BYTES)
            conn.sendall(_HELLO.pack(MAGIC, VERSION) + nonce)
            answer = bytes(recv_exact(conn, MAC_BYTES))
            if not hmac.compare_digest(answer, auth_mac(self._key, nonce)):
                self._refuse(peer, "wrong mesh key")
                return
            conn.sendall(b"\x01")
            conn.settimeout(self.io_timeout_s)
            while not self._stop.is_set():
                request = self._read_request(conn, peer)
                if request is None:
                    return
                self._answer(conn, *request)
        except (OSError, ConnectionError) as e:
            if not self._stop.is_set():
                log.debug("kv bulk connection ended", extra={"peer": str(peer), "error": str(e)})
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _read_request(self, conn: socket.socket, peer: object) -> tuple[bytes, list[bytes]] | None:
        """The next request, or None to close (the peer left, or sent something malformed)."""
        head = bytearray(_LEN.size)
        view, got = memoryview(head), 0
        while got < len(head):  # an idle connection waits (persistent), checking for shutdown
            try:
                n = conn.recv_into(view[got:])
            except TimeoutError:
                if got or self._stop.is_set():
                    raise
                continue
            if n == 0:
                return None
            got += n
        (length,) = _LEN.unpack(head)
        if not 0 < length <= MAX_REQUEST_BYTES:  # checked before a byte is allocated for it
            self._refuse(peer, f"request of {length} bytes (at most {MAX_REQUEST_BYTES})")
            return None
        msg = kvstore_pb2.GetRequest()
        try:
            msg.ParseFromString(bytes(recv_exact(conn, length)))
            keys = list(msg.keys)
            check_keys(msg.fingerprint, keys)
        except (DecodeError, ValueError) as e:
            self._refuse(peer, f"malformed request: {e}")
            return None
        return msg.fingerprint, keys

    def _answer(self, conn: socket.socket, fingerprint: bytes, keys: list[bytes]) -> None:
        store = self.store
        i = 0
        while i < len(keys):
            chunk = keys[i : i + SEND_KEYS]
            lease_id = 0
            found: list[Found | None] = []
            try:
                arena = store.arena
                if arena is not None:  # send from the arena slots themselves, leased while sent
                    grant = store.lease_in_place(fingerprint, chunk)
                    lease_id = grant.lease_id
                    size = 0
                    for e in grant.entries:
                        if found and size + e.header.payload_length > SEND_BYTES:
                            break
                        n = e.header.payload_length
                        found.append((e.header, arena.arena.view[e.offset : e.offset + n]))
                        size += n
                if not found:  # the heap tier; or a miss, or an entry not leased (slower tier, no lease left)
                    size = 0
                    for key in chunk:
                        item = store.get(fingerprint, key)
                        found.append(item)
                        size += item[0].payload_length if item is not None else 0
                        if arena is not None or size >= SEND_BYTES:
                            break
                bufs: list[memoryview] = []
                sent = 0
                for item in found:
                    if item is None:
                        bufs.append(memoryview(_MISS))
                        continue
                    header, payload = item
                    head = header_to_proto(header).SerializeToString()
                    bufs += [memoryview(_ENTRY.pack(len(head), payload.nbytes)), memoryview(head), payload]
                    sent += payload.nbytes
                send_all(conn, bufs)
                with self._lock:
                    self.bytes_out += sent
            finally:
                if lease_id:
                    store.release_in_place(lease_id)
            i += len(found)


# -- client ------------------------------------------------------------------------------


class _Connection:
    """One persistent, authenticated connection; used by one thread at a time (its lock)."""

    def __init__(self, address: tuple[str, int], key: bytes, timeout_s: float) -> None:
        self.address = address
        self.key = key
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None

    def connect(self) -> socket.socket:
        if self.sock is not None:
            return self.sock
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
        except OSError as e:
            raise BulkError(f"cannot connect to {self.address[0]}:{self.address[1]}: {e}") from None
        try:
            _tune(sock)
            magic, version = _HELLO.unpack(recv_exact(sock, _HELLO.size))
            if magic != MAGIC or version != VERSION:
                raise BulkError(f"not a kv bulk server (or version {version}, this client speaks {VERSION})")
            nonce = bytes(recv_exact(sock, NONCE_BYTES))
            sock.sendall(auth_mac(self.key, nonce))
            if recv_exact(sock, 1) != b"\x01":
                raise BulkError("the store refused the handshake")
        except (OSError, ConnectionError) as e:
            sock.close()
            raise BulkError(f"kv bulk handshake failed (wrong mesh key?): {e}") from None
        except BulkError:
            sock.close()
            raise
        self.sock = sock
        return sock

    def drop(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    def fetch(
        self,
        fingerprint: bytes,
        indices: Sequence[int],
        keys: Sequence[bytes],
        out: list[Found | None],
        alloc: Alloc | None,
        max_payload_bytes: int,
        verify: bool = False,
        received: Received | None = None,
    ) -> None:
        """Fill out[i] for i in indices (keys[i]); what is not received stays None."""
        with self.lock:
            for start in range(0, len(indices), MAX_KEYS_PER_REQUEST):
                part = indices[start : start + MAX_KEYS_PER_REQUEST]
                body = kvstore_pb2.GetRequest(fingerprint=fingerprint, keys=[keys[i] for i in part])
                request = _LEN.pack(body.ByteSize()) + body.SerializeToString()
                first = self._send(request)
                if first is None:
                    return
                try:
                    self._read_entries(
                        self.sock, fingerprint, part, first, out, alloc, max_payload_bytes, verify, received
                    )
                except (OSError, ConnectionError, CorruptEntry, DecodeError) as e:
                    self.drop()  # out of step with the stream: the rest of this part are misses
                    log.warning("kv bulk transfer broke", extra={"error": str(e)})
                    return

    def _send(self, request: bytes) -> bytearray | None:
        """Send a request and read its first entry prefix; None when the connection broke.

        A persistent connection the store closed meanwhile (it restarted, or dropped us idle)
        is made again once. BulkError when no connection can be made."""
        for attempt in (0, 1):
            fresh = self.sock is None
            sock = self.connect()
            try:
                sock.sendall(request)
                return recv_exact(sock, _ENTRY.size)
            except (OSError, ConnectionError) as e:
                self.drop()
                if fresh or attempt:
                    log.warning("kv bulk request failed", extra={"error": str(e)})
                    return None
        return None

    def _read_entries(
        self,
        sock: socket.socket,
        fingerprint: bytes,
        part: Sequence[int],
        first: bytearray,
        out: list[Found | None],
        alloc: Alloc | None,
        max_payload_bytes: int,
        verify: bool,
        received: Received | None,
    ) -> None:
        prefix: bytearray | None = first
        for i in part:
            if prefix is None:
                prefix = recv_exact(sock, _ENTRY.size)
            head_len, payload_len = _ENTRY.unpack(prefix)
            prefix = None
            if head_len == 0 and payload_len == 0:
                continue  # a miss
            if not 0 < head_len <= MAX_HEADER_BYTES or not 0 < payload_len <= max_payload_bytes:
                raise CorruptEntry(f"entry of header {head_len} / payload {payload_len} bytes refused")
            msg = kvstore_pb2.EntryHeader()
            msg.ParseFromString(bytes(recv_exact(sock, head_len)))
            header = header_from_proto(msg, max_payload_bytes)
            if header.payload_length != payload_len or header.fingerprint != fingerprint:
                raise CorruptEntry("entry header does not match its frame or the request")
            buf = alloc(i, header) if alloc is not None else new_buffer(payload_len)
            view = memoryview(buf).cast("B")
            if view.nbytes != payload_len or view.readonly:
                raise ValueError(f"alloc gave {view.nbytes} bytes for a payload of {payload_len}")
            recv_into_exact(sock, view)
            if verify:
                try:
                    check_payload(header, view)
                except CorruptEntry as e:  # framing is intact: a miss, the stream goes on
                    log.warning("kv bulk entry fails its checksum", extra={"reason": str(e)})
                    continue
            if received is not None:
                received(i, header, view)
            out[i] = (header, view)

    def close(self) -> None:
        with self.lock:
            self.drop()


class BulkClient:
    """Gets entries from a store's bulk port over `connections` persistent connections.

    Thread-safe. `get_many` splits the keys over the connections (key i to connection
    i % connections) and reads them on as many threads; connections that break are made
    again on the next call.
    """

    def __init__(
        self,
        address: tuple[str, int] | str,
        key: str | bytes,
        connections: int = DEFAULT_CONNECTIONS,
        *,
        timeout_s: float = 5.0,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        if isinstance(address, str):
            host, _, port = address.rpartition(":")
            address = (host.strip("[]"), int(port))
        self.address = address
        self.max_payload_bytes = max_payload_bytes
        key_bytes = _key_bytes(key)
        self._conns = [_Connection(address, key_bytes, timeout_s) for _ in range(connections)]
        self._pool = ThreadPoolExecutor(connections, thread_name_prefix="kv-bulk")

    def get_many(
        self,
        fingerprint: bytes,
        keys: Sequence[bytes],
        *,
        alloc: Alloc | None = None,
        verify: bool = False,
        received: Received | None = None,
    ) -> list[Found | None]:
        """(header, payload) per key, None for a miss or an entry not received whole.

        Each payload is read straight into its own buffer: `alloc(index, header)` (called on a
        transfer thread) returns a writable buffer of exactly header.payload_length bytes (a
        slice of a pinned staging buffer, say), else a new one (`new_buffer`). Raises BulkError only when
        no connection could be made at all (the caller falls back to gRPC); ValueError for bad keys.
        Entries are framed and their headers validated; `verify` also checks each payload's
        checksum on its transfer thread (overlapping the other transfers), a mismatch a None.
        `received(index, header, payload)` is called on the transfer thread as each entry is
        whole (and verified), before get_many returns: it must not raise.
        """
        check_keys(fingerprint, keys)
        out: list[Found | None] = [None] * len(keys)
        if not keys:
            return out
        n = min(len(self._conns), len(keys))
        shares = [range(c, len(keys), n) for c in range(n)]
        args = (keys, out, alloc, self.max_payload_bytes, verify, received)
        errors: list[BulkError] = []
        if n == 1:  # no thread hop
            try:
                self._conns[0].fetch(fingerprint, shares[0], *args)
            except BulkError as e:
                errors.append(e)
        else:
            futures = [
                self._pool.submit(self._conns[c].fetch, fingerprint, shares[c], *args) for c in range(n)
            ]
            for f in futures:
                try:
                    f.result()
                except BulkError as e:
                    errors.append(e)
        if len(errors) == n:
            raise errors[0]
        for e in errors:
            log.warning("kv bulk connection failed: its keys are misses", extra={"error": str(e)})
        return out

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> BulkClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
