"""Stored responses of the Responses API (`store: true`), behind one small interface.

A record is a JSON object (the response as `GET /v1/responses/{id}` returns it, and the
conversation that `previous_response_id` continues); it is kept as JSON text, never pickled,
so that a record read back is a copy and a Redis holding them is only ever handed data.

- `MemoryResponseStore` (the default): this process's memory, at most `max_entries` records,
  each for `ttl_s` seconds; the oldest go first. With several gateway processes or replicas,
  a response is found only by the process that made it.
- `RedisResponseStore` (`--responses-redis-url`): shared by every gateway process and replica
  (a conversation continues on whichever answers), each record with Redis's own expiry.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from gateway.errors import APIError

Record = dict[str, Any]
REDIS_PREFIX = "llmesh:responses:"  # deploy/'s Redis ACL grants the mesh `llmesh:*` keys


class ResponseStore(Protocol):
    async def put(self, response_id: str, record: Record) -> None: ...

    async def get(self, response_id: str) -> Record | None: ...

    async def delete(self, response_id: str) -> bool:
        """Whether there was such a record."""
        ...

    async def close(self) -> None: ...


class MemoryResponseStore:
    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError(
                f"a response store needs max_entries >= 1 and ttl_s > 0, got {max_entries}, {ttl_s}"
            )
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._records: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (expiry, JSON)

    def __len__(self) -> int:
        return len(self._records)

    def _expire(self, now: float) -> None:
        # One TTL for all: insertion order is expiry order, so the expired are at the front.
        while self._records:
            expiry, _ = next(iter(self._records.values()))
            if expiry > now:
                return
            self._records.popitem(last=False)

    async def put(self, response_id: str, record: Record) -> None:
        now = self.clock()
        self._expire(now)
        self._records.pop(response_id, None)
        self._records[response_id] = (now + self.ttl_s, json.dumps(record))
        while len(self._records) > self.max_entries:
            self._records.popitem(last=False)

    async def get(self, response_id: str) -> Record | None:
        self._expire(self.clock())
        entry = self._records.get(response_id)
        return None if entry is None else json.loads(entry[1])

    async def delete(self, response_id: str) -> bool:
        self._expire(self.clock())
        return self._records.pop(response_id, None) is not None

    async def close(self) -> None:
        self._records.clear()


class RedisResponseStore:
    def __init__(self, url: str, ttl_s: float, client: Any = None) -> None:
        import redis.asyncio

        if ttl_s <= 0:
            raise ValueError(f"a response store needs ttl_s > 0, got {ttl_s}")
        self.ttl_s = max(1, math.ceil(ttl_s))
        self.redis = client or redis.asyncio.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)

    @staticmethod
    def _key(response_id: str) -> str:
        return REDIS_PREFIX + response_id

    async def _call(self, fn: Callable[[], Any]) -> Any:
        import redis

        try:
            return await fn()
        except (redis.RedisError, OSError) as e:
            # The URL may carry a password: name the failure, never the address.
            raise APIError(
                503, f"The response store is unavailable: {type(e).__name__}.", code="service_unavailable"
            ) from None

    async def put(self, response_id: str, record: Record) -> None:
        await self._call(lambda: self.redis.set(self._key(response_id), json.dumps(record), ex=self.ttl_s))

    async def get(self, response_id: str) -> Record | None:
        raw = await self._call(lambda: self.redis.get(self._key(response_id)))
        if raw is None:
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            return None  # not a record of ours: as good as none
        return record if isinstance(record, dict) else None

    async def delete(self, response_id: str) -> bool:
        return bool(await self._call(lambda: self.redis.delete(self._key(response_id))))

    async def close(self) -> None:
        await self.redis.aclose()


def open_store(redis_url: str | None, max_entries: int, ttl_s: float) -> ResponseStore:
    """Redis when a URL is configured, else this process's memory."""
    if redis_url:
        return RedisResponseStore(redis_url, ttl_s)
    return MemoryResponseStore(max_entries, ttl_s)
