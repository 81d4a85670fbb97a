"""The bulk path (kvstore_svc/bulk.py): entries over TCP, authenticated, bounded, never half-read."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from kvstore_svc import bulk
from kvstore_svc.bulk import BulkClient, BulkError, BulkServer
from kvstore_svc.store import TieredKVStore
from kvstore_svc.tiers.arena import ArenaMemoryTier
from kvstore_svc.tiers.memory import MemoryTier
from services.kv_entry import encode_entry
from tests.helpers.kv_entries import FP, entry, key

KEY = "k" * 32


def _store(tier: str, tmp_path) -> TieredKVStore:
    if tier == "arena":
        return TieredKVStore(memory=ArenaMemoryTier(1 << 20, root=str(tmp_path)))
    return TieredKVStore(memory=MemoryTier(1 << 20))


@pytest.fixture(params=["heap", "arena"])
def served(request, tmp_path):
    store = _store(request.param, tmp_path)
    for i in range(6):
        k, header, data = entry(i, 4096 * (1 + i % 3))
        store.put(FP, k, encode_entry(header, data))
    server = BulkServer(store, KEY).start()
    yield store, server
    server.close()


def test_round_trip_equals_the_store_and_misses_are_none(served) -> None:
    store, server = served
    keys = [key(i) for i in range(6)]
    keys.insert(2, key(99))  # a miss in the middle does not end the answer
    with BulkClient(("127.0.0.1", server.port), KEY, connections=3) as client:
        for _ in range(2):  # the connections persist across calls
            got = client.get_many(FP, keys)
            assert got[2] is None
            for k, item in zip(keys, got, strict=True):
                want = store.get(FP, k)
                if want is None:
                    assert item is None
                    continue
                assert item is not None
                assert item[0] == want[0] and bytes(item[1]) == bytes(want[1])
    assert server.bytes_out > 0


def test_payloads_land_in_buffers_the_caller_gives(served) -> None:
    _, server = served
    staging = bytearray(64 << 10)
    offsets: dict[int, int] = {}

    def alloc(i, header):
        offsets[i] = i * 16384
        return memoryview(staging)[offsets[i] : offsets[i] + header.payload_length]

    with BulkClient(("127.0.0.1", server.port), KEY, connections=2) as client:
        got = client.get_many(FP, [key(i) for i in range(3)], alloc=alloc)
    for i, (header, view) in enumerate(got):  # type: ignore[misc]
        assert (
            bytes(staging[offsets[i] : offsets[i] + header.payload_length])
            == entry(i, header.payload_length)[2]
        )
        assert view.obj is staging


def test_a_wrong_key_is_refused(served) -> None:
    _, server = served
    with BulkClient(("127.0.0.1", server.port), "w" * 32, connections=2) as client:
        with pytest.raises(BulkError):
            client.get_many(FP, [key(0), key(1)])
    assert server.refused == 2


def _authenticated(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    hello = bulk.recv_exact(sock, 8 + bulk.NONCE_BYTES)
    sock.sendall(bulk.auth_mac(KEY.encode(), bytes(hello[8:])))
    assert bulk.recv_exact(sock, 1) == b"\x01"
    return sock


def test_an_oversized_request_is_refused_before_it_is_read(served) -> None:
    _, server = served
    sock = _authenticated(server.port)
    sock.sendall(struct.pack("<I", 0xFFFFFFFF))  # 4 GiB announced, nothing sent
    assert sock.recv(1) == b""  # closed at once: nothing was allocated or awaited
    assert server.refused == 1


def _fake_store(frames: bytes) -> tuple[int, threading.Thread]:
    """A server that authenticates anyone and answers `frames` to the first request, then hangs up."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            conn.sendall(struct.pack("<4sI", bulk.MAGIC, bulk.VERSION) + b"n" * bulk.NONCE_BYTES)
            bulk.recv_exact(conn, bulk.MAC_BYTES)
            conn.sendall(b"\x01")
            (n,) = struct.unpack("<I", bulk.recv_exact(conn, 4))
            bulk.recv_exact(conn, n)
            conn.sendall(frames)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, thread


def _frame(i: int) -> tuple[bytes, bytes]:
    from services.kv_entry import header_to_proto

    _, header, data = entry(i)
    head = header_to_proto(header).SerializeToString()
    return struct.pack("<IQ", len(head), len(data)) + head, data


def test_a_connection_broken_mid_entry_gives_misses_not_corrupt_data() -> None:
    head0, data0 = _frame(0)
    head1, data1 = _frame(1)
    port, thread = _fake_store(head0 + data0 + head1 + data1[:1000])  # then the store hangs up
    with BulkClient(("127.0.0.1", port), KEY, connections=1) as client:
        got = client.get_many(FP, [key(0), key(1), key(2)])
    thread.join(5)
    assert got[0] is not None and bytes(got[0][1]) == data0
    assert got[1] is None and got[2] is None


def test_a_peer_announcing_a_huge_payload_is_refused_without_allocating() -> None:
    head0, _ = _frame(0)
    head_len = struct.unpack("<IQ", head0[:12])[0]
    port, thread = _fake_store(struct.pack("<IQ", head_len, 1 << 60) + head0[12:])
    with BulkClient(("127.0.0.1", port), KEY, connections=1, max_payload_bytes=1 << 20) as client:
        got = client.get_many(FP, [key(0)])
    thread.join(5)
    assert got == [None]
