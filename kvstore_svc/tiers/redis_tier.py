"""The Redis tier: shared by every store instance, so a block computed behind one store serves all.

Redis is remote and may be slow or gone; the store must not be. So every call
has short socket timeouts (`timeout_s`, default 0.5 s) and no retries, every
failure is a miss (get/contains) or a skipped write (put), counted and logged,
never raised; and after a failure a circuit breaker skips Redis altogether for
`retry_after_s`, then lets one call through to try again. Keys are
`llmesh:kv:<fingerprint hex>:<key hex>`, values the entry blobs; an optional
TTL expires entries nobody read for that long (reads refresh it). Redis's own
maxmemory policy (allkeys-lru) bounds its size.

Credentials and TLS come in the URL (`redis://USER:PASSWORD@host/db`,
`rediss://...?ssl_ca_certs=ca.pem`; KVStoreConfig checks and builds it). A
wrong password or an ACL user without the rights is one more way of Redis
being down: a miss, logged with a hint, never raised.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore_svc.tiers.base import Counters, EntryKey, TierStats
from kvstore_svc.tiers.redis_url import redact_url

__all__ = ["KEY_PREFIX", "CircuitBreaker", "RedisTier", "redact_url", "redis_key"]

log = logging.getLogger(__name__)

KEY_PREFIX = "llmesh:kv:"


def redis_key(key: EntryKey) -> str:
    return f"{KEY_PREFIX}{key.fingerprint.hex()}:{key.key.hex()}"


def failure_hint(error: Exception) -> str:
    """What an operator should check, for the failures that are not a network problem."""
    if isinstance(error, redis.AuthenticationError):
        return "redis refused the credentials: check the URL's user and --redis-password-file"
    if isinstance(error, redis.exceptions.NoPermissionError):
        return "the redis ACL user may not run this command or touch llmesh:* keys"
    return "redis unavailable"


class CircuitBreaker:
    """Closed (calls go through) until a failure; then open (calls skipped) for `retry_after_s`.

    When that has passed, one caller is let through (half-open); its success
    closes the breaker, its failure opens it for another `retry_after_s`.
    """

    def __init__(self, retry_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._open_until: float | None = None
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def allow(self) -> bool:
        with self._lock:
            if self._open_until is None:
                return True
            now = self._clock()
            if now < self._open_until:
                return False
            # Half-open: this caller tries; the others keep skipping until it reports back.
            self._open_until = now + self.retry_after_s
            return True

    def success(self) -> bool:
        """Close; True if it was open (Redis is back)."""
        with self._lock:
            was_open, self._open_until = self._open_until is not None, None
        return was_open

    def failure(self) -> bool:
        """Open (again); True if it was closed (Redis just went away)."""
        with self._lock:
            was_closed = self._open_until is None
            self._open_until = self._clock() + self.retry_after_s
        return was_closed


class RedisTier:
    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.5,
        retry_after_s: float = 3.0,
        ttl_s: int = 0,
        client: redis.Redis | None = None,
    ) -> None:
        self.url = redact_url(url)
        self.ttl_s = ttl_s
        self.breaker = CircuitBreaker(retry_after_s)
        self._counters = Counters()
        # No retries: a retry is one more timeout the caller waits out; the breaker decides when to retry.
        self._redis = client or redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )

    def _call(self, what: str, fn: Callable[[], object]) -> tuple[bool, object]:
        """(True, result) or (False, None) when skipped by the breaker or failed (counted, logged)."""
        if not self.breaker.allow():
            return False, None
        try:
            result = fn()
        except (redis.RedisError, OSError) as e:
            self._counters.add("errors")
            if self.breaker.failure():
                log.warning(
                    "%s: skipping redis for %.1f s",
                    failure_hint(e),
                    self.breaker.retry_after_s,
                    extra={"url": self.url, "op": what, "error": f"{type(e).__name__}: {e}"},
                )
            else:
                log.debug("redis still unavailable", extra={"op": what, "error": str(e)})
            return False, None
        if self.breaker.success():
            log.info("redis is reachable again", extra={"url": self.url})
        return True, result

    def get(self, key: EntryKey) -> bytes | None:
        name = redis_key(key)
        # GETEX refreshes the TTL on a read: entries in use do not expire.
        fn = (
            (lambda: self._redis.getex(name, ex=self.ttl_s))
            if self.ttl_s
            else (lambda: self._redis.get(name))
        )
        ok, blob = self._call("get", fn)
        if not ok:
            self._counters.add("misses")
            return None
        self._counters.add("hits" if blob is not None else "misses")
        return blob  # type: ignore[return-value]

    def put(self, key: EntryKey, blob: bytes) -> bool:
        ok, _ = self._call("put", lambda: self._redis.set(redis_key(key), blob, ex=self.ttl_s or None))
        if ok:
            self._counters.add("puts")
        return ok

    def contains(self, key: EntryKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[EntryKey]) -> list[bool]:
        if not keys:
            return []

        def exists() -> list[int]:
            pipe = self._redis.pipeline(transaction=False)  # one round trip for the whole chain
            for key in keys:
                pipe.exists(redis_key(key))
            return pipe.execute()

        ok, found = self._call("contains", exists)
        if not ok:
            return [False] * len(keys)
        return [bool(n) for n in found]  # type: ignore[union-attr]

    def delete(self, key: EntryKey) -> bool:
        ok, n = self._call("delete", lambda: self._redis.delete(redis_key(key)))
        return bool(ok and n)

    def note_corrupt(self, key: EntryKey) -> None:
        self._counters.add("corrupt")
        log.warning("corrupt entry in redis deleted", extra={"key": key.hex()})
        self.delete(key)

    def stats(self) -> TierStats:
        # Redis is shared by every store: its size is not ours to report (see Redis INFO).
        return self._counters.snapshot(self.name)

    def close(self) -> None:
        self._redis.close()
