"""The Redis tier against a real redis-server: prefixed keys, TTL, and a dead or hung Redis as a miss."""

from __future__ import annotations

import time

import pytest

from kvstore_svc.tiers.base import EntryKey
from kvstore_svc.tiers.redis_tier import CircuitBreaker, RedisTier, redact_url, redis_key


def k(i: int, fp: bytes = b"\x01\x02") -> EntryKey:
    return EntryKey(fp, bytes([i]) * 4)


@pytest.fixture
def tier(redis_server):
    t = RedisTier(redis_server.url, timeout_s=0.2, retry_after_s=0.3)
    yield t
    t.close()


def test_put_get_contains_delete_under_prefixed_keys(tier, redis_server):
    assert tier.put(k(1), b"blob-1")
    assert tier.get(k(1)) == b"blob-1" and tier.get(k(2)) is None
    assert redis_server.client().keys("*") == [b"llmesh:kv:0102:01010101"]
    assert redis_key(k(1)) == "llmesh:kv:0102:01010101"
    assert tier.contains_many([k(1), k(2), k(1)]) == [True, False, True]
    assert tier.get(k(1, b"\x09")) is None  # another fingerprint, another key space
    assert tier.delete(k(1)) and not tier.delete(k(1))
    s = tier.stats()
    assert (s.hits, s.misses, s.puts, s.errors) == (1, 2, 1, 0)


def test_ttl_is_set_and_refreshed_by_reads(redis_server):
    tier = RedisTier(redis_server.url, ttl_s=100)
    tier.put(k(1), b"x")
    raw = redis_server.client()
    raw.expire(redis_key(k(1)), 5)
    assert tier.get(k(1)) == b"x"
    assert raw.ttl(redis_key(k(1))) > 50  # GETEX refreshed it
    tier.close()


def test_a_dead_redis_is_a_miss_then_skipped_until_the_retry(tier, redis_server):
    tier.put(k(1), b"x")
    redis_server.kill()
    assert tier.get(k(1)) is None
    assert not tier.put(k(2), b"y")
    assert tier.breaker.is_open and tier.stats().errors == 1
    started = time.monotonic()
    for _ in range(100):  # the breaker is open: no network at all
        assert tier.get(k(1)) is None and tier.contains_many([k(1)]) == [False]
    assert time.monotonic() - started < 0.1
    assert tier.stats().errors == 1
    redis_server.start()  # same port, empty
    time.sleep(0.35)
    assert tier.put(k(2), b"y") and tier.get(k(2)) == b"y"
    assert not tier.breaker.is_open


def test_a_hung_redis_costs_one_timeout_then_is_skipped(tier, redis_server):
    tier.put(k(1), b"x")
    redis_server.pause()
    try:
        started = time.monotonic()
        assert tier.get(k(1)) is None
        assert time.monotonic() - started < 1.0  # the socket timeout (0.2 s), not forever
        started = time.monotonic()
        assert tier.get(k(1)) is None and not tier.put(k(3), b"z")
        assert time.monotonic() - started < 0.05
    finally:
        redis_server.resume()
    time.sleep(0.35)
    assert tier.get(k(1)) == b"x"


def test_circuit_breaker_opens_lets_one_caller_retry_and_closes():
    now = [0.0]
    b = CircuitBreaker(3.0, clock=lambda: now[0])
    assert b.allow() and b.failure()  # closed -> open
    assert not b.allow()
    now[0] = 3.0
    assert b.allow()  # half-open: one caller tries
    assert not b.allow()  # the others keep skipping meanwhile
    assert not b.failure()  # still down: open again
    now[0] = 6.0
    assert b.allow() and b.success() and not b.is_open
    assert b.allow()


def test_passwords_stay_out_of_logs():
    assert redact_url("redis://:s3cret@host:6380/1") == "redis://:***@host:6380/1"
    assert redact_url("redis://user:s3cret@host/0") == "redis://user:***@host/0"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"
