"""The KV store service as a real process on loopback: its clients, hostile input, Redis coming and going."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore_svc.client import AsyncKVStoreClient, KVStoreClient, KVStoreError, KVStoreUnavailable
from llmesh.v1 import kvstore_pb2 as kv
from llmesh.v1 import kvstore_pb2_grpc as kvg
from services.grpc_server import open_sync_channel
from services.kv_entry import EntryHeader, header_to_proto
from services.launcher import free_port, grpc_serving, wait_until
from tests.helpers.kv_entries import FP, OTHER_FP, entry, key

MiB = 1 << 20


class StoreProcess:
    """`python -m kvstore_svc.service` on a free loopback port, its log in `log_dir`."""

    def __init__(self, log_dir: Path, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = log_dir / f"kvstore-{self.port}.log"
        cmd = [sys.executable, "-m", "kvstore_svc.service", "--port", str(self.port), *args]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: grpc_serving(self.address), "kvstore", [self.proc], 60)
        except Exception as e:
            self.proc.kill()
            raise RuntimeError(f"{e}\n{self.log.read_text()[-3000:]}") from e

    def stop(self) -> int:
        """SIGTERM: drain, exit 0."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = StoreProcess(
        tmp_path_factory.mktemp("kvstore"), "--memory-bytes", "256MiB", "--max-entry-bytes", "16MiB"
    )
    yield s
    assert s.stop() == 0, s.log.read_text()[-3000:]


@pytest.fixture
def client(store):
    with KVStoreClient(store.address, timeout_s=30) as c:
        yield c


def fresh_fp(name: str) -> bytes:
    """A fingerprint of the test's own, so that tests sharing the module's store stay apart."""
    return (name.encode() * 64)[:32]


def entries(fp: bytes, sizes: list[int], first: int = 0) -> list[tuple[bytes, EntryHeader, bytes]]:
    return [entry(first + i, n, fp) for i, n in enumerate(sizes)]


def test_health_and_reflection(store):
    with open_sync_channel(store.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="llmesh.v1.KVStore")
        )
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = list(
            refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        )
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"llmesh.v1.KVStore", "grpc.health.v1.Health"} <= names


def test_round_trip_of_entries_bigger_than_a_grpc_message(client):
    fp = fresh_fp("roundtrip")
    ents = entries(fp, [6 * MiB, 5 * MiB + 8, 1024])  # pieces of 1 MiB; gRPC's default limit is 4 MiB
    keys = [k for k, _, _ in ents]
    assert client.put(fp, ents) == 3
    assert client.lookup(fp, keys) == 3
    assert client.lookup(fp, [keys[0], key(99, fp), keys[2]]) == 1  # the chain stops at its first miss
    got = client.get(fp, keys + [key(99, fp)])
    assert got == ents
    assert client.get(fp, [key(99, fp), keys[0]]) == []
    assert client.lookup(OTHER_FP, keys) == 0  # another fingerprint, another key space
    assert client.delete(fp, keys[1:2]) == 1 and client.lookup(fp, keys) == 1
    stats = client.stats()
    assert stats.bytes_in >= 11 * MiB and stats.bytes_out >= 11 * MiB
    assert stats.tiers[0].name == "memory" and stats.tiers[0].entries >= 2


def test_async_client_round_trip(store):
    fp = fresh_fp("async")
    ents = entries(fp, [5 * MiB, 4096])

    async def go() -> tuple[int, int, list]:
        async with AsyncKVStoreClient(store.address, timeout_s=30) as c:
            stored = await c.put(fp, ents)
            n = await c.lookup(fp, [k for k, _, _ in ents])
            return stored, n, await c.get(fp, [k for k, _, _ in ents])

    stored, n, got = asyncio.run(go())
    assert (stored, n) == (2, 2) and got == ents


def _put_raw(address: str, messages: list[kv.PutRequest]) -> kv.PutResponse:
    with open_sync_channel(address) as ch:
        return kvg.KVStoreStub(ch).Put(iter(messages), timeout=30)


def _bad_streams(fp: bytes) -> dict[str, tuple[list[kv.PutRequest], str]]:
    """name -> (a Put stream whose SECOND entry is bad, a phrase the error must contain)."""
    good_k, good_h, good_p = entry(0, 4096, fp)
    k, h, p = entry(1, 2 * MiB, fp)
    hp = header_to_proto(h)
    good = [kv.PutRequest(fingerprint=fp, key=good_k, header=header_to_proto(good_h), data=good_p)]

    def with_header(**change) -> kv.PutRequest:
        bad = kv.EntryHeader()
        bad.CopyFrom(hp)
        for name, value in change.items():
            if name == "shape":
                del bad.shape[:]
                bad.shape.extend(value)
            else:
                setattr(bad, name, value)
        return kv.PutRequest(key=k, header=bad, data=p[:MiB])

    first = kv.PutRequest(key=k, header=hp, data=p[:MiB])
    return {
        "stream ends short of the payload": (good + [first], "stream ended"),
        "more data than the header says": (
            good + [first, kv.PutRequest(data=p[MiB:] + b"x")],
            "more payload",
        ),
        "bad checksum": (
            good + [with_header(checksum=h.checksum ^ 1), kv.PutRequest(data=p[MiB:])],
            "checksum",
        ),
        "header fingerprint differs": (
            good + [with_header(fingerprint=OTHER_FP), kv.PutRequest(data=p[MiB:])],
            "fingerprint",
        ),
        "stream fingerprint changes": (
            good + [kv.PutRequest(fingerprint=OTHER_FP, key=k, header=hp)],
            "one fingerprint",
        ),
        "shape does not match the length": (good + [with_header(shape=[1, 2, 3])], "payload_length"),
        "unknown dtype": (good + [with_header(dtype="complex128")], "dtype"),
        "future format version": (good + [with_header(format_version=7)], "version"),
        "over --max-entry-bytes": (
            good + [with_header(shape=[1, 4, 4 * MiB], payload_length=64 * MiB)],
            "exceeds",
        ),
        "key too long": (good + [kv.PutRequest(key=b"k" * 65, header=hp, data=p[:MiB])], "key"),
        "data with no header": (good + [kv.PutRequest(data=b"orphan")], "no entry header"),
    }


@pytest.mark.parametrize("case", list(_bad_streams(b"x" * 32)))
def test_bad_entries_are_invalid_argument_and_change_nothing(store, client, case):
    fp = fresh_fp(f"bad-{case}")
    messages, needle = _bad_streams(fp)[case]
    with pytest.raises(grpc.RpcError) as e:
        _put_raw(store.address, messages)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details() and "1 earlier entries stored" in e.value.details(), e.value.details()
    assert client.lookup(fp, [key(0, fp)]) == 1  # the good entry before it was stored
    assert client.lookup(fp, [key(1, fp)]) == 0  # the bad one was not
    assert client.lookup(fp, [b"k" * 64]) == 0


def test_a_put_stream_without_a_fingerprint_is_refused(store):
    k, h, p = entry(0, 4096)
    with pytest.raises(grpc.RpcError) as e:
        _put_raw(store.address, [kv.PutRequest(key=k, header=header_to_proto(h), data=p)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "fingerprint" in e.value.details()


@pytest.mark.parametrize(
    "fp,keys,needle",
    [
        (b"", [b"k"], "fingerprint"),
        (b"f" * 65, [b"k"], "fingerprint"),
        (FP, [b""], "key 0"),
        (FP, [b"k"] * 20000, "keys"),
    ],
)
def test_malformed_lookups_are_invalid_argument(client, fp, keys, needle):
    with pytest.raises(KVStoreError) as e:
        client.lookup(fp, keys)
    assert not isinstance(e.value, KVStoreUnavailable)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and needle in str(e.value)


def test_an_unknown_fingerprint_is_a_miss(client):
    assert client.lookup(b"never-seen", [key(1)]) == 0 and client.get(b"never-seen", [key(1)]) == []


def test_a_message_over_the_limit_is_refused_and_the_store_serves_on(store, client):
    fp = fresh_fp("huge-message")
    k, h, p = entry(0, 12 * MiB, fp)
    with pytest.raises(grpc.RpcError) as e:  # one 12 MiB message: over the store's 8 MiB
        _put_raw(store.address, [kv.PutRequest(fingerprint=fp, key=k, header=header_to_proto(h), data=p)])
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.lookup(fp, [k]) == 0
    assert client.put(fp, [(k, h, p)]) == 1  # the same entry in pieces is fine


def _call_raw(ch: grpc.Channel, method: str, body: bytes) -> object:
    """Call a method with `body` as the request bytes (no serializers: nothing is parsed client-side)."""
    path = f"/llmesh.v1.KVStore/{method}"
    if method == "Get":
        return list(ch.unary_stream(path)(body, timeout=10))
    return ch.unary_unary(path)(body, timeout=10)


def test_random_bytes_get_an_error_status_and_the_store_serves_on(store, client):
    import random

    rng = random.Random(7)
    with open_sync_channel(store.address) as ch:
        for method in ("Lookup", "Get", "Delete", "Stats"):
            for size in (1, 17, 4096):
                try:
                    _call_raw(ch, method, bytes(rng.randrange(256) for _ in range(size)))
                except grpc.RpcError as e:  # random bytes may also parse as a message: OK then
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
        raw_put = ch.stream_unary("/llmesh.v1.KVStore/Put")
        with pytest.raises(grpc.RpcError) as e:
            raw_put(iter([bytes(rng.randrange(256) for _ in range(4096)) for _ in range(3)]), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert client.lookup(FP, [key(1)]) == 0 and client.stats().lookups > 0


def test_client_mistakes_and_refusals_are_told_apart_from_an_unreachable_store(client):
    fp = fresh_fp("client-errors")
    k, h, p = entry(0, 4096, fp)
    with pytest.raises(ValueError, match="fingerprint"):
        client.put(OTHER_FP, [(k, h, p)])
    with pytest.raises(KVStoreError) as e:
        client.put(fp, [(k, h, p[::-1])])  # payload that does not match its header
    assert not isinstance(e.value, KVStoreUnavailable) and e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    dead = KVStoreClient(f"127.0.0.1:{free_port()}", timeout_s=2)
    started = time.monotonic()
    for call in (lambda: dead.lookup(fp, [k]), lambda: dead.get(fp, [k]), lambda: dead.put(fp, [(k, h, p)])):
        with pytest.raises(KVStoreUnavailable):
            call()
    assert time.monotonic() - started < 6
    dead.close()


def test_lookups_are_not_stalled_by_a_large_transfer(store):
    fp = fresh_fp("concurrent")
    big = entries(fp, [12 * MiB] * 4)
    small = entries(fp, [4096], first=100)
    with KVStoreClient(store.address, timeout_s=30) as c:
        c.put(fp, small)
    done = threading.Event()
    errors: list[BaseException] = []
    transfer_s: list[float] = []

    def transfer() -> None:
        try:
            with KVStoreClient(store.address, timeout_s=60) as c:
                started = time.monotonic()
                for _ in range(2):
                    assert c.put(fp, big) == 4
                    assert len(c.get(fp, [k for k, _, _ in big])) == 4
                transfer_s.append(time.monotonic() - started)
        except BaseException as e:  # surfaced below
            errors.append(e)
        finally:
            done.set()

    latencies: dict[str, list[float]] = {"a": [], "b": []}

    def prober(name: str) -> None:
        with KVStoreClient(store.address, timeout_s=10) as c:
            while not done.is_set():
                started = time.monotonic()
                assert c.lookup(fp, [small[0][0]]) == 1
                assert c.get(fp, [small[0][0]]) == small
                latencies[name].append(time.monotonic() - started)

    threads = [threading.Thread(target=transfer)] + [
        threading.Thread(target=prober, args=(n,)) for n in latencies
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    worst = max(max(v) for v in latencies.values())
    assert all(len(v) >= 5 for v in latencies.values()), latencies
    # "Not stalled": each small call took a small fraction of the transfer, never the whole of it.
    assert worst < max(0.5, transfer_s[0] / 4), (worst, transfer_s, {n: len(v) for n, v in latencies.items()})


def test_byte_budget_evicts_the_least_recently_used(tmp_path):
    s = StoreProcess(tmp_path, "--memory-bytes", "50000")
    try:
        with KVStoreClient(s.address) as c:
            ents = entries(FP, [16000] * 4)  # about 16.1 KB stored each: three fit
            keys = [k for k, _, _ in ents]
            assert c.put(FP, ents[:3]) == 3
            assert c.get(FP, keys[:1]) == ents[:1]  # 0 is now the most recently used
            assert c.put(FP, ents[3:]) == 1
            assert [c.lookup(FP, [k]) for k in keys] == [1, 0, 1, 1]
            mem = c.stats().tiers[0]
            assert mem.evictions == 1 and mem.bytes <= 50000 and mem.entries == 3
    finally:
        assert s.stop() == 0


def test_disk_tier_survives_a_restart(tmp_path):
    args = ("--memory-bytes", "1MiB", "--disk-dir", str(tmp_path / "disk"), "--disk-bytes", "64MiB")
    ents = entries(FP, [2 * MiB, 3000, 5 * MiB])
    s = StoreProcess(tmp_path, *args)
    try:
        with KVStoreClient(s.address, timeout_s=30) as c:
            assert c.put(FP, ents) == 3
    finally:
        assert s.stop() == 0
    s = StoreProcess(tmp_path, *args, port=s.port)
    try:
        with KVStoreClient(s.address, timeout_s=30) as c:
            assert c.lookup(FP, [k for k, _, _ in ents]) == 3
            assert c.get(FP, [k for k, _, _ in ents]) == ents
            # 3 entries from disk; the 2 MiB one, too big for the 1 MiB arena, is read once for
            # the in-place attempt (which cannot lease it) and once more by the fallback.
            assert c.stats().tiers[1].hits == 4
    finally:
        assert s.stop() == 0


@pytest.fixture
def redis_args(redis_server) -> tuple[str, ...]:
    # A memory tier of two 16 KB entries: older entries live in Redis only.
    return (
        "--memory-bytes", "40000",
        "--redis-url", redis_server.url,
        "--redis-timeout-s", "0.2",
        "--redis-retry-after-s", "0.5",
    )  # fmt: skip


def test_a_restarted_store_finds_its_entries_in_redis(tmp_path, redis_server, redis_args):
    ents = entries(FP, [16000] * 5)
    keys = [k for k, _, _ in ents]
    s = StoreProcess(tmp_path, *redis_args)
    try:
        with KVStoreClient(s.address) as c:
            assert c.put(FP, ents) == 5
    finally:
        assert s.stop() == 0
    assert len(redis_server.client().keys("llmesh:kv:*")) == 5
    s = StoreProcess(tmp_path, *redis_args, port=s.port)
    try:
        with KVStoreClient(s.address) as c:
            assert c.lookup(FP, keys) == 5
            assert c.get(FP, keys) == ents
    finally:
        assert s.stop() == 0


def test_redis_killed_mid_run_is_a_miss_and_is_used_again_once_back(tmp_path, redis_server, redis_args):
    ents = entries(FP, [16000] * 6)
    keys = [k for k, _, _ in ents]
    s = StoreProcess(tmp_path, *redis_args)
    try:
        with KVStoreClient(s.address, timeout_s=5) as c:
            assert c.put(FP, ents[:4]) == 4  # 0 and 1 now live in Redis only
            assert c.lookup(FP, keys[:4]) == 4
            redis_server.kill()
            started = time.monotonic()
            assert c.lookup(FP, keys[:4]) == 0  # Redis gone: 0 and 1 are misses
            assert c.get(FP, keys[:4]) == []
            assert c.lookup(FP, keys[2:4]) == 2  # what memory holds still answers
            assert c.get(FP, keys[2:4]) == ents[2:4]
            assert c.put(FP, ents[4:5]) == 1  # written to memory; the Redis write is skipped
            assert time.monotonic() - started < 3.0
            stats = c.stats()
            assert stats.redis_errors >= 1 and stats.redis_circuit_open
            redis_server.start()  # same port, empty
            time.sleep(0.6)  # past --redis-retry-after-s: the next call tries Redis again
            assert c.put(FP, ents[5:6]) == 1
            assert redis_server.client().exists(f"llmesh:kv:{FP.hex()}:{keys[5].hex()}")
            assert not c.stats().redis_circuit_open
    finally:
        assert s.stop() == 0


def test_the_store_refuses_an_anonymous_redis_unless_allowed(tmp_path):
    from tests.helpers.redis_server import RedisServer

    with RedisServer(tmp_path / "redis", password=None) as anonymous:
        cmd = [sys.executable, "-m", "kvstore_svc.service", "--port", str(free_port())]
        refused = subprocess.run(
            [*cmd, "--redis-url", anonymous.url], capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 2 and "--redis-allow-anonymous" in refused.stderr
        s = StoreProcess(
            tmp_path, "--memory-bytes", "0", "--redis-url", anonymous.url, "--redis-allow-anonymous"
        )
        try:
            with KVStoreClient(s.address, timeout_s=5) as c:
                ents = entries(FP, [1000])
                assert c.put(FP, ents) == 1 and c.get(FP, [ents[0][0]]) == ents
        finally:
            assert s.stop() == 0


def test_a_wrong_redis_password_is_a_miss_and_the_store_serves_on(tmp_path, redis_server):
    wrong = redis_server.url.replace(redis_server.password, "not-the-password")
    s = StoreProcess(tmp_path, "--memory-bytes", "40000", "--redis-url", wrong, "--redis-timeout-s", "0.2")
    try:
        with KVStoreClient(s.address, timeout_s=5) as c:
            ents = entries(FP, [16000] * 3)
            assert c.put(FP, ents) == 3  # memory takes them; Redis refuses us: skipped, counted
            assert c.lookup(FP, [ents[0][0]]) == 0  # evicted from memory, never in Redis: a miss
            stats = c.stats()
            assert stats.redis_errors >= 1 and stats.redis_circuit_open
        assert redis_server.client().keys("llmesh:kv:*") == []
    finally:
        assert s.stop() == 0
    log = s.log.read_text()
    assert "refused the credentials" in log and "not-the-password" not in log


def test_an_acl_user_with_its_password_in_a_file(tmp_path):
    from tests.helpers.redis_server import RedisServer

    with RedisServer(tmp_path / "redis", user="llmesh") as server:
        secret = tmp_path / "redis-password"
        secret.write_text(server.password + "\n")
        url = f"redis://llmesh@127.0.0.1:{server.port}/0"  # no secret on the command line
        s = StoreProcess(
            tmp_path, "--memory-bytes", "0", "--redis-url", url, "--redis-password-file", str(secret)
        )
        try:
            with KVStoreClient(s.address, timeout_s=5) as c:
                ents = entries(FP, [1000] * 2)
                assert c.put(FP, ents) == 2 and c.get(FP, [k for k, _, _ in ents]) == ents
                assert c.stats().redis_errors == 0
            assert len(server.client().keys("llmesh:kv:*")) == 2
        finally:
            assert s.stop() == 0
        assert server.password not in s.log.read_text()


def test_llmesh_kvstore_subcommand_serves(tmp_path):
    port = free_port()
    log = tmp_path / "cli.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmesh.cli", "kvstore", "--port", str(port), "--memory-bytes", "1MiB"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "REDIS_URL": ""},
        )
    try:
        wait_until(lambda: grpc_serving(f"127.0.0.1:{port}"), "llmesh kvstore", [proc], 60)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
